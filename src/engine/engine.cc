// OffloadEngine: the public face of the trainer core (engine_core.h). Create builds the core
// with its GradientPath and StepSchedule; the calls below are the core's, in the order the
// header documents.
#include "zoffload/engine.h"

#include <algorithm>
#include <cmath>

#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "common/trace.h"
#include "cpu_adam/adam_kernels.h"
#include "cpu_adam/adam_math.h"
#include "engine/checkpoint.h"
#include "engine/engine_core.h"
#include "engine/param_math.h"
#include "zoffload/cpu_adam.h"

namespace zoffload {

using internal::AlignedBuffer;
using internal::CastFromFloat;
using internal::CheckGroup;
using internal::EngineClock;
using internal::EngineCore;
using internal::EngineParam;
using internal::OptimizerStateOptions;
using internal::OptimizerTensor;
using internal::StrCat;
using internal::Tracer;

namespace {

constexpr const char* kEngineTrack = "engine";

double Since(EngineClock::time_point start) {
  return std::chrono::duration<double>(EngineClock::now() - start).count();
}

}  // namespace

struct OffloadEngine::Impl : EngineCore {};

OffloadEngine::OffloadEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadEngine::~OffloadEngine() = default;

namespace {

// The parameters as the core keeps them (specs checked).
void AddParams(std::vector<ParameterSpec>& specs, EngineCore& e) {
  for (size_t i = 0; i < specs.size(); ++i) {
    ParameterSpec& s = specs[i];
    e.index.emplace(s.name, i);
    EngineParam p;
    p.name = std::move(s.name);
    p.data = s.data;
    p.n = s.elements;
    p.dtype = s.dtype;
    p.group = s.group;
    p.shape = s.shape.empty() ? std::vector<uint64_t>{s.elements} : std::move(s.shape);
    p.initial = s.initial;
    e.total += p.n;
    e.params.push_back(std::move(p));
  }
}

// The state, the schedule and the path, and each parameter's buffers.
Status Build(EngineCore& e, RuntimeContext& context, const OptimizerStateOptions& so) {
  std::vector<OptimizerTensor> tensors;
  for (const EngineParam& p : e.params) tensors.push_back({p.name, p.n});
  ZO_ASSIGN_OR_RETURN(e.state, internal::OptimizerState::Create(std::move(tensors), context, so));
  e.schedule = internal::MakeSchedule(e);
  const bool gpu = !e.options.host_params && e.rt->has_gpu();
  if (gpu) {
    ZO_ASSIGN_OR_RETURN(e.path, internal::MakeDevicePath(e));
  } else {
    e.path = internal::MakeHostPath(e);
  }
  for (EngineParam& p : e.params) {
    const std::string what = StrCat("the gradient of '", p.name, "'");
    if (e.accumulation == 1) {
      // Pinned also in host mode with a GPU present: the caller's D2H may land there
      // (GradientBuffer).
      ZO_ASSIGN_OR_RETURN(p.grads, e.rt->AllocateHost(p.bytes(), what, e.rt->has_gpu()));
    } else {
      ZO_ASSIGN_OR_RETURN(p.grads, e.rt->AllocateHost(4 * p.n, StrCat(what, " (fp32 sum)"), false));
    }
    ZO_RETURN_IF_ERROR(e.path->Allocate(p));
    ZO_RETURN_IF_ERROR(e.schedule->Allocate(p));
  }
  e.squares.resize(e.params.size());
  e.landed_bytes.resize(e.params.size());
  // A quarter of the update's threads: backward's own thread keeps its core.
  const int threads = e.config.zoffload.cpu_adam_threads;
  e.landing_threads = std::max(1, (threads > 0 ? threads : DefaultAdamThreads()) / 4);
  e.worker.Start([&e](const internal::WorkItem& item) { e.Handle(item); });
  return e.Initialize();
}

}  // namespace

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::Create(const Config& config,
                                                             std::vector<ParameterSpec> specs,
                                                             EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  EngineCore& e = *impl;
  e.config = config;
  // The parser's rules, for a config built in code (e.config: nvme_paths normalized).
  ZO_RETURN_IF_ERROR(ValidateConfig(e.config).WithContext("engine"));
  ZO_ASSIGN_OR_RETURN(OptimizerStateOptions so, OptimizerStateOptions::FromConfig(e.config));
  if (options.staging_slots < 2) {
    return InvalidArgumentError(
        StrCat("engine: staging_slots must be at least 2, got ", options.staging_slots));
  }
  ZO_ASSIGN_OR_RETURN(e.groups,
                      internal::StartingGroups(options.groups, e.config.optimizer, "engine"));
  ZO_RETURN_IF_ERROR(internal::CheckSpecs(specs, e.groups.size(), "engine"));
  e.accumulation = static_cast<int>(e.config.gradient_accumulation_steps.value_or(1));
  e.scaler = internal::LossScaler(e.config.fp16);
  AddParams(specs, e);
  e.options = std::move(options);
  RuntimeContext* context = e.options.context;
  if (context == nullptr) {
    ZO_ASSIGN_OR_RETURN(e.own_context,
                        RuntimeContext::Create(RuntimeOptions::FromConfig(e.config)));
    context = e.own_context.get();
  }
  e.rt = &internal::RuntimeAccess::Of(*context);
  internal::SetCpuAdamCoreBinding(e.config.zoffload.cpu_adam_bind_cores);
  const bool gpu = !e.options.host_params && e.rt->has_gpu();
  if (e.options.require_gpu && !gpu) {
    return FailedPreconditionError(
        e.options.host_params
            ? "engine: host_params and require_gpu contradict each other"
            : "engine: the parameters are in GPU memory, but no GPU is usable here (a build "
              "without CUDA, or no device; zoffload-report says which)");
  }
  for (const EngineParam& p : e.params) {
    ZO_RETURN_IF_ERROR(e.CheckMemory(p.data, gpu, StrCat("engine: parameter '", p.name, "'")));
  }
  ZO_RETURN_IF_ERROR(Build(e, *context, so));
  for (EngineParam& p : e.params) p.initial = nullptr;
  return std::unique_ptr<OffloadEngine>(new OffloadEngine(std::move(impl)));
}

Status OffloadEngine::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                    DType dtype, void* stream) {
  EngineCore& e = *impl_;
  ZO_ASSIGN_OR_RETURN(EngineParam * p, e.Find(name));
  if (dtype != p->dtype || elements != p->n || grad == nullptr) {
    return InvalidArgumentError(
        StrCat("gradient of '", p->name, "': ", elements, " ", ToString(dtype), " elements at ",
               grad, "; the parameter has ", p->n, " ", ToString(p->dtype), " elements"));
  }
  return e.GradientReady(*p, grad, stream);
}

Result<void*> OffloadEngine::GradientBuffer(std::string_view name) {
  EngineCore& e = *impl_;
  ZO_ASSIGN_OR_RETURN(EngineParam * p, e.Find(name));
  if (!e.schedule->TakesInPlace()) return nullptr;
  return e.path->InPlaceBuffer(*p);
}

Result<EngineStepStats> OffloadEngine::Step() {
  EngineCore& e = *impl_;
  const auto start = EngineClock::now();
  ZO_RETURN_IF_ERROR(e.CheckWindowComplete("Step", "; nothing was updated"));
  EngineStepStats stats;
  Tracer* tracer = e.rt->tracer();
  ZO_RETURN_IF_ERROR(e.AwaitGradients());
  stats.wait_grads_seconds = Since(start);
  if (tracer != nullptr)
    tracer->Record(kEngineTrack, "wait for gradients", start, EngineClock::now());
  stats.loss_scale = e.scaler.scale();
  const auto update_start = EngineClock::now();
  Status outcome;  // an error found after the state has changed (overlap "backward")
  ZO_RETURN_IF_ERROR(e.schedule->Step(&stats, &outcome));
  stats.update_seconds = Since(update_start);
  if (tracer != nullptr) tracer->Record(kEngineTrack, "update", update_start, EngineClock::now());
  for (EngineParam& p : e.params) p.received = 0;
  e.grads_in_window = 0;
  stats.step = e.steps;
  e.path->TakeTransferStats(&stats);
  stats.seconds = Since(start);
  e.last = stats;
  ZO_RETURN_IF_ERROR(outcome);
  return stats;
}

Status OffloadEngine::Flush(void* stream) { return impl_->schedule->Flush(stream); }

Status OffloadEngine::WaitParameters(void* stream) { return impl_->path->WaitParameters(stream); }

float OffloadEngine::loss_scale() const { return impl_->scaler.scale(); }
int OffloadEngine::group_count() const { return static_cast<int>(impl_->groups.size()); }
const ParamGroup& OffloadEngine::group(int index) const { return impl_->groups.at(index); }

Status OffloadEngine::SetGroup(int index, const ParamGroup& group) {
  if (index < 0 || index >= group_count()) {
    return OutOfRangeError(StrCat("SetGroup: no group ", index, " (", group_count(), " groups)"));
  }
  ZO_RETURN_IF_ERROR(CheckGroup(group, StrCat("SetGroup ", index)));
  ZO_RETURN_IF_ERROR(impl_->schedule->CanChangeGroup(index, group));
  impl_->groups[static_cast<size_t>(index)] = group;
  return Status::Ok();
}

Result<double> OffloadEngine::GradientNorm() {
  EngineCore& e = *impl_;
  ZO_RETURN_IF_ERROR(e.schedule->CanReportNorm());
  ZO_RETURN_IF_ERROR(e.CheckWindowComplete("GradientNorm", " (call it after the last backward)"));
  ZO_RETURN_IF_ERROR(e.AwaitGradients());
  if (!e.window_norm) {
    if (e.SquaresKnown()) {
      e.window_norm = NormOf(e.squares);
    } else {
      ZO_ASSIGN_OR_RETURN(e.window_norm, e.state->Norm(e.AllGrads({})));
    }
  }
  const double raw = e.window_norm->l2;
  return e.window_norm->finite ? raw / e.scaler.scale() : internal::NonfiniteNorm(raw);
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
  EngineCore& e = *impl_;
  ZO_ASSIGN_OR_RETURN(EngineParam * p, e.Find(name));
  ZO_RETURN_IF_ERROR(e.BetweenSteps("LoadState"));  // the sink may write where gradients land
  ZO_RETURN_IF_ERROR(Flush().WithContext("LoadState"));
  // The sink may write where the gradient landed, from which Flush may have just sent a
  // delayed update's values up. (In a step that upload is done: the gradient read there
  // landed after it.)
  ZO_RETURN_IF_ERROR(e.path->AwaitUpload(*p));
  const size_t t = e.IndexOf(*p);
  ZO_RETURN_IF_ERROR(e.state->Write(t, master, m, v).WithContext(StrCat("LoadState '", name, "'")));
  // The model's parameter follows the master, through the same sink as a step's chunks.
  const uint64_t chunk = e.state->chunk_elements();
  for (uint64_t first = 0; first < p->n; first += chunk) {
    const uint64_t n = std::min(chunk, p->n - first);
    ZO_ASSIGN_OR_RETURN(void* out, e.path->Begin(t, first, n));
    CastFromFloat(master + first, out, p->dtype, n);
    ZO_RETURN_IF_ERROR(e.path->End(t, first, n, master + first));
  }
  return Status::Ok();
}

Status OffloadEngine::SetSteps(int64_t steps) {
  if (steps < 0) return InvalidArgumentError(StrCat("SetSteps: ", steps, " < 0"));
  ZO_RETURN_IF_ERROR(impl_->schedule->Collect(nullptr).WithContext("SetSteps"));
  impl_->steps = steps;
  return Status::Ok();
}

Status OffloadEngine::Save(const std::string& dir) {
  Impl& e = *impl_;
  ZO_RETURN_IF_ERROR(e.BetweenSteps("Save"));
  ZO_RETURN_IF_ERROR(e.schedule->Collect(nullptr).WithContext("Save"));
  const StatePrecision precision = e.config.zoffload.optimizer_state;
  internal::CheckpointMeta meta =
      internal::CheckpointHeader(e.steps, e.scaler.state(), e.config, e.groups);
  for (const EngineParam& p : e.params) {
    meta.entries.push_back(internal::EntryFor(p.name, p.n, p.shape, p.dtype, p.group, precision));
  }
  return internal::WriteCheckpoint(dir, std::move(meta),
                                   [&e](size_t i, float* master, std::byte* m, std::byte* v) {
                                     return e.state->Read(i, master, m, v);
                                   });
}

Status OffloadEngine::Load(const std::string& dir) {
  Impl& e = *impl_;
  ZO_RETURN_IF_ERROR(e.BetweenSteps("Load"));
  std::string from;
  ZO_ASSIGN_OR_RETURN(internal::CheckpointMeta meta, internal::ReadCheckpointMeta(dir, &from));
  std::vector<internal::RegisteredParam> registered;
  for (const EngineParam& p : e.params) registered.push_back({p.name, p.n, p.dtype});
  ZO_ASSIGN_OR_RETURN(
      std::vector<const internal::CheckpointEntry*> saved,
      internal::MatchCheckpoint(meta, from, registered, e.config.zoffload.optimizer_state,
                                e.groups.size()));
  uint64_t largest = 0;
  for (const auto* c : saved) largest = std::max(largest, c->bytes());
  ZO_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(largest, 64));
  auto read = [&](const internal::CheckpointEntry& c) {
    auto* m = buffer.data() + 4 * c.elements;
    return internal::ReadCheckpointEntry(from, c, buffer.as<float>(), m, m + c.moment_bytes);
  };
  // Every checksum first: a damaged checkpoint changes nothing.
  for (const auto* c : saved) ZO_RETURN_IF_ERROR(read(*c));
  for (size_t i = 0; i < e.params.size(); ++i) {
    const internal::CheckpointEntry& c = *saved[i];
    ZO_RETURN_IF_ERROR(read(c));
    auto* m = buffer.data() + 4 * c.elements;
    ZO_RETURN_IF_ERROR(LoadState(c.name, buffer.as<float>(), m, m + c.moment_bytes));
  }
  e.groups = meta.groups;
  e.steps = meta.steps;
  e.scaler.Restore({meta.loss_scale, meta.overflows, meta.good_steps});
  return Status::Ok();
}

bool OffloadEngine::on_gpu() const { return impl_->gpu(); }
int64_t OffloadEngine::steps() const { return impl_->steps; }
uint64_t OffloadEngine::total_elements() const { return impl_->total; }
const EngineStepStats& OffloadEngine::last_step() const { return impl_->last; }

uint64_t OffloadEngine::host_bytes() const {
  uint64_t total = impl_->state->host_bytes() + impl_->path->host_bytes();
  for (const EngineParam& p : impl_->params) {
    total += p.grads.size() + p.landing.size() + p.staged.size();
  }
  return total;
}

uint64_t OffloadEngine::gpu_bytes() const { return impl_->path->gpu_bytes(); }

}  // namespace zoffload
