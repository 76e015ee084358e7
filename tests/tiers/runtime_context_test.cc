#include "tiers/runtime_context.h"

#include <gtest/gtest.h>

#include "test_util.h"
#include "tiers/optimizer_state.h"
#include "zoffload/tensor_store.h"

namespace zoffload::internal {
namespace {

using testing::TempDir;

TEST(RuntimeOptions, FollowTheConfig) {
  auto striped = ParseConfig(R"({"zero_optimization": {"stage": 2, "offload_optimizer":
      {"device": "nvme", "nvme_path": "/single", "pin_memory": true}},
      "zoffload": {"nvme_paths": ["/a", "/b"], "budgets": {"host_bytes": 1048576,
      "gpu_bytes": 2097152}, "trace_path": "t.json"},
      "aio": {"block_size": 2097152, "queue_depth": 16}})");
  ASSERT_TRUE(striped.ok()) << striped.status();
  const RuntimeOptions o = RuntimeOptions::FromConfig(*striped);
  EXPECT_EQ(o.nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(o.aio.block_size, 2097152);
  EXPECT_EQ(o.aio.queue_depth, 16);
  EXPECT_EQ(o.host_budget_bytes, 1048576u);
  EXPECT_EQ(o.gpu_budget_bytes, 2097152u);
  EXPECT_TRUE(o.pin_host);
  EXPECT_EQ(o.trace_path, "t.json");
  auto single = ParseConfig(R"({"zero_optimization": {"stage": 2, "offload_optimizer":
      {"device": "nvme", "nvme_path": "/single"}}})");
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(RuntimeOptions::FromConfig(*single).nvme_paths, std::vector<std::string>{"/single"});
  EXPECT_TRUE(RuntimeOptions::FromConfig(Config{}).nvme_paths.empty());
}

TEST(ByteBudget, RefusesWhatDoesNotFitAndNamesIt) {
  ByteBudget budget("host budget (zoffload.budgets.host_bytes)", 1000);
  ASSERT_TRUE(budget.Reserve(600, "a").ok());
  EXPECT_TRUE(budget.Fits(400));
  EXPECT_FALSE(budget.Fits(401));
  const Status s = budget.Reserve(401, "tensor 'b'");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("host budget (zoffload.budgets.host_bytes)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("tensor 'b'"), std::string::npos) << s;
  budget.Release(600);
  EXPECT_EQ(budget.used(), 0u);
  ByteBudget none("x", 0);
  EXPECT_TRUE(none.Reserve(uint64_t{1} << 50, "big").ok());
}

// One context, one swap space and one host budget: a TensorStore and an OptimizerState made
// in the same context share both, and their host memory counts against the same budget.
TEST(RuntimeContext, PartsShareOneSwapSpaceAndOneBudget) {
  TempDir dir;
  RuntimeOptions ro;
  ro.nvme_paths = {dir.path()};
  ro.aio.block_size = 64 << 10;
  ro.host_budget_bytes = 8 << 20;
  ro.pin_host = false;
  auto context = RuntimeContext::Create(ro);
  ASSERT_TRUE(context.ok()) << context.status();
  auto store = TensorStore::Open(**context);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Register("w", DType::kFp32, 1 << 18, Tier::kNvme).ok());
  OptimizerStateOptions so;
  so.home = StateHome::kNvme;
  so.pipeline.chunk_elements = 1 << 16;
  so.pipeline.buffers = 2;
  so.threads = 1;
  auto state = OptimizerState::Create({{"p", 100000}}, **context, so);
  ASSERT_TRUE(state.ok()) << state.status();
  auto swap = internal::RuntimeAccess::Of(**context).Swap();
  ASSERT_TRUE(swap.ok());
  EXPECT_EQ(*swap, (*state)->swap());
  EXPECT_TRUE((*swap)->Contains("w"));    // both parts' tensors in the one manifest
  EXPECT_EQ((*swap)->Keys().size(), 3u);  // "w" and the state's two copies
  EXPECT_EQ((*context)->stats().host_bytes, (*state)->host_bytes());
  {
    auto lease = (*store)->Acquire("w", Access::kWrite).Get();  // 1 MiB of NVMe cache
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ((*context)->stats().host_bytes, (*state)->host_bytes() + (1 << 20));
  }
  // Host state that cannot fit the budget left over is refused, naming the budget.
  OptimizerStateOptions host;
  host.threads = 1;
  auto big = OptimizerState::Create({{"big", 1 << 20}}, **context, host);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("zoffload.budgets.host_bytes"), std::string::npos)
      << big.status();
  EXPECT_NE(big.status().message().find("'big'"), std::string::npos) << big.status();
}

TEST(RuntimeContext, NoNvmeDirectoryIsAClearError) {
  auto context = RuntimeContext::Create({});
  ASSERT_TRUE(context.ok());
  auto swap = internal::RuntimeAccess::Of(**context).Swap();
  EXPECT_EQ(swap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(swap.status().message().find("zoffload.nvme_paths"), std::string::npos);
}

}  // namespace
}  // namespace zoffload::internal
