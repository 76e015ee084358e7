// OffloadEngine: the public face of the trainer core (engine_core.h) for one process: the core
// with the identity partition.
#include "zoffload/engine.h"

#include <cmath>

#include "common/strings.h"
#include "cpu_adam/adam_math.h"
#include "engine/engine_core.h"

namespace zoffload {

using internal::EngineCore;
using internal::EngineParam;
using internal::StrCat;

struct OffloadEngine::Impl : EngineCore {};

OffloadEngine::OffloadEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadEngine::~OffloadEngine() = default;

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::Create(const Config& config,
                                                             std::vector<ParameterSpec> specs,
                                                             EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  ZO_RETURN_IF_ERROR(
      impl->Setup(config, std::move(specs), std::move(options), "engine", 1,
                  [](EngineCore& core) -> Result<std::unique_ptr<internal::Partition>> {
                    return internal::MakeIdentityPartition(core);
                  }));
  return std::unique_ptr<OffloadEngine>(new OffloadEngine(std::move(impl)));
}

Status OffloadEngine::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                    DType dtype, void* stream) {
  return impl_->GradientReady(name, grad, elements, dtype, stream);
}

Result<void*> OffloadEngine::GradientBuffer(std::string_view name) {
  return impl_->GradientBuffer(name);
}

Result<EngineStepStats> OffloadEngine::Step() { return impl_->Step(); }

Status OffloadEngine::Flush(void* stream) { return impl_->schedule->Flush(stream); }

Status OffloadEngine::WaitParameters(void* stream) { return impl_->path->WaitParameters(stream); }

float OffloadEngine::loss_scale() const { return impl_->scaler.scale(); }
int OffloadEngine::group_count() const { return static_cast<int>(impl_->groups.size()); }
const ParamGroup& OffloadEngine::group(int index) const { return impl_->groups.at(index); }

Status OffloadEngine::SetGroup(int index, const ParamGroup& group) {
  return impl_->SetGroup(index, group);
}

Result<double> OffloadEngine::GradientNorm() {
  EngineCore& e = *impl_;
  ZO_RETURN_IF_ERROR(e.schedule->CanReportNorm());
  ZO_RETURN_IF_ERROR(e.CheckWindowComplete("GradientNorm", " (call it after the last backward)"));
  ZO_RETURN_IF_ERROR(e.AwaitGradients());
  ZO_ASSIGN_OR_RETURN(const std::optional<GradNorm> norm, e.partition->Norm(true));
  return norm->finite ? norm->l2 / e.scaler.scale() : internal::NonfiniteNorm(norm->l2);
}

Status OffloadEngine::SetGradientClipping(double max_norm) {
  if (!(max_norm >= 0) || !std::isfinite(max_norm)) {
    return InvalidArgumentError(
        StrCat("SetGradientClipping: the max norm must be finite and >= 0, got ", max_norm));
  }
  ZO_RETURN_IF_ERROR(impl_->schedule->CanClip(max_norm));
  impl_->config.gradient_clipping = max_norm;
  return Status::Ok();
}

Status OffloadEngine::ReadState(std::string_view name, float* master, void* m, void* v) {
  EngineCore& e = *impl_;
  ZO_ASSIGN_OR_RETURN(EngineParam * p, e.Find(name));
  ZO_RETURN_IF_ERROR(e.schedule->Collect(nullptr).WithContext("ReadState"));
  return e.state->Read(e.IndexOf(*p), master, m, v);
}

Status OffloadEngine::LoadState(std::string_view name, const float* master, const void* m,
                                const void* v) {
  ZO_ASSIGN_OR_RETURN(EngineParam * p, impl_->Find(name));
  return impl_->LoadState(*p, master, m, v);
}

Status OffloadEngine::SetSteps(int64_t steps) {
  if (steps < 0) return InvalidArgumentError(StrCat("SetSteps: ", steps, " < 0"));
  ZO_RETURN_IF_ERROR(impl_->schedule->Collect(nullptr).WithContext("SetSteps"));
  impl_->steps = steps;
  return Status::Ok();
}

Status OffloadEngine::Save(const std::string& dir) {
  ZO_RETURN_IF_ERROR(impl_->BetweenSteps("Save"));
  ZO_RETURN_IF_ERROR(impl_->schedule->Collect(nullptr).WithContext("Save"));
  return impl_->partition->Save(dir);
}

Status OffloadEngine::Load(const std::string& dir) {
  ZO_RETURN_IF_ERROR(impl_->BetweenSteps("Load"));
  return impl_->partition->Load(dir);
}

bool OffloadEngine::on_gpu() const { return impl_->gpu(); }
int64_t OffloadEngine::steps() const { return impl_->steps; }
uint64_t OffloadEngine::total_elements() const { return impl_->total; }
const EngineStepStats& OffloadEngine::last_step() const { return impl_->last; }
uint64_t OffloadEngine::host_bytes() const { return impl_->host_bytes(); }
uint64_t OffloadEngine::gpu_bytes() const { return impl_->path->gpu_bytes(); }

}  // namespace zoffload
