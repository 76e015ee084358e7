// The three StepSchedules (step_schedule.h): overlap none, backward and delayed.
#include <atomic>
#include <cstring>
#include <vector>

#include "common/strings.h"
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

// ---- none ---------------------------------------------------------------------------------

class ExactSchedule final : public StepSchedule {
 public:
  explicit ExactSchedule(EngineCore& core) : core_(core) {}
  Overlap mode() const override { return Overlap::kNone; }
  bool NormsOnLanding() const override { return true; }
  Status CanReportNorm() const override { return Status::Ok(); }

  // The partition gives the norm where it is known before the update (else the state's step
  // makes it in its pass), the owned gradients and where the new values go, then sends them
  // on. A partition that owns nothing takes the same skip and clip decision.
  Status Step(EngineStepStats* stats, Status* /*outcome*/) override {
    EngineCore& e = core_;
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

 private:
  EngineCore& core_;
};

// ---- backward -----------------------------------------------------------------------------

// The updater thread takes each parameter once the worker has checked its gradient (its norm
// part, inf/NaN before anything is written), in that order, and updates it (the upload of each
// chunk follows at once), while the worker checks the next.
class BackwardSchedule final : public StepSchedule {
 public:
  explicit BackwardSchedule(EngineCore& core) : core_(core) {
    updater_.Start([this](size_t i) { UpdateOne(i); });
  }
  ~BackwardSchedule() override { updater_.Stop(); }
  Overlap mode() const override { return Overlap::kBackward; }
  bool NormsOnLanding() const override { return true; }
  bool UpdatesOnLanding() const override { return true; }

  void BeginWindow() override {
    base_ = core_.NextBase();
    hypers_ = GroupHypers(core_.groups, base_);
    nonfinite_.clear();
    status_ = Status::Ok();
    stats_ = StepStats{};
  }
  void Landed(size_t i) override { updater_.Push(i); }
  void AwaitUpdates() override { updater_.AwaitAll(); }

  // Each parameter was updated as its gradient landed; the norm is their parts added in
  // parameter order, as the exact step adds them.
  Status Step(EngineStepStats* stats, Status* outcome) override {
    EngineCore& e = core_;
    ZO_RETURN_IF_ERROR(status_.WithContext("Step (overlap \"backward\")"));
    stats->grad_norm = NormOf(e.squares).l2;
    stats->adam_seconds = stats_.adam_seconds;
    ++e.steps;
    if (nonfinite_.empty()) return Status::Ok();
    std::vector<std::string> names;
    for (size_t i : nonfinite_) names.push_back(StrCat("'", e.params[i].name, "'"));
    *outcome = DataLossError(
        StrCat("Step: the gradients of ", nonfinite_.size(), " parameters (", FirstFew(names, ", "),
               ") hold inf/NaN and were not applied; under zoffload.overlap \"backward\" the "
               "other parameters were already updated during backward (overlap \"none\" skips "
               "the whole step instead)"));
    return Status::Ok();
  }

  Status CanClip(double max_norm) const override {
    if (max_norm == 0) return Status::Ok();
    return FailedPreconditionError(
        StrCat("SetGradientClipping ", max_norm,
               ": zoffload.overlap \"backward\" updates each parameter before the global norm "
               "exists; use overlap \"none\" to clip"));
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
  // On the updater: parameter i's update, once its gradient is checked.
  void UpdateOne(size_t i) {
    if (!core_.squares[i].finite) {
      nonfinite_.push_back(i);
      return;
    }
    const auto start = EngineClock::now();
    if (status_.ok()) {
      const TensorGrads g = core_.GradsOf(i, &hypers_[core_.params[i].group]);
      status_ = core_.state->UpdateTensor(i, g, base_, core_.path.get(), &stats_);
    }
    if (Tracer* tracer = core_.rt->tracer()) {
      tracer->Record(kWorkerTrack, core_.params[i].name, start, EngineClock::now());
    }
  }

  EngineCore& core_;
  Lane<size_t> updater_;
  // Per window: fixed at its first gradient, then the updater's (read after AwaitUpdates).
  AdamHyper base_;
  std::vector<AdamHyper> hypers_;
  std::vector<size_t> nonfinite_;  // parameters whose gradient had inf/NaN
  Status status_;                  // the updater's first error
  StepStats stats_;                // CPU Adam time
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
  switch (core.config.zoffload.overlap) {
    case Overlap::kBackward:
      return std::make_unique<BackwardSchedule>(core);
    case Overlap::kDelayed:
      return std::make_unique<DelayedSchedule>(core);
    case Overlap::kNone:
      break;
  }
  return std::make_unique<ExactSchedule>(core);
}

}  // namespace zoffload::internal
