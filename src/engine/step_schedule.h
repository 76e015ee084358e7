// StepSchedule: the engine core's seam for when the update runs (zoffload.overlap), one
// implementation per mode (step_schedules.cc):
// - none: Step waits for every gradient, then norm, skip, clip and the update (exact);
// - backward: each parameter is updated on an updater thread as soon as its gradient has
//   landed, while backward goes on, speculatively: with its state kept aside first, so that
//   Step, once the global norm is known, either commits the updates (no clipping needed, every
//   gradient finite) or undoes them and runs the exact step (always the result of none);
// - delayed: Step launches the window's whole update on the worker and returns; it runs under
//   the next window's forward and backward, whose gradients wait for it parameter by
//   parameter (one step stale).
// The core calls the hooks; each schedule keeps its own state and threads.
#pragma once

#include <cstdint>
#include <memory>

#include "zoffload/config.h"
#include "zoffload/engine.h"
#include "zoffload/status.h"

namespace zoffload::internal {

struct EngineCore;
struct EngineParam;

class StepSchedule {
 public:
  virtual ~StepSchedule() = default;
  virtual Overlap mode() const = 0;
  /// The worker computes each gradient's norm part as the window's last micro-batch of it
  /// lands (where pieces go to the worker at all), then calls Landed.
  virtual bool NormsOnLanding() const = 0;
  /// Each parameter's gradient goes to the worker once landed, whatever the path (backward).
  virtual bool UpdatesOnLanding() const { return false; }
  /// Allocates what parameter `p` needs under this schedule.
  virtual Status Allocate(EngineParam& /*p*/) { return Status::Ok(); }
  virtual void BeginWindow() {}
  /// Before parameter i's last gradient of the window is handed over (after the work on
  /// `stream`).
  virtual Status BeforeLastGradient(size_t /*i*/, void* /*stream*/) { return Status::Ok(); }
  /// Blocks until no running update reads parameter i's gradient buffer any more.
  virtual void AwaitRead(size_t /*i*/) {}
  /// On the worker: parameter i's gradient is all in host memory, its squares known.
  virtual void Landed(size_t /*i*/) {}
  /// On the worker: the task the schedule pushed (EngineCore::kRunUpdate).
  virtual void RunOnWorker() {}
  /// Blocks until the updates started during backward are done.
  virtual void AwaitUpdates() {}
  /// The step: `stats` gets its outcome; `outcome` an error found after the state changed.
  virtual Status Step(EngineStepStats* stats, Status* outcome) = 0;
  /// The outcome of an update still running (delayed), once it is done; `stats` may be null.
  virtual Status Collect(EngineStepStats* /*stats*/) { return Status::Ok(); }
  /// The parameters become those of the last Step (after the work on `stream`).
  virtual Status Flush(void* /*stream*/) { return Status::Ok(); }
  /// Whether Hand may take a gradient where the caller wrote it in the engine's buffer.
  virtual bool TakesInPlace() const { return true; }
  /// Whether the landed gradients must outlive the updates made from them (a step may be
  /// redone): the new values then go up from staging slots, never from over a gradient.
  virtual bool KeepsGradients() const { return false; }
  /// GradientNorm before Step.
  virtual Status CanReportNorm() const;
  /// A max norm for clipping from the next Step on.
  virtual Status CanClip(double /*max_norm*/) const { return Status::Ok(); }
  /// A group's hyperparameters changed to `group` now.
  virtual Status CanChangeGroup(int /*index*/, const ParamGroup& /*group*/) const {
    return Status::Ok();
  }
};

/// The schedule of `core.config.zoffload.overlap`.
std::unique_ptr<StepSchedule> MakeSchedule(EngineCore& core);

}  // namespace zoffload::internal
