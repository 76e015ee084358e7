#include "engine/device_path.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "common/strings.h"
#include "gpu/copy_engine.h"
#include "gpu/cuda_status.h"
#include "gpu/kernels.h"
#include "gpu/stream.h"

namespace zoffload::internal {
namespace {

constexpr uint64_t kPieceAlign = 256;  // each piece starts 256-byte aligned in the ring
// A squares entry before its gradient's have landed: not finite.
constexpr gpu::DeviceGradNorm kUnknown{std::numeric_limits<double>::quiet_NaN(), ~0u, 0};

// A null stream is the legacy default stream, which the copy engine's non-blocking streams
// are not ordered with unless told.
cudaStream_t AsStream(void* stream) {
  return stream != nullptr ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
}

}  // namespace

struct DevicePath::Region {
  uint64_t offset = 0, bytes = 0;  // in the ring
  Future<> read;                   // the D2H reading it
};

struct DevicePath::Slot {
  HostMemory memory;
  Future<> uploaded;
};

struct DevicePath::Norm {
  gpu::GradNormWorkspace workspace;
  CudaEvent order;
  cudaStream_t stream = nullptr;  // of the newest launch (null: none yet)
  DeviceMemory results;           // gpu::DeviceGradNorm each, written by the last launch
  HostMemory entries;             // where they go down (pinned)
  size_t count = 0;
};

Result<std::unique_ptr<DevicePath>> DevicePath::Create(Runtime& rt, uint64_t bucket_bytes,
                                                       int slots, uint64_t slot_bytes,
                                                       Landed landed, size_t squares) {
  std::unique_ptr<DevicePath> path(new DevicePath());
  path->rt_ = &rt;
  path->landed_ = std::move(landed);
  ZO_CUDA_RETURN_IF_ERROR(cudaSetDevice(rt.options().device));
  ZO_RETURN_IF_ERROR(rt.Copies().status());
  ZO_ASSIGN_OR_RETURN(
      path->ring_,
      rt.AllocateDevice(2 * RoundUp(bucket_bytes, kPieceAlign),
                        "the gradient ring (two buckets of zero_optimization.reduce_bucket_size)"));
  for (int s = 0; s < slots; ++s) {
    auto slot = std::make_unique<Slot>();
    ZO_ASSIGN_OR_RETURN(slot->memory, rt.AllocateHost(slot_bytes, "an upload staging slot", true));
    path->slots_.push_back(std::move(slot));
  }
  if (squares > 0) {
    ZO_ASSIGN_OR_RETURN(gpu::GradNormWorkspace workspace, gpu::GradNormWorkspace::Create());
    ZO_ASSIGN_OR_RETURN(CudaEvent order, CudaEvent::Create());
    const uint64_t bytes = squares * sizeof(gpu::DeviceGradNorm);
    ZO_ASSIGN_OR_RETURN(DeviceMemory results, rt.AllocateDevice(bytes, "the gradients' squares"));
    ZO_ASSIGN_OR_RETURN(HostMemory entries, rt.AllocateHost(bytes, "the gradients' squares", true));
    path->norm_.reset(new Norm{std::move(workspace), std::move(order), nullptr, std::move(results),
                               std::move(entries), squares});
    for (size_t i = 0; i < squares; ++i)
      path->norm_->entries.as<gpu::DeviceGradNorm>()[i] = kUnknown;
  }
  return path;
}

DevicePath::~DevicePath() {
  // Nothing may still read or write our buffers, nor call back into this object.
  WaitLanded().IgnoreError();
  for (auto& slot : slots_) slot->uploaded.Wait().IgnoreError();
  // The host functions behind the last D2H copies too.
  if (auto copies = rt_->Copies(); copies.ok()) {
    const cudaError_t err =
        cudaStreamSynchronize((*copies)->stream(CopyEngine::Direction::kDeviceToHost));
    if (err != cudaSuccess) cudaGetLastError();  // sticky errors were reported by the copies
  }
}

Status DevicePath::Add(const void* grad, uint64_t bytes, std::byte* host, uint32_t tag,
                       void* stream, const Future<>* upload, const SquaresTo* squares,
                       bool to_consumer) {
  const cudaStream_t caller = AsStream(stream);
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  gpu::DeviceGradNorm* entry = nullptr;
  if (squares != nullptr) {
    if (norm_ == nullptr || squares->entry >= norm_->count) {
      return InvalidArgumentError(StrCat("DevicePath::Add: squares entry ", squares->entry, " of ",
                                         norm_ == nullptr ? 0 : norm_->count));
    }
    entry = norm_->entries.as<gpu::DeviceGradNorm>() + squares->entry;
    *entry = kUnknown;  // its last copy down landed before this gradient was made
  }
  bool first = true;
  if (upload != nullptr) {
    ZO_RETURN_IF_ERROR(upload->OrderBefore(copies->stream(CopyEngine::Direction::kDeviceToHost)));
  }
  const auto* src = static_cast<const std::byte*>(grad);
  const uint64_t ring_bytes = ring_.size();
  while (bytes > 0) {
    const uint64_t piece = std::min(bytes, ring_bytes / 2);
    if (head_ + piece > ring_bytes) head_ = 0;
    // Every piece still being copied down from where this one goes (a wrap can leave older
    // pieces behind newer ones, so all are checked).
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      if (it->offset < head_ + piece && it->offset + it->bytes > head_) {
        ZO_RETURN_IF_ERROR(it->read.OrderBefore(caller));
        it = in_flight_.erase(it);
      } else {
        ++it;
      }
    }
    std::byte* slot = ring_.as<std::byte>() + head_;
    ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot, src, piece, cudaMemcpyDeviceToDevice, caller));
    if (entry != nullptr) {
      // After the last piece the result goes to the entry's device slot, then down on the D2H
      // stream ahead of that piece (a copy on the caller's stream would wait for the copy
      // engine's pieces before it, and hold backward up).
      gpu::DeviceGradNorm* result =
          piece == bytes ? norm_->results.as<gpu::DeviceGradNorm>() + squares->entry : nullptr;
      ZO_RETURN_IF_ERROR(AddSquares(slot, piece / DTypeBytes(squares->dtype), squares->dtype,
                                    caller, !first, result));
      if (result != nullptr) {
        Future<> down = copies->DeviceToHost(entry, result, sizeof(*entry), caller);
        if (down.Ready()) ZO_RETURN_IF_ERROR(down.Wait());  // an enqueue error
      }
    }
    first = false;
    Future<> read = copies->DeviceToHost(host, slot, piece, caller);
    if (read.Ready()) ZO_RETURN_IF_ERROR(read.Wait());  // an enqueue error
    while (!landing_.empty() && landing_.front().Ready()) landing_.pop_front();
    landing_.push_back(read);
    if (landed_ && to_consumer) {
      {
        std::lock_guard lock(arriving_mu_);
        arriving_.push_back(read);
      }
      landed_(Piece{host, piece, tag});
    }
    in_flight_.push_back({head_, piece, std::move(read)});
    ++pieces_;
    bytes_to_host_ += piece;
    head_ = std::min(ring_bytes, RoundUp(head_ + piece, kPieceAlign));
    src += piece;
    host += piece;
    bytes -= piece;
  }
  return Status::Ok();
}

Status DevicePath::WaitLanded() {
  if (landing_.empty()) return Status::Ok();
  // The newest piece: the D2H stream, and its callbacks, run in order.
  const Status status = landing_.back().Wait();
  landing_.clear();
  in_flight_.clear();
  return status;
}

Status DevicePath::AwaitPiece() {
  Future<> read;
  {
    std::lock_guard lock(arriving_mu_);
    if (arriving_.empty()) return FailedPreconditionError("AwaitPiece: no piece is on its way");
    read = std::move(arriving_.front());
    arriving_.pop_front();
  }
  return read.Wait();
}

Status DevicePath::AddSquares(const void* piece, uint64_t elements, DType dtype,
                              cudaStream_t stream, bool accumulate, gpu::DeviceGradNorm* result) {
  Norm& n = *norm_;
  // The launches share the workspace: one on another stream goes after the one before.
  if (n.stream != nullptr && n.stream != stream) {
    ZO_RETURN_IF_ERROR(OrderAfter(stream, n.stream, n.order));
  }
  const gpu::DeviceSpan span{piece, elements};
  ZO_RETURN_IF_ERROR(
      gpu::MultiTensorGradNorm({&span, 1}, dtype, n.workspace, stream, accumulate, result));
  n.stream = stream;
  return Status::Ok();
}

GradSquares DevicePath::Squares(size_t entry) const {
  if (norm_ == nullptr || entry >= norm_->count) return {0, false};
  const gpu::DeviceGradNorm& d = norm_->entries.as<const gpu::DeviceGradNorm>()[entry];
  return {d.sum_squares, d.nonfinite == 0};
}

Result<std::byte*> DevicePath::AcquireSlot() {
  if (slots_.empty()) return FailedPreconditionError("DevicePath: made without staging slots");
  Slot& s = *slots_[next_slot_ % slots_.size()];
  const auto start = std::chrono::steady_clock::now();
  ZO_RETURN_IF_ERROR(s.uploaded.Wait());
  upload_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s.memory.data();
}

Status DevicePath::Upload(void* device_dst, uint64_t bytes) {
  Slot& s = *slots_[next_slot_++ % slots_.size()];
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  s.uploaded = copies->HostToDevice(device_dst, s.memory.data(), bytes);
  last_upload_ = s.uploaded;
  bytes_to_gpu_ += bytes;
  return Status::Ok();
}

Result<Future<>> DevicePath::UploadFrom(void* device_dst, const std::byte* host, uint64_t bytes,
                                        void* stream) {
  return UploadAfter(device_dst, host, bytes, AsStream(stream));
}

Result<Future<>> DevicePath::UploadFrom(void* device_dst, const std::byte* host, uint64_t bytes) {
  return UploadAfter(device_dst, host, bytes, nullptr);
}

Result<Future<>> DevicePath::UploadAfter(void* device_dst, const std::byte* host, uint64_t bytes,
                                         cudaStream_t after) {
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  Future<> upload = copies->HostToDevice(device_dst, host, bytes, after);
  if (upload.Ready()) ZO_RETURN_IF_ERROR(upload.Wait());  // an enqueue error
  last_upload_ = upload;
  bytes_to_gpu_ += bytes;
  return upload;
}

Status DevicePath::WaitParameters(void* stream) {
  if (!last_upload_.valid()) return Status::Ok();
  return last_upload_.OrderBefore(AsStream(stream));
}

Status DevicePath::CopyToHost(void* host, const void* device, uint64_t bytes) {
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  return copies->DeviceToHostStaged(host, device, bytes);
}

uint64_t DevicePath::gpu_bytes() const { return ring_.size(); }

uint64_t DevicePath::host_bytes() const {
  uint64_t total = 0;
  for (const auto& s : slots_) total += s->memory.size();
  return total;
}

}  // namespace zoffload::internal
