// EngineCore: the one trainer core, behind OffloadEngine (one process) and ZeroOptimizer (ZeRO
// across ranks) alike — the parameters, the optimizer state, the step count and loss scale,
// the gradients of the window (the micro-batches between two Steps), and the worker thread,
// with what varies behind three seams:
// - a Partition (partition.h): what this process owns, and the exchange with the others;
// - a GradientPath (gradient_path.h): host or device memory;
// - a StepSchedule (step_schedule.h): overlap none, backward or delayed.
//
// The worker thread handles, in order, what the path and the schedule push: gradient pieces as
// they land (the path checks each arrived and sums micro-batches; the core then makes the
// gradient's norm part where the schedule wants it as it lands), and the schedule's tasks
// (the delayed update).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/gradient_path.h"
#include "engine/lane.h"
#include "engine/loss_scaler.h"
#include "engine/partition.h"
#include "engine/step_schedule.h"
#include "tiers/optimizer_state.h"
#include "tiers/runtime_context.h"
#include "zoffload/config.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/engine.h"
#include "zoffload/future.h"

namespace zoffload::internal {

using EngineClock = std::chrono::steady_clock;

struct EngineParam {
  std::string name;
  void* data = nullptr;
  uint64_t n = 0;
  DType dtype = DType::kBf16;
  int group = 0;
  std::vector<uint64_t> shape;
  const float* initial = nullptr;  // the caller's fp32 values, during Create only
  HostMemory grads;                // accumulation 1: the gradient (dtype); > 1: the fp32 sum
  HostMemory landing;  // accumulation > 1 on the GPU: each micro-batch's gradient (dtype)
  // Overlap "delayed" with accumulation > 1: the new values (dtype) until they are uploaded
  // (with accumulation 1 they are written over the gradient in `grads`).
  HostMemory staged;
  int received = 0;      // gradients in this accumulation window
  bool pending = false;  // delayed: the new values wait in Out() for their upload
  // The last upload from Out() (delayed) or from where the gradient landed (device path, state
  // in host memory), which the next gradient waits for.
  Future<> upload;
  uint64_t bytes() const { return n * DTypeBytes(dtype); }
  std::byte* Out() { return (staged.empty() ? grads : staged).data(); }
  // Where the last gradient landed (dtype): `grads` with accumulation 1, else `landing`.
  std::byte* Landed() { return (landing.empty() ? grads : landing).data(); }
};

struct EngineCore {
  // The tag of the worker's task (a piece's is WorkItem::Tag's).
  static constexpr uint32_t kRunUpdate = UINT32_MAX;

  Config config;  // validated (ValidateConfig)
  EngineOptions options;
  std::unique_ptr<RuntimeContext> own_context;  // when the caller gave none
  Runtime* rt = nullptr;
  std::vector<EngineParam> params;
  std::map<std::string, size_t, std::less<>> index;
  std::vector<ParamGroup> groups;
  std::unique_ptr<OptimizerState> state;  // the partition's (null: it owns nothing)
  LossScaler scaler{Fp16Config{}};
  int accumulation = 1;
  int64_t steps = 0;
  uint64_t total = 0;
  uint64_t grads_in_window = 0;  // GradientReady calls since the last Step
  EngineStepStats last;
  std::unique_ptr<Partition> partition;
  std::unique_ptr<GradientPath> path;
  std::unique_ptr<StepSchedule> schedule;
  Lane<WorkItem> worker;
  int landing_threads = 1;  // for the norm parts made on the worker
  // Per window: each parameter's gradient squares (where known) and, of its last micro-batch,
  // the bytes landed (pieces on the worker).
  std::vector<GradSquares> squares;
  std::vector<uint64_t> landed_bytes;
  // Overlap "none": the window's norm, once GradientNorm has computed it (a caller clipping
  // before Step); Step takes it instead of a second norm pass. Any new gradient drops it.
  std::optional<GradNorm> window_norm;
  std::vector<size_t> arrival;  // parameters in the order their window's last gradient came

  // The worker first (it finishes what is queued, waiting for each piece to land), then the
  // schedule (its updater uploads through the path), the path, the partition.
  ~EngineCore();

  using MakePartition = std::function<Result<std::unique_ptr<Partition>>(EngineCore&)>;
  // Changes the runtime options made from the checked config before the core's own context is
  // made from them (ZeRO: each rank's own swap directories).
  using AdjustRuntime = std::function<Status(RuntimeOptions&)>;
  // Create's one path, for every world size: checks `config` (the parser's rules, `world`
  // ranks) and `specs` (errors prefixed by `who`), then makes the partition, the schedule, the
  // state, the path, the buffers and the masters, in options.context (borrowed; null: one of
  // the core's own, from the checked config, through `adjust` when given).
  Status Setup(const Config& config, std::vector<ParameterSpec> specs, EngineOptions options,
               std::string_view who, int world, const MakePartition& make,
               const AdjustRuntime& adjust = nullptr);

  Result<EngineParam*> Find(std::string_view name);
  size_t IndexOf(const EngineParam& p) const { return static_cast<size_t>(&p - params.data()); }
  bool gpu() const { return path->on_gpu(); }
  // On the worker.
  void Handle(const WorkItem& item);
  // Blocks until the worker has handled every item sent so far, and the schedule's updates.
  void AwaitWorker();
  // Overlap "none", gradient_accumulation_steps 1 (or unset): a parameter may take more
  // gradients than declared before Step, added into its gradient in its dtype as torch adds
  // into .grad (a loop that accumulates by repeated backward, as every torch optimizer
  // allows). In the overlap modes the declared count is the count.
  bool AddsAsTorch() const;
  // Every parameter has its gradients of the window (at least the declared count where
  // AddsAsTorch); else FAILED_PRECONDITION from `what` naming the first five without (then
  // `consequence`).
  Status CheckWindowComplete(std::string_view what, std::string_view consequence) const;
  // Checks `grad` (elements, dtype, memory) and hands it over.
  Status GradientReady(std::string_view name, const void* grad, uint64_t elements, DType dtype,
                       void* stream);
  Result<void*> GradientBuffer(std::string_view name);
  Result<EngineStepStats> Step();
  Status SetGroup(int index, const ParamGroup& group);
  // Parameter `p`'s state (ReadState's layout), and its value in the model, through the path.
  Status LoadState(EngineParam& p, const float* master, const void* m, const void* v);
  // The model's parameter `p` becomes `master` (p.n floats) in its dtype, through the path, as
  // a step's chunks go.
  Status PublishMaster(EngineParam& p, const float* master);
  uint64_t host_bytes() const;
  // Waits until the window's gradients are all in host memory (and summed), and reads their
  // squares where the path made them and no worker has.
  Status AwaitGradients();
  // Every parameter's squares are in `squares` once AwaitGradients returns.
  bool SquaresKnown() const;
  // Parameter i's gradient as the update reads it, with its group's hyperparameters (or none).
  TensorGrads GradsOf(size_t i, const AdamHyper* hyper) const;
  // Every parameter's, pointing into `hypers` (empty: none).
  std::vector<TensorGrads> AllGrads(const std::vector<AdamHyper>& hypers) const;
  // Parameter i's part of the norm (its gradient as the update reads it).
  GradSquares SquaresOf(size_t i, int threads) const;
  AdamHyper NextBase() const;
  // Save and Load run between steps.
  Status BetweenSteps(std::string_view what) const;
  // Where parameter memory must live: the engine's GPU, or the host in host mode.
  Status CheckMemory(const void* ptr, bool gpu, const std::string& what) const;

 private:
  void BeginWindow();
  // Counts a gradient of `p` handed over (its hand-over began at `start`); the window's norm,
  // if GradientNorm made one, no longer holds.
  Status Received(EngineParam& p, EngineClock::time_point start);
};

/// The identity partition (identity_partition.cc): this process owns everything.
std::unique_ptr<Partition> MakeIdentityPartition(EngineCore& core);

}  // namespace zoffload::internal
