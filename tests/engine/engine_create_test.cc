// OffloadEngine::Create applies the parser's rules to a Config built in code: every value that
// ParseConfig refuses, Create refuses with the same message (a caller cannot get past the
// rules by skipping the parser), in host mode and with the parameters in GPU memory.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/bad_configs.h"
#include "test_util.h"
#include "zoffload/config.h"
#include "zoffload/engine.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu/gpu_info.h"
#endif

namespace zoffload {
namespace {

constexpr uint64_t kElements = 64;

Config ValidConfig() {
  auto config = ParseConfig(R"({"bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// Each bad config: the parser's error, then Create's (which must name the same key and hold
// the parser's message).
void ExpectCreateRefusesWhatTheParserRefuses(void* data, EngineOptions options) {
  const ParameterSpec spec{"w", data, kElements, DType::kBf16};
  ASSERT_TRUE(OffloadEngine::Create(ValidConfig(), {spec}, options).ok());
  for (const testing::BadConfig& bad : testing::BadConfigs()) {
    SCOPED_TRACE(bad.key);
    Config config = ValidConfig();
    bad.change(config);
    std::string parsed;
    if (bad.json) {
      ParseOptions quiet;
      quiet.warn_unused = false;
      auto reparsed = ParseConfig(SerializeConfig(config), quiet);
      ASSERT_FALSE(reparsed.ok()) << "the parser takes it";
      parsed = std::string(reparsed.status().message());
      EXPECT_NE(parsed.find(bad.key), std::string::npos) << parsed;
    }
    auto engine = OffloadEngine::Create(config, {spec}, options);
    ASSERT_FALSE(engine.ok()) << "Create takes it";
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument) << engine.status();
    const std::string created(engine.status().message());
    EXPECT_NE(created.find(bad.key), std::string::npos) << created;
    if (bad.json) {
      EXPECT_NE(created.find(parsed), std::string::npos) << created;
    }
  }
}

TEST(EngineCreate, RefusesEveryValueTheParserRefuses) {
  std::vector<uint16_t> values(kElements, 0x3F80);  // bf16 1.0
  EngineOptions options;
  options.host_params = true;
  ExpectCreateRefusesWhatTheParserRefuses(values.data(), options);
}

// A Config built in code names its swap directory in any spelling: Create keeps the parser's
// (normalized), so a swap space made under "DIR" reopens under "DIR/" or "DIR//.", and the
// reverse.
TEST(EngineCreate, SwapDirectoriesAreTheParsersSpelling) {
  internal::testing::TempDir dir;
  std::vector<uint16_t> values(kElements, 0x3F80);
  EngineOptions options;
  options.host_params = true;
  for (const std::string& spelling :
       {dir.path(), dir.path() + "/", dir.path() + "//.", dir.path()}) {
    SCOPED_TRACE(spelling);
    Config config = ValidConfig();
    config.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
    config.zoffload.nvme_paths = {spelling};
    auto engine =
        OffloadEngine::Create(config, {{"w", values.data(), kElements, DType::kBf16}}, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
  }
}

#if ZO_HAVE_CUDA
// With a GPU: a reduce_bucket_size of 0 once made a 0-byte gradient ring, and the first
// gradient then never finished going down. Every refused value is refused here as well.
TEST(EngineGpuCreate, RefusesEveryValueTheParserRefuses) {
  if (auto n = internal::UsableGpuCount(); !n.ok()) GTEST_SKIP() << n.status().message();
  void* data = nullptr;
  ASSERT_EQ(cudaMalloc(&data, kElements * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(data, 0, kElements * 2), cudaSuccess);
  EngineOptions options;
  options.require_gpu = true;
  ExpectCreateRefusesWhatTheParserRefuses(data, options);
  EXPECT_EQ(cudaFree(data), cudaSuccess);
}
#endif

}  // namespace
}  // namespace zoffload
