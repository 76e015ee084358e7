// Partition: the engine core's seam for which part of the optimizer state this process owns
// and how gradients and new values are exchanged with the others:
// - identity (identity_partition.cc): one process owns everything; the gradients come through
//   the core's GradientPath, the new values go back through it;
// - ZeRO stage 1, 2 or 3 (zero_partition.cc): this rank owns one slice of every bucket of a
//   BucketPlan; gradients are reduce-scattered over a Communicator (src/zero), the norm is
//   exact over every rank, and the new values are all-gathered (stages 1-2) or gathered per
//   parameter on use (stage 3).
// The core (engine_core.h) holds one, made before anything else, and never asks which.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tiers/optimizer_state.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/runtime.h"
#include "zoffload/status.h"

namespace zoffload::internal {

struct EngineParam;

class Partition {
 public:
  virtual ~Partition() = default;
  /// The optimizer state of what this process owns (null: it owns nothing), in `context`.
  virtual Status CreateState(RuntimeContext& context, const OptimizerStateOptions& options) = 0;
  /// The gradient buffers and the masters, once the core has its path and schedule.
  virtual Status Initialize() = 0;
  /// Whether gradients beyond the declared micro-batches add up as torch's .grad does (where
  /// the core's schedule allows: EngineCore::AddsAsTorch).
  virtual bool TakesExtras() const = 0;
  /// Parameter i's gradient of micro-batch `add` ? later : first, `last` of the window (the
  /// core has checked it and counts it).
  virtual Status Take(size_t i, const void* grad, bool add, bool last, void* stream) = 0;
  /// Where a caller may write parameter `p`'s gradient for Take to take in place, or null.
  virtual void* InPlaceBuffer(EngineParam& p) = 0;
  /// The window's gradient norm (raw, loss-scaled), kept in the core's window_norm: where it is
  /// known without the update's own pass, or `now`; else nullopt (the state's step makes it).
  virtual Result<std::optional<GradNorm>> Norm(bool now) = 0;
  /// The owned gradients as the update reads them, pointing into `hypers`.
  virtual std::vector<TensorGrads> Grads(const std::vector<AdamHyper>& hypers) = 0;
  /// Where the update's new values go.
  virtual ParamSink* Sink() = 0;
  /// After the update (or its skip): the new values to every process that needs them.
  virtual Status Finish(bool skipped) = 0;
  virtual Status Save(const std::string& dir) = 0;
  virtual Status Load(const std::string& dir) = 0;
  /// Host bytes held beyond the state: gradient buffers, staging.
  virtual uint64_t host_bytes() const = 0;
  /// Whether a parameter may be updated as soon as its gradient has landed (overlap
  /// "backward"; "auto" chooses it where this holds): this process owns all of the state.
  virtual bool UpdatesOnLanding() const = 0;
  /// The trace track on which each whole Step is a span "step" (null: none).
  virtual const char* step_track() const { return nullptr; }
};

}  // namespace zoffload::internal
