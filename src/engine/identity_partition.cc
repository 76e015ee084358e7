// The identity Partition: one process owns every parameter's state (one OptimizerState tensor
// per parameter); gradients come through the core's GradientPath into each parameter's buffer
// and the new values go back through it.
#include <algorithm>
#include <memory>

#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "engine/checkpoint.h"
#include "engine/engine_core.h"
#include "engine/param_math.h"
#include "engine/partition.h"

namespace zoffload::internal {
namespace {

class IdentityPartition final : public Partition {
 public:
  explicit IdentityPartition(EngineCore& core) : core_(core) {}

  Status CreateState(RuntimeContext& context, const OptimizerStateOptions& options) override {
    std::vector<OptimizerTensor> tensors;
    for (const EngineParam& p : core_.params) tensors.push_back({p.name, p.n});
    ZO_ASSIGN_OR_RETURN(core_.state, OptimizerState::Create(std::move(tensors), context, options));
    return Status::Ok();
  }

  Status Initialize() override {
    EngineCore& e = core_;
    for (EngineParam& p : e.params) {
      const std::string what = StrCat("the gradient of '", p.name, "'");
      if (e.accumulation == 1) {
        // Pinned also in host mode with a GPU present: the caller's D2H may land there
        // (GradientBuffer).
        ZO_ASSIGN_OR_RETURN(p.grads, e.rt->AllocateHost(p.bytes(), what, e.rt->has_gpu()));
      } else {
        ZO_ASSIGN_OR_RETURN(p.grads,
                            e.rt->AllocateHost(4 * p.n, StrCat(what, " (fp32 sum)"), false));
      }
      ZO_RETURN_IF_ERROR(e.path->Allocate(p));
      ZO_RETURN_IF_ERROR(e.schedule->Allocate(p));
    }
    return Masters();
  }

  bool TakesExtras() const override { return true; }
  bool UpdatesOnLanding() const override { return true; }
  Status Take(size_t i, const void* grad, bool add, bool last, void* stream) override {
    return core_.path->Hand(i, grad, add, last, stream);
  }
  void* InPlaceBuffer(EngineParam& p) override {
    return core_.schedule->TakesInPlace() ? core_.path->InPlaceBuffer(p) : nullptr;
  }

  Result<std::optional<GradNorm>> Norm(bool now) override {
    EngineCore& e = core_;
    if (!e.window_norm && e.SquaresKnown()) e.window_norm = NormOf(e.squares);
    if (!e.window_norm && now) {
      ZO_ASSIGN_OR_RETURN(e.window_norm, e.state->Norm(e.AllGrads({})));
    }
    return e.window_norm;
  }
  std::vector<TensorGrads> Grads(const std::vector<AdamHyper>& hypers) override {
    return core_.AllGrads(hypers);
  }
  ParamSink* Sink() override { return core_.path.get(); }
  Status Finish(bool /*skipped*/) override { return Status::Ok(); }

  Status Save(const std::string& dir) override {
    EngineCore& e = core_;
    const StatePrecision precision = e.config.zoffload.optimizer_state;
    CheckpointMeta meta = CheckpointHeader(e.steps, e.scaler.state(), e.config, e.groups);
    for (const EngineParam& p : e.params) {
      meta.entries.push_back(EntryFor(p.name, p.n, p.shape, p.dtype, p.group, precision));
    }
    return WriteCheckpoint(dir, std::move(meta),
                           [&e](size_t i, float* master, std::byte* m, std::byte* v) {
                             return e.state->Read(i, master, m, v);
                           });
  }

  Status Load(const std::string& dir) override {
    EngineCore& e = core_;
    std::string from;
    ZO_ASSIGN_OR_RETURN(CheckpointMeta meta, ReadCheckpointMeta(dir, &from));
    std::vector<RegisteredParam> registered;
    for (const EngineParam& p : e.params) registered.push_back({p.name, p.n, p.dtype});
    ZO_ASSIGN_OR_RETURN(std::vector<const CheckpointEntry*> saved,
                        MatchCheckpoint(meta, from, registered, e.config.zoffload.optimizer_state,
                                        e.groups.size()));
    uint64_t largest = 0;
    for (const auto* c : saved) largest = std::max(largest, c->bytes());
    ZO_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(largest, 64));
    auto read = [&](const CheckpointEntry& c) {
      auto* m = buffer.data() + 4 * c.elements;
      return ReadCheckpointEntry(from, c, buffer.as<float>(), m, m + c.moment_bytes);
    };
    // Every checksum first: a damaged checkpoint changes nothing.
    for (const auto* c : saved) ZO_RETURN_IF_ERROR(read(*c));
    for (size_t i = 0; i < e.params.size(); ++i) {
      const CheckpointEntry& c = *saved[i];
      ZO_RETURN_IF_ERROR(read(c));
      auto* m = buffer.data() + 4 * c.elements;
      ZO_RETURN_IF_ERROR(e.LoadState(e.params[i], buffer.as<float>(), m, m + c.moment_bytes));
    }
    e.groups = meta.groups;
    e.steps = meta.steps;
    e.scaler.Restore({meta.loss_scale, meta.overflows, meta.good_steps});
    return Status::Ok();
  }

  uint64_t host_bytes() const override {
    uint64_t total = core_.path->host_bytes();
    for (const EngineParam& p : core_.params) {
      total += p.grads.size() + p.landing.size() + p.staged.size();
    }
    return total;
  }

 private:
  // The masters from the parameters' values (or the given fp32 values).
  Status Masters() {
    EngineCore& e = core_;
    uint64_t largest = 0;
    for (const EngineParam& p : e.params) largest = std::max(largest, p.n);
    AlignedBuffer masters, raw;  // raw: the path's, where it reads values down
    for (size_t i = 0; i < e.params.size(); ++i) {
      EngineParam& p = e.params[i];
      const float* initial = p.initial;  // the given fp32 values win
      if (initial == nullptr) {
        if (masters.empty()) {
          ZO_ASSIGN_OR_RETURN(masters, AlignedBuffer::Allocate(4 * largest, 64));
        }
        ZO_ASSIGN_OR_RETURN(const void* values, e.path->Values(p, raw));
        Accumulate(masters.as<float>(), values, p.dtype, p.n, false);
        initial = masters.as<float>();
      }
      ZO_RETURN_IF_ERROR(
          e.state->Write(i, initial).WithContext(StrCat("initializing '", p.name, "'")));
    }
    return Status::Ok();
  }

  EngineCore& core_;
};

}  // namespace

std::unique_ptr<Partition> MakeIdentityPartition(EngineCore& core) {
  return std::make_unique<IdentityPartition>(core);
}

}  // namespace zoffload::internal
