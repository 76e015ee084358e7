// ZeroRank::FromEnvironment: what a launcher sets (RANK, WORLD_SIZE, ZOFFLOAD_RUN_ID, or
// torchrun's TORCHELASTIC_RUN_ID and MASTER_PORT; LOCAL_RANK, ZOFFLOAD_NCCL_ID), and clear
// errors naming the variable. The public ZeroOptimizer over NCCL (gpu-labelled): one rank equals
// one rank over host shared memory, bit for bit.
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "build_info.h"
#include "common/strings.h"
#include "test_util.h"
#include "zero/ranks.h"
#include "zoffload/zero.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace zoffload {
namespace {

void Set(const char* name, const char* value) {
  if (value == nullptr) {
    ::unsetenv(name);
  } else {
    ::setenv(name, value, 1);
  }
}

Result<ZeroRank> With(const char* rank, const char* world, const char* run,
                      const char* elastic = nullptr, const char* port = nullptr) {
  Set("RANK", rank);
  Set("WORLD_SIZE", world);
  Set("ZOFFLOAD_RUN_ID", run);
  Set("TORCHELASTIC_RUN_ID", elastic);
  Set("MASTER_PORT", port);
  return ZeroRank::FromEnvironment();
}

TEST(ZeroRankTest, FromEnvironment) {
  auto r = With(nullptr, nullptr, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 0);
  EXPECT_EQ(r->world, 1);
  EXPECT_EQ(r->run, internal::StrCat("single-", ::getpid()));
  r = With("2", "4", "job-7.a");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 2);
  EXPECT_EQ(r->world, 4);
  EXPECT_EQ(r->run, "job-7.a");
  r = With("1", "2", nullptr, "abc", "29500");  // torchrun's
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->run, "abc-29500");
  EXPECT_TRUE(r->nccl_id.empty());
  EXPECT_EQ(r->device, 0);
  Set("LOCAL_RANK", "3");
  Set("ZOFFLOAD_NCCL_ID", "00ff");
  r = With("1", "2", "x");
  Set("LOCAL_RANK", nullptr);
  Set("ZOFFLOAD_NCCL_ID", nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device, 3);
  EXPECT_EQ(r->nccl_id, "00ff");
}

TEST(ZeroRankTest, BadEnvironmentIsAClearError) {
  struct Bad {
    const char *rank, *world, *run, *names;
  };
  for (const Bad& b :
       {Bad{"4", "4", "x", "RANK is '4'"}, Bad{"-1", "4", "x", "RANK is '-1'"},
        Bad{"0", "many", "x", "WORLD_SIZE is 'many'"}, Bad{"0", "0", "x", "WORLD_SIZE is '0'"},
        Bad{"1", "2", nullptr, "set ZOFFLOAD_RUN_ID"},
        Bad{"0", "2", "a/b", "from ZOFFLOAD_RUN_ID is 'a/b'"}}) {
    auto r = With(b.rank, b.world, b.run);
    ASSERT_FALSE(r.ok()) << b.names;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(b.names), std::string::npos) << r.status();
  }
  ZeroRank bad;
  bad.run = "has space";
  auto config = ParseConfig(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(config.ok());
  float w[4] = {};
  auto z = ZeroOptimizer::Create(*config, {{"w", w, 4, DType::kFp32}}, bad);
  EXPECT_EQ(z.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(z.status().message().find("'has space'"), std::string::npos) << z.status();
  Set("LOCAL_RANK", "gpu0");
  auto r = With("0", "1", "x");
  Set("LOCAL_RANK", nullptr);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("LOCAL_RANK is 'gpu0'"), std::string::npos) << r.status();
  // A malformed NCCL id is refused before any GPU is touched, naming where it comes from.
  ZeroRank nccl;
  nccl.run = "x";
  nccl.nccl_id = "not-hex";
  z = ZeroOptimizer::Create(*config, {{"w", w, 4, DType::kFp32}}, nccl);
#if ZO_HAVE_CUDA
  EXPECT_EQ(z.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(z.status().message().find("ZOFFLOAD_NCCL_ID"), std::string::npos) << z.status();
#else
  EXPECT_EQ(z.status().code(), StatusCode::kUnimplemented) << z.status();
#endif
}

// The C++ optimizer waits for the other ranks as long as the config's
// zoffload.comm_timeout_seconds says (as Python's does), not a fixed 300 s.
TEST(ZeroRankTest, TheConfigsCommTimeoutBoundsTheWait) {
  auto config = ParseConfig(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}}, "zoffload": {"comm_timeout_seconds": 0.5}})");
  ASSERT_TRUE(config.ok()) << config.status();
  ZeroRank alone;
  alone.rank = 1;
  alone.world = 2;
  alone.run = internal::StrCat("timeout-", ::getpid());
  float w[4] = {};
  const auto start = std::chrono::steady_clock::now();
  auto z = ZeroOptimizer::Create(*config, {{"w", w, 4, DType::kFp32}}, alone);
  EXPECT_EQ(z.status().code(), StatusCode::kUnavailable) << z.status();
  EXPECT_NE(z.status().message().find("within 500 ms"), std::string::npos) << z.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// One rank of the public ZeroOptimizer over NCCL (rank 0 of 1 on GPU 0) against the same over
// host shared memory: 10 steps of y = w x at stage 3, the same parameters bit for bit. In child
// processes: this one never starts CUDA (the GPU count too is taken in a child).
TEST(ZeroNcclTest, PublicOptimizerOverNcclEqualsHostBackend) {
  using internal::zero::testing::RunRanks;
#if ZO_HAVE_CUDA
  const int gpus = RunRanks(1, [](int) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? std::min(n, 100) : 0;
  })[0];
#else
  const int gpus = 0;
#endif
  if (gpus < 1) GTEST_SKIP() << "needs a GPU (NCCL), none usable here";
  auto train = [](bool nccl) {
    auto config = ParseConfig(R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 8,
        "offload_optimizer": {"device": "cpu"}}, "zoffload": {"cpu_adam_threads": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}})");
    if (!config.ok()) return std::vector<float>{};
    std::vector<float> w(13);
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * static_cast<float>(i) - 0.5f;
    ZeroRank me;
    me.run = internal::StrCat("nccl-test-", ::getpid());
    if (nccl) {
      auto id = ZeroRank::NewNcclId();
      if (!id.ok()) return std::vector<float>{};
      me.nccl_id = *id;
    }
    auto z = ZeroOptimizer::Create(*config, {{"w", w.data(), w.size(), DType::kFp32}}, me);
    if (!z.ok()) return std::vector<float>{};
    std::vector<float> now(w.size()), grad(w.size());
    for (int step = 0; step < 10; ++step) {
      if (!(*z)->GatherParameter("w", now.data()).ok()) return std::vector<float>{};
      for (size_t i = 0; i < w.size(); ++i) grad[i] = now[i] - 0.01f * static_cast<float>(step);
      if (!(*z)->GradientReady("w", grad.data(), grad.size(), DType::kFp32).ok() ||
          !(*z)->Step().ok()) {
        return std::vector<float>{};
      }
    }
    if (!(*z)->GatherParameter("w", now.data()).ok()) return std::vector<float>{};
    return now;
  };
  std::vector<float> results[2];
  for (int nccl = 0; nccl < 2; ++nccl) {
    internal::testing::TempDir dir;
    const std::string out = dir.File("w");
    ASSERT_EQ(RunRanks(1,
                       [&](int) {
                         const std::vector<float> w = train(nccl == 1);
                         if (w.empty()) return 1;
                         FILE* f = std::fopen(out.c_str(), "wb");
                         const bool ok =
                             f != nullptr && std::fwrite(w.data(), 4, w.size(), f) == w.size();
                         if (f != nullptr) std::fclose(f);
                         return ok ? 0 : 2;
                       }),
              std::vector<int>{0})
        << (nccl ? "over NCCL" : "over host memory");
    results[nccl].resize(13);
    FILE* f = std::fopen(out.c_str(), "rb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fread(results[nccl].data(), 4, 13, f), 13u);
    std::fclose(f);
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_NE(results[0][3], 0.1f * 3 - 0.5f);  // it trained
}

}  // namespace
}  // namespace zoffload
