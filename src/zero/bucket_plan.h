// BucketPlan: how ZeRO stages 1-3 split the parameters' elements among N ranks (src/zero/).
//
// The tensors are laid end to end in the order their gradients arrive (backward order), then
// cut into buckets of at most `bucket_elements` (reduce_bucket_size; a tensor may straddle
// buckets). Each bucket is padded to a multiple of N x `align` and split into N equal slices:
// rank r owns slice r of every bucket. So every bucket is one reduce-scatter (and one
// all-gather) with equal counts, a rank's partition is its slices end to end (the same size on
// every rank), and uneven cases — tensors that do not divide by N, more ranks than tensors,
// buckets smaller than N — only add padding, never a special path. The plan is a pure function
// of the sizes, the order, N and the bucket size: every rank computes the same one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal::zero {

class BucketPlan {
 public:
  /// Elements [first, first + n) of tensor `tensor`, at `offset` in the containing range (a
  /// bucket, or a rank's partition).
  struct Span {
    size_t tensor = 0;
    uint64_t first = 0, n = 0;
    uint64_t offset = 0;
    bool operator==(const Span&) const = default;
  };
  struct Bucket {
    std::vector<Span> spans;  ///< in the bucket's order; offsets within the bucket
    uint64_t elements = 0;    ///< tensor elements in it
    uint64_t padded = 0;      ///< elements with padding: a multiple of world x align
  };

  /// `sizes[t]`: tensor t's elements (each > 0); `order`: every tensor index once, in the order
  /// gradients arrive; world >= 1; bucket_elements >= 1; align >= 1 (elements).
  static Result<BucketPlan> Create(std::span<const uint64_t> sizes, std::span<const size_t> order,
                                   int world, uint64_t bucket_elements, uint64_t align);

  int world() const { return world_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// Each rank's slice of bucket b (elements; the same for every rank).
  uint64_t slice(size_t b) const { return buckets_[b].padded / static_cast<uint64_t>(world_); }
  /// A rank's partition: its slices of every bucket end to end (the same size on every rank).
  uint64_t partition_elements() const { return partition_elements_; }
  /// The tensor elements rank `rank` owns (padding left out), in partition order; offsets
  /// within its partition.
  std::vector<Span> Owned(int rank) const;

 private:
  int world_ = 1;
  std::vector<Bucket> buckets_;
  uint64_t partition_elements_ = 0;
};

}  // namespace zoffload::internal::zero
