#include "engine/engine_core.h"

#include <algorithm>

#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "common/trace.h"
#include "cpu_adam/adam_kernels.h"
#include "engine/param_math.h"

namespace zoffload::internal {
namespace {

constexpr const char* kEngineTrack = "engine";                     // each Step, its phases
constexpr const char* kHandOverTrack = "gradients handed over";    // GradientReady calls
constexpr const char* kNormTrack = "gradient norms as they land";  // the worker's norm parts

double Since(EngineClock::time_point start) {
  return std::chrono::duration<double>(EngineClock::now() - start).count();
}

}  // namespace

EngineCore::~EngineCore() {
  worker.Stop();
  schedule.reset();
  path.reset();
  partition.reset();
}

Status EngineCore::Setup(const Config& given, std::vector<ParameterSpec> specs,
                         EngineOptions given_options, std::string_view who, int world,
                         const MakePartition& make, const AdjustRuntime& adjust) {
  config = given;
  // The parser's rules, for a config built in code (nvme_paths normalized here).
  ZO_RETURN_IF_ERROR(ValidateConfig(config, world).WithContext(who));
  ZO_ASSIGN_OR_RETURN(const OptimizerStateOptions so, OptimizerStateOptions::FromConfig(config));
  if (given_options.staging_slots < 2) {
    return InvalidArgumentError(
        StrCat(who, ": staging_slots must be at least 2, got ", given_options.staging_slots));
  }
  ZO_ASSIGN_OR_RETURN(groups, StartingGroups(given_options.groups, config.optimizer, who));
  ZO_RETURN_IF_ERROR(CheckSpecs(specs, groups.size(), who));
  accumulation = static_cast<int>(config.gradient_accumulation_steps.value_or(1));
  scaler = LossScaler(config.fp16);
  for (size_t i = 0; i < specs.size(); ++i) {
    ParameterSpec& s = specs[i];
    index.emplace(s.name, i);
    EngineParam p;
    p.name = std::move(s.name);
    p.data = s.data;
    p.n = s.elements;
    p.dtype = s.dtype;
    p.group = s.group;
    p.shape = s.shape.empty() ? std::vector<uint64_t>{s.elements} : std::move(s.shape);
    p.initial = s.initial;
    total += p.n;
    params.push_back(std::move(p));
  }
  options = std::move(given_options);
  RuntimeContext* context = options.context;
  if (context == nullptr) {
    RuntimeOptions runtime = RuntimeOptions::FromConfig(config);  // nvme_paths normalized
    if (adjust) ZO_RETURN_IF_ERROR(adjust(runtime));
    ZO_ASSIGN_OR_RETURN(own_context, RuntimeContext::Create(std::move(runtime)));
    context = own_context.get();
  }
  rt = &RuntimeAccess::Of(*context);
  SetCpuAdamCoreBinding(config.zoffload.cpu_adam_bind_cores);
  const bool on_gpu = !options.host_params && rt->has_gpu();
  if (options.require_gpu && !on_gpu) {
    return FailedPreconditionError(
        StrCat(who, options.host_params
                        ? ": host_params and require_gpu contradict each other"
                        : ": the parameters are in GPU memory, but no GPU is usable here (a build "
                          "without CUDA, or no device; zoffload-report says which)"));
  }
  for (const EngineParam& p : params) {
    ZO_RETURN_IF_ERROR(CheckMemory(p.data, on_gpu, StrCat(who, ": parameter '", p.name, "'")));
  }
  ZO_ASSIGN_OR_RETURN(partition, make(*this));
  schedule = MakeSchedule(*this);
  ZO_RETURN_IF_ERROR(partition->CreateState(*context, so));
  if (on_gpu) {
    ZO_ASSIGN_OR_RETURN(path, MakeDevicePath(*this));
  } else {
    path = MakeHostPath(*this);
  }
  ZO_RETURN_IF_ERROR(partition->Initialize());
  squares.resize(params.size());
  landed_bytes.resize(params.size());
  // A quarter of the update's threads: backward's own thread keeps its core.
  const int threads = config.zoffload.cpu_adam_threads;
  landing_threads = std::max(1, (threads > 0 ? threads : DefaultAdamThreads()) / 4);
  worker.Start([this](const WorkItem& item) { Handle(item); });
  for (EngineParam& p : params) p.initial = nullptr;
  return Status::Ok();
}

Result<EngineParam*> EngineCore::Find(std::string_view name) {
  auto it = index.find(name);
  if (it == index.end()) {
    return NotFoundError(
        StrCat("no parameter '", name, "' is registered (", params.size(), " parameters)"));
  }
  return &params[it->second];
}

void EngineCore::Handle(const WorkItem& item) {
  if (item.tag == kRunUpdate) return schedule->RunOnWorker();
  if (!path->Arrived(item) || !schedule->NormsOnLanding() || !item.last()) return;
  const size_t i = item.param();
  landed_bytes[i] += item.bytes;
  if (landed_bytes[i] != params[i].bytes()) return;
  const auto start = EngineClock::now();
  const std::optional<GradSquares> made = path->Squares(i);
  squares[i] = made ? *made : SquaresOf(i, landing_threads);
  if (Tracer* tracer = rt->tracer()) {
    tracer->Record(kNormTrack, params[i].name, start, EngineClock::now());
  }
  schedule->Landed(i);
}

void EngineCore::AwaitWorker() {
  worker.AwaitAll();  // what it hands the schedule is handed by then
  schedule->AwaitUpdates();
}

bool EngineCore::AddsAsTorch() const {
  return partition->TakesExtras() && accumulation == 1 && schedule->mode() == Overlap::kNone;
}

Status EngineCore::CheckWindowComplete(std::string_view what, std::string_view consequence) const {
  std::vector<std::string> missing;
  for (const EngineParam& p : params) {
    if (AddsAsTorch() ? p.received < accumulation : p.received != accumulation) {
      missing.push_back(StrCat("'", p.name, "' (", p.received, " of ", accumulation, ")"));
    }
  }
  if (missing.empty()) return Status::Ok();
  return FailedPreconditionError(StrCat(what, ": ", missing.size(), " of ", params.size(),
                                        " parameters lack gradients: ", FirstFew(missing, ", "),
                                        consequence));
}

Status EngineCore::Received(EngineParam& p, EngineClock::time_point start) {
  window_norm.reset();
  ++p.received;
  ++grads_in_window;
  if (Tracer* tracer = rt->tracer()) {
    tracer->Record(kHandOverTrack, p.name, start, EngineClock::now());
  }
  return Status::Ok();
}

void EngineCore::BeginWindow() {
  schedule->BeginWindow();
  path->BeginWindow();
  std::fill(squares.begin(), squares.end(), GradSquares{});
  std::fill(landed_bytes.begin(), landed_bytes.end(), 0);
  arrival.clear();
}

Status EngineCore::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                 DType dtype, void* stream) {
  ZO_ASSIGN_OR_RETURN(EngineParam * found, Find(name));
  EngineParam& p = *found;
  if (dtype != p.dtype || elements != p.n || grad == nullptr) {
    return InvalidArgumentError(
        StrCat("gradient of '", p.name, "': ", elements, " ", ToString(dtype), " elements at ",
               grad, "; the parameter has ", p.n, " ", ToString(p.dtype), " elements"));
  }
  const auto start = EngineClock::now();
  ZO_RETURN_IF_ERROR(CheckMemory(grad, gpu(), StrCat("gradient of '", p.name, "'")));
  if (p.received >= accumulation) {
    // One more micro-batch than declared: added into the gradient in its dtype, as torch adds
    // into .grad, where the engine can (see AddsAsTorch).
    if (!AddsAsTorch()) {
      return FailedPreconditionError(StrCat(
          "gradient of '", p.name, "': it already has its ", accumulation,
          " gradient(s) of this step (gradient_accumulation_steps); call Step first, or declare "
          "the micro-batches per step in the config's gradient_accumulation_steps (an undeclared "
          "count adds up only with overlap \"none\")"));
    }
    ZO_RETURN_IF_ERROR(path->HandExtra(IndexOf(p), grad, stream));
    return Received(p, start);
  }
  const bool add = p.received > 0;
  const bool final = p.received + 1 == accumulation;  // the window's last micro-batch
  const size_t i = IndexOf(p);
  if (grads_in_window == 0) BeginWindow();
  if (final) ZO_RETURN_IF_ERROR(schedule->BeforeLastGradient(i, stream));
  ZO_RETURN_IF_ERROR(partition->Take(i, grad, add, final, stream));
  if (final) arrival.push_back(i);
  return Received(p, start);
}

Status EngineCore::AwaitGradients() {
  ZO_RETURN_IF_ERROR(path->WaitLanded().WithContext("Step: gradients to the host"));
  AwaitWorker();                        // accumulation, and the updates of the overlap modes
  if (!schedule->UpdatesOnLanding()) {  // else the worker read them
    for (size_t i = 0; i < params.size(); ++i) {
      if (const std::optional<GradSquares> made = path->Squares(i)) {
        squares[i] = *made;
      } else if (SquaresKnown() && accumulation == 1) {  // a sum of undeclared micro-batches
        squares[i] = SquaresOf(i, 0);
      }
    }
  }
  return Status::Ok();
}

bool EngineCore::SquaresKnown() const {
  return gpu() && (accumulation == 1 || schedule->NormsOnLanding());
}

TensorGrads EngineCore::GradsOf(size_t i, const AdamHyper* hyper) const {
  const EngineParam& p = params[i];
  return {p.grads.data(), accumulation > 1 ? DType::kFp32 : p.dtype, nullptr, CopyFor(p.dtype),
          hyper};
}

std::vector<TensorGrads> EngineCore::AllGrads(const std::vector<AdamHyper>& hypers) const {
  std::vector<TensorGrads> grads;
  for (size_t i = 0; i < params.size(); ++i) {
    grads.push_back(GradsOf(i, hypers.empty() ? nullptr : &hypers[params[i].group]));
  }
  return grads;
}

GradSquares EngineCore::SquaresOf(size_t i, int threads) const {
  const TensorGrads g = GradsOf(i, nullptr);
  AdamShard shard;
  shard.n = params[i].n;
  shard.grads = g.grads;
  shard.grad_dtype = g.dtype;
  return GradientSquares(shard, threads);
}

AdamHyper EngineCore::NextBase() const {
  AdamHyper base = HyperFromConfig(config.optimizer);
  base.step = steps + 1;
  return base;
}

Status EngineCore::BetweenSteps(std::string_view what) const {
  if (grads_in_window == 0) return Status::Ok();
  return FailedPreconditionError(StrCat(what, ": ", grads_in_window,
                                        " gradients of the coming step are in; call it "
                                        "between Step and the next step's first gradient"));
}

Status EngineCore::CheckMemory(const void* ptr, bool on_gpu, const std::string& what) const {
  ZO_ASSIGN_OR_RETURN(const int where, rt->DeviceOf(ptr));
  const int want = on_gpu ? rt->options().device : -1;
  if (where == want) return Status::Ok();
  auto name = [](int d) { return d < 0 ? std::string("host memory") : StrCat("GPU ", d); };
  return InvalidArgumentError(StrCat(what, " is in ", name(where), "; the engine ",
                                     on_gpu ? "runs on " : "runs in host mode and needs ",
                                     name(want)));
}

Result<void*> EngineCore::GradientBuffer(std::string_view name) {
  ZO_ASSIGN_OR_RETURN(EngineParam * p, Find(name));
  return partition->InPlaceBuffer(*p);
}

Result<EngineStepStats> EngineCore::Step() {
  const auto start = EngineClock::now();
  ZO_RETURN_IF_ERROR(CheckWindowComplete("Step", "; nothing was updated"));
  EngineStepStats stats;
  Tracer* tracer = rt->tracer();
  ZO_RETURN_IF_ERROR(AwaitGradients());
  stats.wait_grads_seconds = Since(start);
  if (tracer != nullptr) {
    tracer->Record(kEngineTrack, "wait for gradients", start, EngineClock::now());
  }
  stats.loss_scale = scaler.scale();
  const auto update_start = EngineClock::now();
  Status outcome;  // an error found after the state has changed (overlap "backward")
  ZO_RETURN_IF_ERROR(schedule->Step(&stats, &outcome));
  stats.update_seconds = Since(update_start);
  if (tracer != nullptr) tracer->Record(kEngineTrack, "update", update_start, EngineClock::now());
  for (EngineParam& p : params) p.received = 0;
  grads_in_window = 0;
  stats.step = steps;
  path->TakeTransferStats(&stats);
  stats.seconds = Since(start);
  if (const char* track = partition->step_track(); tracer != nullptr && track != nullptr) {
    tracer->Record(track, "step", start, EngineClock::now());
  }
  last = stats;
  ZO_RETURN_IF_ERROR(outcome);
  return stats;
}

Status EngineCore::SetGroup(int i, const ParamGroup& group) {
  if (i < 0 || static_cast<size_t>(i) >= groups.size()) {
    return OutOfRangeError(StrCat("SetGroup: no group ", i, " (", groups.size(), " groups)"));
  }
  ZO_RETURN_IF_ERROR(CheckGroup(group, StrCat("SetGroup ", i)));
  ZO_RETURN_IF_ERROR(schedule->CanChangeGroup(i, group));
  groups[static_cast<size_t>(i)] = group;
  return Status::Ok();
}

Status EngineCore::LoadState(EngineParam& p, const float* master, const void* m, const void* v) {
  ZO_RETURN_IF_ERROR(BetweenSteps("LoadState"));  // the sink may write where gradients land
  ZO_RETURN_IF_ERROR(schedule->Flush(nullptr).WithContext("LoadState"));
  // The sink may write where the gradient landed, from which Flush may have just sent a
  // delayed update's values up. (In a step that upload is done: the gradient read there
  // landed after it.)
  ZO_RETURN_IF_ERROR(path->AwaitUpload(p));
  const size_t t = IndexOf(p);
  ZO_RETURN_IF_ERROR(state->Write(t, master, m, v).WithContext(StrCat("LoadState '", p.name, "'")));
  return PublishMaster(p, master);
}

Status EngineCore::PublishMaster(EngineParam& p, const float* master) {
  const size_t t = IndexOf(p);
  const uint64_t chunk = state->chunk_elements();
  for (uint64_t first = 0; first < p.n; first += chunk) {
    const uint64_t n = std::min(chunk, p.n - first);
    ZO_ASSIGN_OR_RETURN(void* out, path->Begin(t, first, n));
    CastFromFloat(master + first, out, p.dtype, n);
    ZO_RETURN_IF_ERROR(path->End(t, first, n, master + first));
  }
  return Status::Ok();
}

uint64_t EngineCore::host_bytes() const {
  return (state != nullptr ? state->host_bytes() : 0) + partition->host_bytes();
}

}  // namespace zoffload::internal
