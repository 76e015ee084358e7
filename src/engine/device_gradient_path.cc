// The device GradientPath (CUDA builds): the model's parameters and gradients are GPU memory.
// Gradients go down through DevicePath's ring to pinned host memory while backward runs (with
// several micro-batches, each lands in `landing` and the worker adds it into the fp32 sums);
// with one micro-batch the GPU makes each gradient's squares on the way. The update's chunks
// go up from where their gradient landed (state in host memory: written over it) or from
// pinned staging slots (where the gradients must stay: NVMe state, overlap "backward").
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/strings.h"
#include "engine/device_path.h"
#include "engine/engine_core.h"
#include "engine/gradient_path.h"
#include "engine/param_math.h"

namespace zoffload::internal {
namespace {

class DeviceGradientPath final : public GradientPath {
 public:
  explicit DeviceGradientPath(EngineCore& core) : core_(core) {}

  Status Init() {
    const size_t count = core_.params.size();
    uint64_t widest = 2;  // bytes per element of the widest parameter dtype
    for (const EngineParam& p : core_.params) {
      widest = std::max<uint64_t>(widest, DTypeBytes(p.dtype));
    }
    // Buckets no larger than all the gradients together.
    const uint64_t bucket = std::min<uint64_t>(
        static_cast<uint64_t>(core_.config.zero_optimization.reduce_bucket_size) * widest,
        core_.total * widest);
    gpu_squares_ = core_.accumulation == 1;
    summed_ = std::make_unique<std::atomic<uint64_t>[]>(count);
    for (size_t i = 0; i < count; ++i) summed_[i].store(0);
    extras_.assign(count, 0);
    pieces_to_worker_ = core_.accumulation > 1 || core_.schedule->UpdatesOnLanding();
    DevicePath::Landed landed = [this](DevicePath::Piece piece) {
      core_.worker.Push({piece.host, piece.bytes, piece.tag});
    };
    up_in_place_ = core_.state->home() == StateHome::kHost &&
                   !(core_.schedule->KeepsGradients() && core_.accumulation == 1);
    ZO_ASSIGN_OR_RETURN(device_, DevicePath::Create(*core_.rt, bucket,
                                                    up_in_place_ ? 0 : core_.options.staging_slots,
                                                    core_.state->chunk_elements() * widest,
                                                    std::move(landed), gpu_squares_ ? count : 0));
    return Status::Ok();
  }

  bool on_gpu() const override { return true; }
  Status Allocate(EngineParam& p) override {
    if (core_.accumulation == 1) return Status::Ok();
    return AllocateLanding(p, "the gradient");
  }
  void BeginWindow() override {  // the worker is done with the last window (Step waited)
    for (size_t i = 0; i < core_.params.size(); ++i) summed_[i].store(0);
    std::fill(extras_.begin(), extras_.end(), 0);
  }

  Status Hand(size_t i, const void* grad, bool add, bool last, void* stream) override {
    EngineParam& p = core_.params[i];
    const Future<>* upload = p.upload.valid() ? &p.upload : nullptr;
    const uint32_t tag = WorkItem::Tag(i, add, last);
    if (core_.accumulation == 1) {
      const DevicePath::SquaresTo squares{p.dtype, i};
      return device_->Add(grad, p.bytes(), p.grads.data(), tag, stream, upload, &squares,
                          pieces_to_worker_);
    }
    AwaitSummed(i, static_cast<uint64_t>(p.received) * p.bytes());
    return device_->Add(grad, p.bytes(), p.landing.data(), tag, stream, upload);
  }
  // It lands in `landing` (made for the first), and the worker adds it into the gradient.
  Status HandExtra(size_t i, const void* grad, void* stream) override {
    EngineParam& p = core_.params[i];
    if (p.landing.empty()) {
      ZO_RETURN_IF_ERROR(AllocateLanding(p, "a further micro-batch's gradient"));
    }
    AwaitSummed(i, static_cast<uint64_t>(extras_[i]) * p.bytes());
    ++extras_[i];
    return device_->Add(grad, p.bytes(), p.landing.data(), WorkItem::Tag(i, true, false), stream);
  }
  bool Arrived(const WorkItem& item) override {
    // A failed D2H is not used (Step reports it: WaitLanded), but counted all the same.
    const bool ok = device_->AwaitPiece().ok();
    // Several micro-batches, declared (fp32 sums) or not (in the dtype): it landed in
    // p.landing. (With one declared, a piece that adds is an undeclared one's.)
    if (core_.accumulation == 1 && !item.adds()) return ok;
    const size_t i = item.param();
    EngineParam& p = core_.params[i];
    if (ok) {
      const size_t element = DTypeBytes(p.dtype);
      const uint64_t first = static_cast<uint64_t>(item.host - p.landing.data()) / element;
      const uint64_t n = item.bytes / element;
      if (core_.accumulation > 1) {
        Accumulate(p.grads.as<float>() + first, item.host, p.dtype, n, item.adds());
      } else {
        AddInDtype(p.grads.data() + first * element, item.host, p.dtype, n);
      }
    }
    summed_[i].fetch_add(item.bytes);
    summed_[i].notify_all();
    return ok;
  }
  Status WaitLanded() override { return device_->WaitLanded(); }
  std::optional<GradSquares> Squares(size_t i) const override {
    if (!gpu_squares_ || extras_[i] > 0) return std::nullopt;  // the first gradient's only
    return device_->Squares(i);
  }
  void* InPlaceBuffer(EngineParam& /*p*/) override { return nullptr; }  // the ring copies
  Status Publish(EngineParam& p, const std::byte* from, void* stream) override {
    ZO_ASSIGN_OR_RETURN(p.upload, device_->UploadFrom(p.data, from, p.bytes(), stream));
    return Status::Ok();
  }
  Status AwaitUpload(EngineParam& p) override {
    if (up_in_place_ && p.upload.valid()) return p.upload.Wait();
    return Status::Ok();
  }
  Result<const void*> Values(const EngineParam& p, AlignedBuffer& scratch) override {
    if (scratch.size() < p.bytes()) {
      ZO_ASSIGN_OR_RETURN(scratch, AlignedBuffer::Allocate(p.bytes(), 64));
    }
    ZO_RETURN_IF_ERROR(device_->CopyToHost(scratch.data(), p.data, p.bytes())
                           .WithContext(StrCat("reading parameter '", p.name, "'")));
    return static_cast<const void*>(scratch.data());
  }
  Status WaitParameters(void* stream) override { return device_->WaitParameters(stream); }
  void TakeTransferStats(EngineStepStats* stats) override {
    stats->upload_wait_seconds = device_->upload_wait_seconds() - last_upload_wait_;
    stats->bytes_to_host = device_->bytes_to_host() - last_to_host_;
    stats->bytes_to_gpu = device_->bytes_to_gpu() - last_to_gpu_;
    last_upload_wait_ = device_->upload_wait_seconds();
    last_to_host_ = device_->bytes_to_host();
    last_to_gpu_ = device_->bytes_to_gpu();
  }
  uint64_t host_bytes() const override { return device_->host_bytes(); }
  uint64_t gpu_bytes() const override { return device_->gpu_bytes(); }

  // ParamSink: over the landed gradient (host state) or into a staging slot (NVMe state), and
  // up.
  Result<void*> Begin(size_t t, uint64_t first, uint64_t /*n*/) override {
    EngineParam& p = core_.params[t];
    if (up_in_place_) return static_cast<void*>(p.Landed() + first * DTypeBytes(p.dtype));
    ZO_ASSIGN_OR_RETURN(slot_, device_->AcquireSlot());
    return static_cast<void*>(slot_);
  }
  Status End(size_t t, uint64_t first, uint64_t n, const float* master) override {
    EngineParam& p = core_.params[t];
    const size_t element = DTypeBytes(p.dtype);
    std::byte* from = up_in_place_ ? p.Landed() + first * element : slot_;
    if (p.dtype == DType::kFp32) std::memcpy(from, master, 4 * n);
    void* to = static_cast<std::byte*>(p.data) + first * element;
    if (!up_in_place_) return device_->Upload(to, n * element);
    // The parameter's next gradient lands there after this upload (Add waits for it).
    ZO_ASSIGN_OR_RETURN(p.upload, device_->UploadFrom(to, from, n * element));
    return Status::Ok();
  }

 private:
  // `p.landing`, pinned, for `what` of `p`.
  Status AllocateLanding(EngineParam& p, std::string_view what) {
    ZO_ASSIGN_OR_RETURN(
        p.landing, core_.rt->AllocateHost(p.bytes(), StrCat(what, " of '", p.name, "'"), true));
    return Status::Ok();
  }
  // Blocks until the worker has added `bytes` of parameter i's micro-batches in: the next one
  // lands where the last one did.
  void AwaitSummed(size_t i, uint64_t bytes) {
    for (uint64_t seen = summed_[i].load(); seen < bytes; seen = summed_[i].load()) {
      summed_[i].wait(seen);
    }
  }

  EngineCore& core_;
  std::unique_ptr<DevicePath> device_;
  // With the state in host memory each chunk's new values are written over its gradient where
  // it landed (the update has read it) and uploaded from there; where the gradients must stay
  // (NVMe state, whose failed step may be retried; a speculating schedule, whose step may be
  // redone, with one micro-batch) they go through the staging slots (`slot_`: the chunk being
  // updated).
  bool up_in_place_ = false;
  std::byte* slot_ = nullptr;
  // With one micro-batch the GPU makes each gradient's squares as it goes down.
  bool gpu_squares_ = false;
  // Every piece goes to the worker (sums of declared micro-batches, updates as they land);
  // else only those of undeclared micro-batches.
  bool pieces_to_worker_ = false;
  // The bytes of each parameter's micro-batches the worker has added in this window (the next
  // lands where the last one did), and its undeclared micro-batches (one declared).
  std::unique_ptr<std::atomic<uint64_t>[]> summed_;
  std::vector<int> extras_;
  // The device path's counters at the last TakeTransferStats.
  uint64_t last_to_host_ = 0, last_to_gpu_ = 0;
  double last_upload_wait_ = 0;
};

}  // namespace

Result<std::unique_ptr<GradientPath>> MakeDevicePath(EngineCore& core) {
  auto path = std::make_unique<DeviceGradientPath>(core);
  ZO_RETURN_IF_ERROR(path->Init());
  return std::unique_ptr<GradientPath>(std::move(path));
}

}  // namespace zoffload::internal
