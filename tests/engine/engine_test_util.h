// The engine tests' model, gradients, schedule and configs, shared by the test binary and
// the crash test's child process (checkpoint_crash_child).
#pragma once

#include <bit>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "zoffload/config.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/engine.h"

namespace zoffload::internal::testing {

inline constexpr uint64_t kChunk = 4096;  // elements per update chunk: most tensors take several
// Odd sizes: not multiples of a vector, a chunk, an int8 block or the bucket.
inline const std::vector<uint64_t> kSizes = {1, 17, 1000, 4099, 13001, 9};
inline constexpr int kSteps = 20;
inline constexpr int kBucketElements = 3000;

inline uint16_t ToBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
inline float FromBf16(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

inline std::string Name(size_t i) {
  return i % 2 == 0 ? StrCat("layer", i, ".weight") : StrCat("layer", i, ".bias");
}
inline int GroupOf(size_t i) { return static_cast<int>(i % 2); }  // biases: no weight decay

struct Case {
  int accumulation;
  bool clip;
  StatePrecision state;
  const char* home;  // "host", "nvme", "nvme50" (ratio 0.5)
};

inline std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return StrCat("gas", c.accumulation, c.clip ? "_clip_" : "_", ToString(c.state), "_", c.home);
}

inline Config MakeConfig(const Case& c, const std::string& dir) {
  const std::string home = c.home;
  const std::string device = home == "host" ? "cpu" : "nvme";
  const std::string ratio = home == "nvme50" ? "0.5" : "1.0";
  auto config = ParseConfig(StrCat(R"({
    "gradient_accumulation_steps": )",
                                   c.accumulation, R"(,
    "gradient_clipping": )",
                                   c.clip ? "0.5" : "0", R"(,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": )",
                                   kBucketElements, R"(,
      "offload_optimizer": {"device": ")",
                                   device, R"(", "nvme_path": ")", dir, R"(",
                            "ratio": )",
                                   ratio, R"(}},
    "aio": {"block_size": 65536},
    "zoffload": {"optimizer_state": ")",
                                   ToString(c.state), R"(", "cpu_adam_threads": 2,
                 "update_chunk_elements": )",
                                   kChunk, R"(}
  })"));
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// The model: bf16 parameters (host memory here; device memory in the GPU tests), random.
struct Model {
  std::vector<std::vector<uint16_t>> params;
  explicit Model(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint64_t n : kSizes) {
      std::vector<uint16_t> p(n);
      for (uint16_t& x : p) x = ToBf16(normal(rng));
      params.push_back(std::move(p));
    }
  }
  std::vector<ParameterSpec> Specs() {
    std::vector<ParameterSpec> specs;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      specs.push_back({Name(i), params[i].data(), kSizes[i], DType::kBf16, nullptr, GroupOf(i)});
    }
    return specs;
  }
};

// One micro-batch's gradients: bf16, random; scaled up by `scale` (a loss scale).
inline std::vector<std::vector<uint16_t>> Grads(uint32_t seed, float scale = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<std::vector<uint16_t>> grads;
  for (uint64_t n : kSizes) {
    std::vector<uint16_t> g(n);
    for (uint16_t& x : g) x = ToBf16(scale * normal(rng));
    grads.push_back(std::move(g));
  }
  return grads;
}

inline std::vector<ParamGroup> Groups() {
  ParamGroup decay;
  decay.lr = 0.01;
  decay.weight_decay = 0.1;
  ParamGroup no_decay = decay;
  no_decay.weight_decay = 0;
  return {decay, no_decay};
}

// A schedule: falling, and again every 40 steps.
inline double LrAt(int step) { return 0.01 * (1.0 - (step % 40) / 40.0); }

// Step `step` of the schedule in host mode, `accumulation` micro-batches.
inline Status RunStep(OffloadEngine& engine, int step, int accumulation) {
  for (int g = 0; g < 2; ++g) {
    ParamGroup group = Groups()[g];
    group.lr = LrAt(step);
    ZO_RETURN_IF_ERROR(engine.SetGroup(g, group));
  }
  for (int micro = 0; micro < accumulation; ++micro) {
    const auto grads = Grads(1000 * step + micro);
    for (size_t i = kSizes.size(); i-- > 0;) {
      ZO_RETURN_IF_ERROR(engine.GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16));
    }
  }
  return engine.Step().status();
}

// Steps [first, last] of the schedule.
inline void RunSteps(OffloadEngine& engine, int first, int last, int accumulation) {
  for (int step = first; step <= last; ++step) {
    const Status s = RunStep(engine, step, accumulation);
    ASSERT_TRUE(s.ok()) << s;
  }
}

// Every parameter's master, m and v.
inline std::vector<std::vector<std::byte>> AllState(OffloadEngine& engine,
                                                    StatePrecision precision) {
  std::vector<std::vector<std::byte>> out;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const uint64_t mb = AdamMomentBytes(precision, kSizes[i]);
    std::vector<std::byte> all(4 * kSizes[i] + 2 * mb);
    EXPECT_TRUE(engine
                    .ReadState(Name(i), reinterpret_cast<float*>(all.data()),
                               all.data() + 4 * kSizes[i], all.data() + 4 * kSizes[i] + mb)
                    .ok());
    out.push_back(std::move(all));
  }
  return out;
}

inline std::unique_ptr<OffloadEngine> HostEngine(const Case& c, const std::string& dir,
                                                 Model& model) {
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  auto engine = OffloadEngine::Create(MakeConfig(c, dir), model.Specs(), eo);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

}  // namespace zoffload::internal::testing
