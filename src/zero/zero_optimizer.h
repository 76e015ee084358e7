// ZeroOptimizer: one rank's ZeRO stage 1, 2 or 3 (zero_optimization.stage) over a
// Communicator, with the optimizer partition offloaded as offload_optimizer says (host memory
// or NVMe, through OptimizerState) and host parameters — the HostComm backend, real processes
// on one machine.
//
// The plan (BucketPlan) lays the parameters end to end in the order their gradients arrive,
// cuts them into buckets of reduce_bucket_size elements and gives rank r slice r of every
// bucket. Rank r keeps the fp32 masters and Adam moments of its partition only.
// - Stage 1: each rank adds its micro-batches' gradients over all elements (fp32); Step
//   reduce-scatters every bucket, so each rank gets the summed gradients of its partition.
// - Stage 2: a bucket is reduce-scattered as soon as its last gradient of the micro-batch has
//   arrived (during backward); a rank keeps fp32 sums of its partition only, and a bucket's
//   buffer only until then.
// - Stage 3: as stage 2, and a rank keeps only its partition of the parameters too:
//   GatherParameter all-gathers a parameter's pieces from the ranks that own them into the
//   caller's memory (forward and backward pre-hooks gather, post-hooks drop it). With
//   offload_param "nvme" the partition's values live in a TensorStore on NVMe, one tensor per
//   owned span, cached in at most offload_param.max_in_cpu elements of host memory; from the
//   second step each gather starts the reads of the next parameters of the previous step's
//   order (up to stage3_prefetch_bucket_size elements ahead).
// Step: the gradient norm is exact over every partition (ExactSquares, combined as integers),
// hence the same at every world size; then inf/NaN skip (fp16 loss scale), clipping and the
// update of this rank's partition, and at stages 1 and 2 the all-gather of the new values into
// every rank's full parameters.
//
// Determinism: sums over ranks run in rank order from rank 0's value, sums over micro-batches
// in micro-batch order. With one micro-batch per rank, world size N gives the bits of world
// size 1 taking the same N micro-batches as N accumulation steps, at every stage. (With several
// micro-batches per rank, stage 1 adds each rank's micro-batches first and stages 2 and 3 each
// micro-batch's ranks first: the same sums in another order.)
//
// Collectives: every rank must make the same GradientReady, Step, GatherParameter and
// GatherMaster calls in the same order (the same model, the same backward order). A rank that
// dies makes the others' next collective fail within the communicator's timeout, naming it.
//
// Thread-safety: one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/loss_scaler.h"
#include "tiers/optimizer_state.h"
#include "tiers/runtime_context.h"
#include "zero/bucket_plan.h"
#include "zero/communicator.h"
#include "zoffload/config.h"
#include "zoffload/engine.h"
#include "zoffload/runtime.h"
#include "zoffload/status.h"
#include "zoffload/tensor_store.h"
#include "zoffload/zero.h"

namespace zoffload::internal::zero {

// An owned span's parameter values in host memory: in the partition, or leased from the store
// (offload_param nvme; held until this is destroyed).
struct SpanValues {
  std::byte* data = nullptr;
  Lease lease;
};

class ZeroOptimizer {
 public:
  // The calls are zoffload::ZeroOptimizer's (include/zoffload/zero.h, which holds this with a
  // HostComm) and documented there; this one runs over any Communicator. `align`: each rank's
  // slice of a bucket is a multiple of this many elements (16: 64 bytes of fp32).
  static Result<std::unique_ptr<ZeroOptimizer>> Create(const Config& config,
                                                       std::vector<ParameterSpec> params,
                                                       Communicator& comm, ZeroOptions options = {},
                                                       uint64_t align = 16);
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // Stages 2 and 3 reduce-scatter a bucket here when its last gradient arrives.
  Status GradientReady(std::string_view name, const void* grad, uint64_t elements, DType dtype);
  Result<void*> GradientBuffer(std::string_view name);
  Result<EngineStepStats> Step();
  Status GatherParameter(std::string_view name, void* out);
  Status GatherMaster(std::string_view name, float* out);
  // Save: the ranks gather the state bucket by bucket (in the plan's order, so each once) and
  // rank 0 writes it; after a write error rank 0 still takes its part in the gathers, and every
  // rank returns the failure. Load: every rank checks everything, the ranks agree, then each
  // writes its partition (a damaged checkpoint changes nothing on any rank).
  Status Save(const std::string& dir);
  Status Load(const std::string& dir);
  Status SetGroup(int index, const ParamGroup& group);
  int group_count() const { return static_cast<int>(groups_.size()); }
  const ParamGroup& group(int index) const { return groups_[static_cast<size_t>(index)]; }

  int stage() const { return stage_; }
  float loss_scale() const { return scaler_.scale(); }
  int64_t steps() const { return steps_; }
  uint64_t partition_elements() const { return plan_.partition_elements(); }
  uint64_t owned_elements() const;

 private:
  struct Param {
    std::string name;
    uint64_t n = 0;
    void* data = nullptr;  // stages 1 and 2: the whole parameter
    int group = 0;
    int received = 0;  // gradients in this accumulation window
    // Where its elements lie: spans of the plan's buckets, in element order.
    std::vector<std::pair<size_t, BucketPlan::Span>> places;  // (bucket, span)
    std::vector<size_t> owned;  // its spans of this rank's partition (indices into owned_)
    DType dtype = DType::kBf16;
    std::vector<uint64_t> shape;
  };
  ZeroOptimizer(const Config& config, Communicator& comm) : config_(config), comm_(comm) {}
  Result<Param*> Find(std::string_view name, std::string_view call);
  // One rank, one micro-batch, stages 2-3: the partition's gradients are the given ones, in
  // their dtype (no sums).
  bool GradientsAsGiven() const {
    return comm_.world() == 1 && accumulation_ == 1 && stage_ >= 2 && grad_dtype_ == dtype_;
  }
  // Where parameter p's gradient can be written in place (GradientBuffer), or null.
  std::byte* InPlace(const Param& p);
  uint64_t bytes_per_element() const;
  // GatherParameter's work, untimed.
  Status GatherPieces(Param* p, void* out);
  // Every rank's slices of bucket b of its values into `out` (stages 1 and 2).
  Status GatherBucket(size_t b, std::byte* out);
  // Owned span k's values, to read or (kWrite) to overwrite.
  Result<SpanValues> OwnedValues(size_t k, Access access);
  // Stage 3 with the values in the store: parameter `t`'s gather is the next of this step;
  // while the order is the last step's, starts the reads of the parameters that follow.
  void ReadAhead(size_t t);
  // Starts the reads of the last step's gathers from position `next` on, up to the read-ahead
  // window (at least one parameter's).
  void ReadFrom(size_t next);
  Status ReduceBucket(size_t b, int micro);
  Status BetweenSteps(std::string_view what) const;
  // Every rank's fp32 masters of bucket b into `master` (its padded elements) and, unless null,
  // the moments into `m` and `v` (fp32 or bf16 state: per element).
  Status GatherBucketState(size_t b, std::vector<float>& master, std::vector<std::byte>* m,
                           std::vector<std::byte>* v);
  // Whether every rank's `outcome` is OK: the first failure (by rank) otherwise, the same on
  // every rank (collective).
  Status Agree(const Status& outcome, std::string_view what);
  Status AllGatherParameters();

  Config config_;
  Communicator& comm_;
  int stage_ = 1;
  int accumulation_ = 1;
  DType dtype_ = DType::kBf16;
  std::vector<Param> params_;
  std::map<std::string, size_t, std::less<>> index_;
  std::vector<ParamGroup> groups_;
  LossScaler scaler_{Fp16Config{}};
  int64_t steps_ = 0;
  BucketPlan plan_;
  std::vector<uint64_t> bucket_offset_;  // bucket b's slice in a partition (elements)
  std::vector<uint64_t> full_offset_;    // stage 1: bucket b in the full gradient buffer
  std::vector<BucketPlan::Span> owned_;  // this rank's tensor elements, partition order
  std::vector<std::vector<size_t>> owned_in_bucket_;  // indices into owned_, per bucket
  std::unique_ptr<RuntimeContext> own_context_;
  Runtime* rt_ = nullptr;
  std::unique_ptr<OptimizerState> state_;  // one tensor per owned span; null if none
  // The partition's gradients: fp32 sums, or at one rank with one micro-batch at stages 2-3
  // the fp32 or bf16 gradient as given (grad_dtype_; the sums would hold the same values).
  HostMemory grads_;
  DType grad_dtype_ = DType::kFp32;
  HostMemory values_;  // the partition's parameter values (dtype), unless in the store
  // offload_param nvme: the values, one tensor per owned span (value_keys_[k]), and the
  // parameters gathered in this step and the last, the read-ahead's position in the last.
  std::unique_ptr<TensorStore> store_;
  std::vector<std::string> value_keys_;
  std::vector<size_t> gathered_, last_gathered_;
  size_t ahead_ = 0;
  std::vector<std::byte> scratch_, gathered_values_;  // GatherParameter's buffers
  HostMemory full_grads_;                             // stage 1: every bucket's fp32 sums, padded
  // Stages 2 and 3: the buckets being filled in this micro-batch (fp32, padded), their
  // elements received so far and the micro-batch they belong to.
  struct Filling {
    std::vector<float> sums;
    uint64_t received = 0;
    int micro = 0;
  };
  std::map<size_t, Filling> filling_;
  std::vector<float> reduced_;  // a reduced slice before it is added (micro-batch > 0)
};

}  // namespace zoffload::internal::zero
