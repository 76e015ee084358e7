// The three StepSchedules (step_schedule.h): overlap none, backward and delayed.
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/config_rules.h"
#include "common/log.h"
#include "common/strings.h"
#include "common/topology.h"
#include "common/trace.h"
#include "cpu_adam/adam_math.h"
#include "engine/engine_core.h"
#include "engine/param_math.h"
#include "engine/step_schedule.h"

namespace zoffload::internal {
namespace {

constexpr const char* kWorkerTrack = "updates during backward";  // overlap "backward"

// What a step's result says, into its stats.
void Report(const AdamStepResult& result, EngineStepStats* stats) {
  stats->skipped = result.skipped;
  stats->grad_norm = result.grad_norm;
  stats->clip_coef = result.clip_coef;
}

// Whether overlap "none" takes a step of raw (loss-scaled) norm `norm` as it comes: every
// gradient finite and the clip coefficient 1 for `max_norm`; `grad_norm` gets the norm unscaled.
bool StandsAsIs(const GradNorm& norm, float loss_scale, double max_norm, double* grad_norm) {
  if (!norm.finite) return false;
  float clip_coef = 1;
  ClipAndUnscale(norm.l2, loss_scale, static_cast<float>(max_norm), grad_norm, &clip_coef);
  return clip_coef == 1.0f;
}

// ---- none ---------------------------------------------------------------------------------

// The exact step: the partition gives the norm where it is known before the update (else the
// state's step makes it in its pass), the owned gradients and where the new values go, then
// sends them on. A partition that owns nothing takes the same skip and clip decision.
Status ExactStep(EngineCore& e, EngineStepStats* stats) {
  const AdamHyper base = e.NextBase();
  const std::vector<AdamHyper> hypers = GroupHypers(e.groups, base);
  auto norm = e.partition->Norm(e.state == nullptr);
  const float max_norm = static_cast<float>(e.config.gradient_clipping);
  Result<AdamStepResult> result = AdamStepResult{};
  if (!norm.ok()) {
    result = norm.status();
  } else if (e.state != nullptr) {
    const std::vector<TensorGrads> grads = e.partition->Grads(hypers);  // (into `hypers`)
    result = e.state->Step(grads, base, stats->loss_scale, max_norm, e.partition->Sink(), {},
                           *norm ? &**norm : nullptr);
  } else if (!(*norm)->finite) {
    result->skipped = true;
    result->grad_norm = NonfiniteNorm((*norm)->l2);
  } else {
    ClipAndUnscale((*norm)->l2, stats->loss_scale, max_norm, &result->grad_norm,
                   &result->clip_coef);
  }
  e.window_norm.reset();
  ZO_RETURN_IF_ERROR(result.status().WithContext("Step"));
  Report(*result, stats);
  if (!result->skipped) {
    ++e.steps;
    if (e.state != nullptr) {
      const StepStats& s = e.state->last_step();
      stats->adam_seconds = s.adam_seconds;
      stats->io_wait_seconds = s.io_wait_seconds;
      stats->nvme_bytes_read = s.bytes_read;
      stats->nvme_bytes_written = s.bytes_written;
    }
  }
  ZO_RETURN_IF_ERROR(e.partition->Finish(result->skipped).WithContext("Step"));
  e.scaler.Update(result->skipped);
  return Status::Ok();
}

class ExactSchedule final : public StepSchedule {
 public:
  explicit ExactSchedule(EngineCore& core) : core_(core) {}
  Overlap mode() const override { return Overlap::kNone; }
  bool NormsOnLanding() const override { return true; }
  Status CanReportNorm() const override { return Status::Ok(); }
  Status Step(EngineStepStats* stats, Status* /*outcome*/) override {
    return ExactStep(core_, stats);
  }

 private:
  EngineCore& core_;
};

// ---- backward -----------------------------------------------------------------------------

// Speculation. The updater thread takes each parameter once the worker has made its norm
// part, in landing order, keeps its state aside (OptimizerState::Keep) and updates it with
// clip coefficient 1 (the upload of each chunk follows at once), while backward goes on. It
// stops speculating once the squares so far already exceed gradient_clipping or a gradient
// holds inf/NaN; a parameter with no room for its copy (zoffload.rollback_bytes) waits. Step
// then makes the decision overlap "none" makes, from the same norm: no clipping and all finite
// commits (the waiting parameters are updated now, as they would be); otherwise the kept
// states come back (a swap of buffers) and the exact step runs over the untouched state and
// the gradients, which stayed where they landed. Either way the result is none's, bit for bit.
// After a step that clipped or overflowed, or changed the loss scale, the next one runs exact
// without speculating (a redo would likely follow).
// Where only an inf/NaN gradient could make a step redo (no clipping so far, no fp16; from the
// second window on, when a loop that clips has set it), a parameter with no room for its copy
// is updated without one rather than wait: should a later gradient then hold inf/NaN, the step
// cannot be undone, and is made as far as it can be (every finite gradient applied), Step
// failing with DATA_LOSS naming the others.
class BackwardSchedule final : public StepSchedule {
 public:
  explicit BackwardSchedule(EngineCore& core) : core_(core) {
    updater_.Start([this](size_t i) { UpdateOne(i); });
  }
  ~BackwardSchedule() override { updater_.Stop(); }
  Overlap mode() const override { return Overlap::kBackward; }
  bool NormsOnLanding() const override { return true; }
  bool UpdatesOnLanding() const override { return true; }
  bool KeepsGradients() const override { return true; }
  Status CanReportNorm() const override { return Status::Ok(); }

  void BeginWindow() override {
    EngineCore& e = core_;
    base_ = e.NextBase();
    hypers_ = GroupHypers(e.groups, base_);
    status_ = Status::Ok();
    stats_ = StepStats{};
    deferred_.clear();
    speculated_ = 0;
    squares_so_far_ = 0;
    stopped_ = false;
    abandon_.store(false);
    no_room_ = false;
    uncopied_ = false;
    may_go_uncopied_ =
        !e.config.fp16.enabled && e.config.gradient_clipping == 0 && windows_ > 0 && !clipped_ever_;
    ++windows_;
    why_ = next_why_;
    loss_scale_ = e.scaler.scale();
    grad_scale_ = static_cast<float>(1.0 / static_cast<double>(loss_scale_));
    max_norm_ = e.config.gradient_clipping;
    if (!room_) room_ = RollbackRoom();
  }
  void Landed(size_t i) override {
    if (why_.empty()) updater_.Push(i);
  }
  // Every gradient has landed and been checked (the worker is done): where their squares
  // already say the step will be redone, the updates still queued would only be undone, and
  // are left to the redo. (Not where updates may run without a set: how much of such a step
  // could be undone would then depend on the updater's progress.)
  void AwaitUpdates() override {
    double grad_norm = 0;
    if (why_.empty() && !may_go_uncopied_ && core_.grads_in_window > 0 &&
        !StandsAsIs(NormOf(core_.squares), loss_scale_, core_.config.gradient_clipping,
                    &grad_norm)) {
      abandon_.store(true);
    }
    updater_.AwaitAll();
  }

  Status Step(EngineStepStats* stats, Status* outcome) override {
    EngineCore& e = core_;
    clipped_ever_ = clipped_ever_ || e.config.gradient_clipping > 0;
    if (!status_.ok()) {  // the updates come back; the next Step runs exact (the model too)
      e.state->Undo();
      next_why_ = why_ = "a failed update during backward";
      return std::exchange(status_, Status::Ok()).WithContext("Step (overlap \"backward\")");
    }
    if (!why_.empty()) return Exact(stats, "exact", why_);
    // The decision overlap "none" makes, from the norm it uses.
    ZO_ASSIGN_OR_RETURN(const std::optional<GradNorm> norm, e.partition->Norm(true));
    double grad_norm = 0;
    if (!norm->finite && uncopied_) return Unrecoverable(*norm, stats, outcome);
    if (!StandsAsIs(*norm, stats->loss_scale, e.config.gradient_clipping, &grad_norm)) {
      const std::vector<size_t> undone = e.state->Undo();
      ZO_RETURN_IF_ERROR(Exact(stats, "redone",
                               !norm->finite
                                   ? "the gradients hold inf/NaN"
                                   : StrCat("the norm ", grad_norm, " is above gradient_clipping ",
                                            e.config.gradient_clipping)));
      if (!stats->skipped) return Status::Ok();  // the exact step sent every parameter anew
      for (size_t i : undone) {                  // the model as before the step
        ZO_RETURN_IF_ERROR(e.PublishMaster(e.params[i], e.state->host_master(i))
                               .WithContext("Step (overlap \"backward\", skipped)"));
      }
      return Status::Ok();
    }
    e.state->Commit();
    stats->speculation = "committed";
    stats->speculated_elements = speculated_;
    if (no_room_) stats->speculation_why = "some parameters waited for room for their copies";
    e.window_norm.reset();
    ++e.steps;
    stats->grad_norm = grad_norm;
    for (size_t i : deferred_) {  // after the commit: an error here leaves the step half made
      *outcome = Update(i);
      if (!outcome->ok()) break;
    }
    stats->adam_seconds = stats_.adam_seconds;
    ZO_RETURN_IF_ERROR(e.partition->Finish(false).WithContext("Step"));
    e.scaler.Update(false);
    next_why_ = e.scaler.scale() != stats->loss_scale ? "the loss scale changed" : "";
    return Status::Ok();
  }

  Status CanClip(double max_norm) const override {
    if (max_norm == 0 || !may_go_uncopied_ || core_.grads_in_window == 0) return Status::Ok();
    return FailedPreconditionError(StrCat(
        "SetGradientClipping ", max_norm,
        ": under zoffload.overlap \"backward\" this step's updates run during backward, where "
        "no room is left for copies to undo them, as no clipping was set; set the clipping "
        "before the first backward of a step, or zoffload.rollback_bytes for every parameter"));
  }
  Status CanChangeGroup(int index, const ParamGroup& group) const override {
    if (core_.grads_in_window == 0 || core_.groups[static_cast<size_t>(index)] == group) {
      return Status::Ok();
    }
    return FailedPreconditionError(StrCat(
        "SetGroup ", index,
        ": under zoffload.overlap \"backward\" this window's updates "
        "have begun with the group as it was; change it between Step and the first gradient"));
  }

 private:
  // zoffload.rollback_bytes, or 3/4 of the host memory free now (the first window: the state
  // and the engine's buffers are in place).
  uint64_t RollbackRoom() const {
    if (const std::optional<uint64_t>& set = core_.config.zoffload.rollback_bytes) return *set;
    const uint64_t free = AvailableHostMemory();
    return free == UINT64_MAX ? 0 : free / 4 * 3;
  }

  // The exact step after backward (`kind`: "exact" or "redone", for `why`); the next window
  // speculates unless this step clipped, skipped or moved the loss scale.
  Status Exact(EngineStepStats* stats, std::string_view kind, std::string why) {
    ZO_RETURN_IF_ERROR(ExactStep(core_, stats));
    stats->speculation = std::string(kind);
    stats->speculation_why = std::move(why);
    if (kind == "redone") stats->speculated_elements = speculated_;
    next_why_ = stats->skipped ? "the last step's gradients held inf/NaN"
                : stats->clip_coef != 1.0f
                    ? StrCat("the last step clipped (norm ", stats->grad_norm, ")")
                : core_.scaler.scale() != stats->loss_scale ? "the loss scale changed"
                                                            : "";
    return Status::Ok();
  }

  // An inf/NaN gradient after updates made without copies: every finite gradient is applied
  // (the kept copies dropped), the others are left out and named.
  Status Unrecoverable(const GradNorm& norm, EngineStepStats* stats, Status* outcome) {
    EngineCore& e = core_;
    e.state->Commit();
    std::vector<std::string> names;
    for (size_t i = 0; i < e.params.size(); ++i) {
      if (!e.squares[i].finite) names.push_back(StrCat("'", e.params[i].name, "'"));
    }
    for (size_t i : deferred_) {
      if (e.squares[i].finite) ZO_RETURN_IF_ERROR(Update(i).WithContext("Step"));
    }
    e.window_norm.reset();
    ++e.steps;
    stats->speculation = "committed";
    stats->speculation_why = "inf/NaN after updates without copies";
    stats->speculated_elements = speculated_;
    stats->grad_norm = NonfiniteNorm(norm.l2);
    stats->adam_seconds = stats_.adam_seconds;
    *outcome = DataLossError(
        StrCat("Step: the gradients of ", names.size(), " parameters (", FirstFew(names, ", "),
               ") hold inf/NaN and were not applied; under zoffload.overlap \"backward\" the other "
               "parameters were updated during backward without room to undo them "
               "(zoffload.rollback_bytes), so the step could not be skipped as overlap \"none\" "
               "skips it"));
    return Status::Ok();
  }

  // Parameter i's update with clip coefficient 1, timed into stats_.
  Status Update(size_t i) {
    const auto start = EngineClock::now();
    const TensorGrads g = core_.GradsOf(i, &hypers_[core_.params[i].group]);
    const Status s = core_.state->UpdateTensor(i, g, base_, grad_scale_, core_.path.get(), &stats_);
    if (Tracer* tracer = core_.rt->tracer()) {
      tracer->Record(kWorkerTrack, core_.params[i].name, start, EngineClock::now());
    }
    return s;
  }

  // On the updater: parameter i, speculatively if it still may be (see the class comment).
  void UpdateOne(size_t i) {
    if (!status_.ok()) return;
    const GradSquares& sq = core_.squares[i];
    squares_so_far_ += sq.sum;
    stopped_ = stopped_ || abandon_.load() || !sq.finite ||
               (max_norm_ > 0 && std::sqrt(squares_so_far_) / loss_scale_ > max_norm_);
    if (!stopped_) {
      Result<bool> kept = core_.state->Keep(i, *room_);
      if (!kept.ok()) {
        status_ = kept.status();
        return;
      }
      if (*kept || may_go_uncopied_) {
        uncopied_ = uncopied_ || !*kept;
        status_ = Update(i);
        speculated_ += core_.params[i].n;
        return;
      }
      no_room_ = true;
    }
    deferred_.push_back(i);
  }

  EngineCore& core_;
  Lane<size_t> updater_;
  std::optional<uint64_t> room_;  // for the kept copies: fixed at the first window
  std::string next_why_;          // why the next window will not speculate (empty: it will)
  // Per window: fixed at its first gradient, then the updater's (read after AwaitUpdates).
  std::string why_;
  AdamHyper base_;
  std::vector<AdamHyper> hypers_;
  float loss_scale_ = 1, grad_scale_ = 1;
  double max_norm_ = 0;
  double squares_so_far_ = 0;         // raw, in landing order
  bool stopped_ = false;              // no more speculation in this window
  std::atomic<bool> abandon_{false};  // the window will be redone (AwaitUpdates)
  bool no_room_ = false;              // a parameter found no room for its copy, and waited
  bool may_go_uncopied_ = false;      // only inf/NaN can redo this window (see the class comment)
  bool uncopied_ = false;             // a parameter was updated without a copy
  int64_t windows_ = 0;               // windows begun
  bool clipped_ever_ = false;         // a Step had clipping set
  std::vector<size_t> deferred_;      // landed, not updated: the step updates them if it commits
  uint64_t speculated_ = 0;           // elements updated during backward
  Status status_;                     // the updater's first error
  StepStats stats_;                   // CPU Adam time
};

// ---- delayed ------------------------------------------------------------------------------

// The update launched at a Step runs on the worker during the next window; each parameter's
// next gradient waits until the update has read this one. Its sink writes the new values over
// the gradient they come from (with several micro-batches, into `staged`); they go to the model
// at the parameter's last gradient of the next window, so every micro-batch's forward sees the
// same (one step older) values and the next forward runs after the uploads.
class DelayedSchedule final : public StepSchedule, private ParamSink {
 public:
  explicit DelayedSchedule(EngineCore& core)
      : core_(core), consumed_(std::make_unique<std::atomic<int64_t>[]>(core.params.size())) {
    for (size_t i = 0; i < core.params.size(); ++i) consumed_[i].store(0);
  }
  Overlap mode() const override { return Overlap::kDelayed; }
  bool NormsOnLanding() const override { return false; }
  bool TakesInPlace() const override { return false; }  // the update reads the last gradient

  Status Allocate(EngineParam& p) override {
    if (core_.accumulation == 1) return Status::Ok();
    ZO_ASSIGN_OR_RETURN(
        p.staged,
        core_.rt->AllocateHost(p.bytes(), StrCat("the new values of '", p.name, "'"), core_.gpu()));
    return Status::Ok();
  }
  Status BeforeLastGradient(size_t i, void* stream) override { return UploadPending(i, stream); }
  void AwaitRead(size_t i) override {
    if (core_.params[i].pending) AwaitConsumed(i);
  }
  void RunOnWorker() override {
    job_result_ = core_.state->Step(job_grads_, job_base_, 1.0f,
                                    static_cast<float>(core_.config.gradient_clipping), this,
                                    job_order_, core_.SquaresKnown() ? &job_norm_ : nullptr);
    job_stats_ = core_.state->last_step();
    update_done_.store(true);
    for (size_t i = 0; i < core_.params.size(); ++i) {  // skipped or failed: none was read
      consumed_[i].store(launched_);
      consumed_[i].notify_all();
    }
  }

  // The update launched at the last Step has finished (each gradient of this window waited
  // for it); this Step reports it, then launches this window's.
  Status Step(EngineStepStats* stats, Status* /*outcome*/) override {
    EngineCore& e = core_;
    ZO_RETURN_IF_ERROR(Collect(stats).WithContext("Step (overlap \"delayed\")"));
    job_base_ = e.NextBase();
    job_hypers_ = GroupHypers(e.groups, job_base_);
    job_grads_ = e.AllGrads(job_hypers_);
    job_order_ = e.arrival;
    if (e.SquaresKnown()) job_norm_ = NormOf(e.squares);
    ++launched_;
    for (EngineParam& p : e.params) p.pending = true;
    update_done_.store(false);
    outstanding_ = true;
    e.worker.Push({nullptr, 0, EngineCore::kRunUpdate});
    if (launched_ > e.config.zoffload.delayed_warmup_steps) return Status::Ok();
    // A warm-up step is exact: its values go up before the next forward.
    ZO_RETURN_IF_ERROR(Collect(stats).WithContext("Step (delayed warm-up)"));
    return UploadAllPending(nullptr);
  }

  Status Collect(EngineStepStats* stats) override {
    if (!outstanding_) return Status::Ok();
    core_.AwaitWorker();
    outstanding_ = false;
    ZO_RETURN_IF_ERROR(job_result_.status().WithContext(StrCat("update ", launched_)));
    if (job_result_->skipped) {
      for (EngineParam& p : core_.params) p.pending = false;  // nothing new to upload
    } else {
      ++core_.steps;
    }
    if (stats != nullptr) {
      Report(*job_result_, stats);
      if (!job_result_->skipped) stats->adam_seconds = job_stats_.adam_seconds;
    }
    return Status::Ok();
  }
  Status Flush(void* stream) override {
    ZO_RETURN_IF_ERROR(Collect(nullptr).WithContext("Flush"));
    return UploadAllPending(stream);
  }

 private:
  // Blocks until the launched update is past parameter i (it has read its gradient and written
  // its new values).
  void AwaitConsumed(size_t i) {
    const int64_t want = launched_;
    for (int64_t seen = consumed_[i].load(); seen < want; seen = consumed_[i].load()) {
      consumed_[i].wait(seen);
    }
  }
  // Parameter i's new values to the model (after the work on `stream`).
  Status UploadPending(size_t i, void* stream) {
    EngineParam& p = core_.params[i];
    if (!p.pending) return Status::Ok();
    AwaitConsumed(i);
    p.pending = false;
    if (update_done_.load() && (!job_result_.ok() || job_result_->skipped)) {
      return job_result_.status();  // Collect reports the error
    }
    return core_.path->Publish(p, p.Out(), stream);
  }
  Status UploadAllPending(void* stream) {
    for (size_t i = 0; i < core_.params.size(); ++i) {
      ZO_RETURN_IF_ERROR(UploadPending(i, stream));
    }
    return Status::Ok();
  }

  // ParamSink, on the worker: the chunk's gradient has been read; its new values go in its
  // place (in `staged`, once the last values went up from there).
  Result<void*> Begin(size_t t, uint64_t first, uint64_t /*n*/) override {
    EngineParam& p = core_.params[t];
    if (first == 0 && !p.staged.empty() && p.upload.valid()) ZO_RETURN_IF_ERROR(p.upload.Wait());
    return static_cast<void*>(p.Out() + first * DTypeBytes(p.dtype));
  }
  Status End(size_t t, uint64_t first, uint64_t n, const float* master) override {
    EngineParam& p = core_.params[t];
    if (p.dtype == DType::kFp32) std::memcpy(p.Out() + 4 * first, master, 4 * n);
    if (first + n == p.n) {
      consumed_[t].store(launched_);
      consumed_[t].notify_all();
    }
    return Status::Ok();
  }

  EngineCore& core_;
  std::unique_ptr<std::atomic<int64_t>[]> consumed_;  // the update (by number) past each one
  int64_t launched_ = 0;                              // updates launched
  bool outstanding_ = false;                          // one is launched and not yet collected
  std::atomic<bool> update_done_{false};
  std::vector<TensorGrads> job_grads_;
  std::vector<AdamHyper> job_hypers_;
  AdamHyper job_base_;
  std::vector<size_t> job_order_;
  GradNorm job_norm_;  // where the squares are known
  Result<AdamStepResult> job_result_{AdamStepResult{}};
  StepStats job_stats_;
};

}  // namespace

Status StepSchedule::CanReportNorm() const {
  return FailedPreconditionError(
      StrCat("GradientNorm: under zoffload.overlap \"", ToString(mode()),
             "\" the update does not wait for the step's norm; clipping from the training loop "
             "(clip_grad_norm_) needs overlap \"none\""));
}

std::unique_ptr<StepSchedule> MakeSchedule(EngineCore& core) {
  Overlap& mode = core.config.zoffload.overlap;
  const Overlap asked = mode;
  mode = ChosenOverlap(core.config, !core.partition->UpdatesOnLanding());
  if (asked == Overlap::kBackward && mode == Overlap::kNone) {
    LogOnce(LogLevel::kWarning, "zero-overlap-backward",
            "ZeRO across ranks: zoffload.overlap \"backward\" makes its updates after backward, "
            "as \"none\" (the same result); updates during backward are not implemented for "
            "ZeRO yet");
  }
  switch (mode) {
    case Overlap::kBackward:
      return std::make_unique<BackwardSchedule>(core);
    case Overlap::kDelayed:
      return std::make_unique<DelayedSchedule>(core);
    case Overlap::kNone:
    case Overlap::kAuto:  // resolved above
      break;
  }
  return std::make_unique<ExactSchedule>(core);
}

}  // namespace zoffload::internal
