// BucketPlan: buckets and each rank's slices computed by hand for small uneven cases, and on
// random sizes every element owned by exactly one rank, once, with equal partitions.
#include "zero/bucket_plan.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "common/strings.h"

namespace zoffload::internal::zero {
namespace {

using Span = BucketPlan::Span;

// Tensors of 10, 3 and 7 elements, gradients arriving in backward order (2, 1, 0), buckets of
// 8: [t2 0..7, t1 0..1], [t1 1..3, t0 0..6], [t0 6..10].
TEST(BucketPlanTest, UnevenTensorsByHand) {
  const std::vector<uint64_t> sizes = {10, 3, 7};
  const std::vector<size_t> order = {2, 1, 0};
  auto plan = BucketPlan::Create(sizes, order, /*world=*/4, /*bucket_elements=*/8, /*align=*/1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->buckets().size(), 3u);
  EXPECT_EQ(plan->buckets()[0].spans, (std::vector<Span>{{2, 0, 7, 0}, {1, 0, 1, 7}}));
  EXPECT_EQ(plan->buckets()[1].spans, (std::vector<Span>{{1, 1, 2, 0}, {0, 0, 6, 2}}));
  EXPECT_EQ(plan->buckets()[2].spans, (std::vector<Span>{{0, 6, 4, 0}}));
  // Padded to multiples of 4: slices of 2, 2 and 1; a partition of 5 on every rank.
  EXPECT_EQ(plan->buckets()[2].padded, 4u);
  EXPECT_EQ(plan->slice(0), 2u);
  EXPECT_EQ(plan->slice(2), 1u);
  EXPECT_EQ(plan->partition_elements(), 5u);
  // Rank 0: bucket 0 [0, 2) = t2[0, 2); bucket 1 [0, 2) = t1[1, 3); bucket 2 [0, 1) = t0[6, 7).
  EXPECT_EQ(plan->Owned(0), (std::vector<Span>{{2, 0, 2, 0}, {1, 1, 2, 2}, {0, 6, 1, 4}}));
  // Rank 3: bucket 0 [6, 8) = t2[6, 7) + t1[0, 1); bucket 1 [6, 8) = t0[4, 6);
  // bucket 2 [3, 4) = t0[9, 10).
  EXPECT_EQ(plan->Owned(3),
            (std::vector<Span>{{2, 6, 1, 0}, {1, 0, 1, 1}, {0, 4, 2, 2}, {0, 9, 1, 4}}));
}

// More ranks than tensors and than a bucket's elements: the rest is padding.
TEST(BucketPlanTest, MoreRanksThanTensors) {
  const std::vector<uint64_t> sizes = {3, 2};
  const std::vector<size_t> order = {1, 0};
  auto plan = BucketPlan::Create(sizes, order, /*world=*/8, /*bucket_elements=*/100, /*align=*/1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->buckets().size(), 1u);
  EXPECT_EQ(plan->buckets()[0].elements, 5u);
  EXPECT_EQ(plan->buckets()[0].padded, 8u);
  EXPECT_EQ(plan->partition_elements(), 1u);
  EXPECT_EQ(plan->Owned(0), (std::vector<Span>{{1, 0, 1, 0}}));
  EXPECT_EQ(plan->Owned(4), (std::vector<Span>{{0, 2, 1, 0}}));
  EXPECT_TRUE(plan->Owned(5).empty());  // padding only
  EXPECT_TRUE(plan->Owned(7).empty());
}

// Alignment: each slice a multiple of `align` elements (here 4 ranks x 16).
TEST(BucketPlanTest, SlicesAreAligned) {
  const std::vector<uint64_t> sizes = {100};
  const std::vector<size_t> order = {0};
  auto plan = BucketPlan::Create(sizes, order, 4, 1000, 16);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->buckets()[0].padded, 128u);
  EXPECT_EQ(plan->slice(0), 32u);
  EXPECT_EQ(plan->Owned(3), (std::vector<Span>{{0, 96, 4, 0}}));
}

// Random sizes, orders, world sizes 1-8 and bucket sizes: every element of every tensor is
// owned once, by the rank whose slice holds it; partitions are equal and filled in order.
TEST(BucketPlanTest, EveryElementOwnedOnce) {
  std::mt19937_64 rng(20261204);
  for (int round = 0; round < 200; ++round) {
    const size_t tensors = 1 + rng() % 12;
    std::vector<uint64_t> sizes(tensors);
    for (auto& s : sizes) s = 1 + rng() % 300;
    std::vector<size_t> order(tensors);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const int world = 1 + static_cast<int>(rng() % 8);
    const uint64_t bucket = 1 + rng() % 500, align = 1 + rng() % 8;
    SCOPED_TRACE(
        StrCat("round ", round, ": world ", world, ", bucket ", bucket, ", align ", align));
    auto plan = BucketPlan::Create(sizes, order, world, bucket, align);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<std::vector<int>> owner(tensors);
    for (size_t t = 0; t < tensors; ++t) owner[t].assign(sizes[t], -1);
    for (int r = 0; r < world; ++r) {
      uint64_t next = 0;  // spans come in partition order without overlap
      for (const Span& s : plan->Owned(r)) {
        ASSERT_GE(s.offset, next);
        next = s.offset + s.n;
        ASSERT_LE(next, plan->partition_elements());
        for (uint64_t i = s.first; i < s.first + s.n; ++i) {
          ASSERT_EQ(owner[s.tensor][i], -1) << "tensor " << s.tensor << " element " << i;
          owner[s.tensor][i] = r;
        }
      }
    }
    for (size_t t = 0; t < tensors; ++t) {
      for (uint64_t i = 0; i < sizes[t]; ++i) ASSERT_NE(owner[t][i], -1) << t << " " << i;
    }
    uint64_t padded = 0;
    for (size_t b = 0; b < plan->buckets().size(); ++b) {
      const auto& bk = plan->buckets()[b];
      EXPECT_LE(bk.elements, bucket);
      EXPECT_EQ(bk.padded % (static_cast<uint64_t>(world) * align), 0u);
      EXPECT_LT(bk.padded - bk.elements, static_cast<uint64_t>(world) * align);
      padded += bk.padded;
    }
    EXPECT_EQ(plan->partition_elements() * static_cast<uint64_t>(world), padded);
  }
}

TEST(BucketPlanTest, BadInputIsAClearError) {
  const std::vector<uint64_t> sizes = {4, 4};
  EXPECT_EQ(BucketPlan::Create(sizes, std::vector<size_t>{0}, 2, 8, 1).status().code(),
            StatusCode::kInvalidArgument);
  auto twice = BucketPlan::Create(sizes, std::vector<size_t>{1, 1}, 2, 8, 1);
  EXPECT_NE(twice.status().message().find("tensor 1 is named twice"), std::string::npos)
      << twice.status();
  EXPECT_FALSE(BucketPlan::Create(sizes, std::vector<size_t>{0, 1}, 0, 8, 1).ok());
  const std::vector<uint64_t> empty = {4, 0};
  auto zero = BucketPlan::Create(empty, std::vector<size_t>{0, 1}, 2, 8, 1);
  EXPECT_NE(zero.status().message().find("tensor 1 has no elements"), std::string::npos)
      << zero.status();
}

}  // namespace
}  // namespace zoffload::internal::zero
