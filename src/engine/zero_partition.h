// The ZeRO Partition (partition.h) of one rank: a BucketPlan's slices, reduce-scatter and
// all-gather over a Communicator (src/zero), the exact norm over every rank. What it does is
// documented with ZeroOptimizer (zero_optimizer.h), the core's face for it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_core.h"
#include "engine/partition.h"
#include "tiers/optimizer_state.h"
#include "zero/bucket_plan.h"
#include "zero/communicator.h"
#include "zoffload/tensor_store.h"
#include "zoffload/zero.h"

namespace zoffload::internal::zero {

// An owned span's parameter values in host memory: in the partition, or leased from the store
// (offload_param nvme; held until this is destroyed).
struct SpanValues {
  std::byte* data = nullptr;
  Lease lease;
};

class ZeroPartition final : public Partition {
 public:
  ZeroPartition(EngineCore& core, Communicator& comm) : core_(core), comm_(comm) {}
  ~ZeroPartition() override;
  // Checks what ZeRO needs (a stage, overlap "none", one dtype) and plans the buckets in
  // `options.order`.
  Status Plan(const ZeroOptions& options, uint64_t align);

  Status CreateState(RuntimeContext& context, const OptimizerStateOptions& options) override;
  Status Initialize() override;
  bool TakesExtras() const override { return false; }
  bool UpdatesOnLanding() const override { return false; }
  Status Take(size_t i, const void* grad, bool add, bool last, void* stream) override;
  void* InPlaceBuffer(EngineParam& p) override;
  Result<std::optional<GradNorm>> Norm(bool now) override;
  std::vector<TensorGrads> Grads(const std::vector<AdamHyper>& hypers) override;
  ParamSink* Sink() override;
  Status Finish(bool skipped) override;
  Status Save(const std::string& dir) override;
  Status Load(const std::string& dir) override;
  uint64_t host_bytes() const override;
  const char* step_track() const override { return "zero"; }

  Status GatherParameter(EngineParam& p, void* out);
  Status GatherMaster(const EngineParam& p, float* out);
  int stage() const { return stage_; }
  uint64_t partition_elements() const { return plan_.partition_elements(); }
  uint64_t owned_elements() const;

 private:
  // Where a parameter's elements lie: spans of the plan's buckets, in element order, and its
  // spans of this rank's partition (indices into owned_).
  struct Places {
    std::vector<std::pair<size_t, BucketPlan::Span>> places;  // (bucket, span)
    std::vector<size_t> owned;
  };
  Places& InfoOf(const EngineParam& p) { return info_[core_.IndexOf(p)]; }
  // One rank, one micro-batch, stages 2-3: the partition's gradients are the given ones, in
  // their dtype (no sums).
  bool GradientsAsGiven() const {
    return comm_.world() == 1 && core_.accumulation == 1 && stage_ >= 2 && grad_dtype_ == dtype_;
  }
  // Where parameter p's gradient can be written in place (GradientBuffer), or null.
  std::byte* InPlace(const EngineParam& p);
  uint64_t bytes_per_element() const;
  // GatherParameter's work, untimed.
  Status GatherPieces(EngineParam* p, void* out);
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
  // Every rank's fp32 masters of bucket b into `master` (its padded elements) and, unless null,
  // the moments into `m` and `v` (fp32 or bf16 state: per element).
  Status GatherBucketState(size_t b, std::vector<float>& master, std::vector<std::byte>* m,
                           std::vector<std::byte>* v);
  // Whether every rank's `outcome` is OK: the first failure (by rank) otherwise, the same on
  // every rank (collective).
  Status Agree(const Status& outcome, std::string_view what);
  Status AllGatherParameters();

  EngineCore& core_;
  Communicator& comm_;
  int stage_ = 1;
  DType dtype_ = DType::kBf16;
  std::vector<Places> info_;  // per parameter
  BucketPlan plan_;
  std::vector<uint64_t> bucket_offset_;  // bucket b's slice in a partition (elements)
  std::vector<uint64_t> full_offset_;    // stage 1: bucket b in the full gradient buffer
  std::vector<BucketPlan::Span> owned_;  // this rank's tensor elements, partition order
  std::vector<std::vector<size_t>> owned_in_bucket_;  // indices into owned_, per bucket
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
  std::vector<float> reduced_;       // a reduced slice before it is added (micro-batch > 0)
  std::unique_ptr<ParamSink> sink_;  // the step's (Sink)
};

}  // namespace zoffload::internal::zero
