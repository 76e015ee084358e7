// The host GradientPath: parameters and gradients in host memory (no GPU, or host_params).
// A gradient is copied (or, with several micro-batches, added in fp32) into the engine's buffer
// during GradientReady; the update writes the new values into the parameter in place.
#include <cstring>

#include "common/strings.h"
#include "engine/engine_core.h"
#include "engine/gradient_path.h"
#include "engine/param_math.h"

namespace zoffload::internal {
namespace {

class HostPath final : public GradientPath {
 public:
  explicit HostPath(EngineCore& core) : core_(core) {}

  bool on_gpu() const override { return false; }
  Status Allocate(EngineParam& /*p*/) override { return Status::Ok(); }

  Status Hand(size_t i, const void* grad, bool add, bool last, void* /*stream*/) override {
    EngineParam& p = core_.params[i];
    if (!add) core_.schedule->AwaitRead(i);  // the first micro-batch goes over the last sum
    if (core_.accumulation == 1) {
      if (grad != p.grads.data()) std::memcpy(p.grads.data(), grad, p.bytes());  // else in place
    } else {
      Accumulate(p.grads.as<float>(), grad, p.dtype, p.n, add);
    }
    if (last && core_.schedule->UpdatesOnLanding()) {
      core_.worker.Push({nullptr, p.bytes(), WorkItem::Tag(i, add, last)});
    }
    return Status::Ok();
  }
  Status HandExtra(size_t i, const void* grad, void* /*stream*/) override {
    EngineParam& p = core_.params[i];
    if (grad == p.grads.data()) {
      return InvalidArgumentError(StrCat("gradient of '", p.name,
                                         "': a later micro-batch's gradient cannot be written "
                                         "into the engine's buffer, which holds the sum so far"));
    }
    AddInDtype(p.grads.data(), grad, p.dtype, p.n);
    return Status::Ok();
  }
  bool Arrived(const WorkItem& /*item*/) override { return true; }
  Status WaitLanded() override { return Status::Ok(); }
  std::optional<GradSquares> Squares(size_t /*i*/) const override { return std::nullopt; }
  void* InPlaceBuffer(EngineParam& p) override {
    return core_.accumulation == 1 ? p.grads.data() : nullptr;
  }
  Status Publish(EngineParam& p, const std::byte* from, void* /*stream*/) override {
    std::memcpy(p.data, from, p.bytes());
    return Status::Ok();
  }
  Status AwaitUpload(EngineParam& /*p*/) override { return Status::Ok(); }
  Result<const void*> Values(const EngineParam& p, AlignedBuffer& /*scratch*/) override {
    return p.data;
  }
  Status WaitParameters(void* /*stream*/) override { return Status::Ok(); }
  void TakeTransferStats(EngineStepStats* /*stats*/) override {}
  uint64_t host_bytes() const override { return 0; }
  uint64_t gpu_bytes() const override { return 0; }

  // ParamSink: straight into the parameter.
  Result<void*> Begin(size_t t, uint64_t first, uint64_t /*n*/) override {
    EngineParam& p = core_.params[t];
    return static_cast<void*>(static_cast<std::byte*>(p.data) + first * DTypeBytes(p.dtype));
  }
  Status End(size_t t, uint64_t first, uint64_t n, const float* master) override {
    EngineParam& p = core_.params[t];
    if (p.dtype == DType::kFp32) {
      std::memcpy(static_cast<std::byte*>(p.data) + 4 * first, master, 4 * n);
    }
    return Status::Ok();
  }

 private:
  EngineCore& core_;
};

}  // namespace

std::unique_ptr<GradientPath> MakeHostPath(EngineCore& core) {
  return std::make_unique<HostPath>(core);
}

}  // namespace zoffload::internal
