#include "zero/bucket_plan.h"

#include <algorithm>

#include "common/strings.h"

namespace zoffload::internal::zero {

Result<BucketPlan> BucketPlan::Create(std::span<const uint64_t> sizes,
                                      std::span<const size_t> order, int world,
                                      uint64_t bucket_elements, uint64_t align) {
  if (world < 1 || bucket_elements == 0 || align == 0) {
    return InvalidArgumentError(StrCat("bucket plan: world size ", world, ", bucket of ",
                                       bucket_elements, " elements and alignment ", align,
                                       " must all be at least 1"));
  }
  if (order.size() != sizes.size()) {
    return InvalidArgumentError(StrCat("bucket plan: the order names ", order.size(),
                                       " tensors; there are ", sizes.size()));
  }
  std::vector<bool> seen(sizes.size(), false);
  for (size_t t : order) {
    if (t >= sizes.size() || seen[t]) {
      return InvalidArgumentError(StrCat("bucket plan: tensor ", t, " is ",
                                         t >= sizes.size() ? "out of range" : "named twice",
                                         " in the order (", sizes.size(), " tensors)"));
    }
    if (sizes[t] == 0) {
      return InvalidArgumentError(StrCat("bucket plan: tensor ", t, " has no elements"));
    }
    seen[t] = true;
  }
  BucketPlan plan;
  plan.world_ = world;
  const uint64_t unit = static_cast<uint64_t>(world) * align;
  Bucket bucket;
  auto close = [&] {
    bucket.padded = (bucket.elements + unit - 1) / unit * unit;
    plan.partition_elements_ += bucket.padded / static_cast<uint64_t>(world);
    plan.buckets_.push_back(std::move(bucket));
    bucket = Bucket{};
  };
  for (size_t t : order) {
    for (uint64_t first = 0; first < sizes[t];) {
      const uint64_t n = std::min(sizes[t] - first, bucket_elements - bucket.elements);
      bucket.spans.push_back({t, first, n, bucket.elements});
      bucket.elements += n;
      first += n;
      if (bucket.elements == bucket_elements) close();
    }
  }
  if (bucket.elements > 0) close();
  return plan;
}

std::vector<BucketPlan::Span> BucketPlan::Owned(int rank) const {
  std::vector<Span> owned;
  uint64_t base = 0;  // the bucket's slice in the rank's partition
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const uint64_t begin = static_cast<uint64_t>(rank) * slice(b), end = begin + slice(b);
    for (const Span& s : buckets_[b].spans) {
      const uint64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.n);
      if (lo < hi)
        owned.push_back({s.tensor, s.first + (lo - s.offset), hi - lo, base + lo - begin});
    }
    base += slice(b);
  }
  return owned;
}

}  // namespace zoffload::internal::zero
