#include "engine/engine_core.h"

#include <algorithm>

#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "common/trace.h"
#include "engine/param_math.h"

namespace zoffload::internal {
namespace {

constexpr const char* kHandOverTrack = "gradients handed over";    // GradientReady calls
constexpr const char* kNormTrack = "gradient norms as they land";  // the worker's norm parts

}  // namespace

EngineCore::~EngineCore() {
  worker.Stop();
  schedule.reset();
  path.reset();
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
  return accumulation == 1 && schedule->mode() == Overlap::kNone;
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

Status EngineCore::GradientReady(EngineParam& p, const void* grad, void* stream) {
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
  ZO_RETURN_IF_ERROR(path->Hand(i, grad, add, final, stream));
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

Status EngineCore::Initialize() {
  uint64_t largest = 0;
  for (const EngineParam& p : params) largest = std::max(largest, p.n);
  AlignedBuffer masters, raw;
  for (size_t i = 0; i < params.size(); ++i) {
    EngineParam& p = params[i];
    const float* initial = p.initial;  // the given fp32 values win
    if (initial == nullptr) {
      if (masters.empty()) {
        ZO_ASSIGN_OR_RETURN(masters, AlignedBuffer::Allocate(4 * largest, 64));
        ZO_ASSIGN_OR_RETURN(raw, AlignedBuffer::Allocate(4 * largest, 64));
      }
      ZO_ASSIGN_OR_RETURN(const void* values, path->Values(p, raw.data()));
      Accumulate(masters.as<float>(), values, p.dtype, p.n, false);
      initial = masters.as<float>();
    }
    ZO_RETURN_IF_ERROR(state->Write(i, initial).WithContext(StrCat("initializing '", p.name, "'")));
  }
  return Status::Ok();
}

}  // namespace zoffload::internal
