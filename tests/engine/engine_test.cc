#include "zoffload/engine.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "build_info.h"
#include "common/strings.h"
#include "cpu_adam/adam_math.h"
#include "engine/engine_test_util.h"
#include "swap/fault_backend.h"
#include "test_util.h"
#include "tiers/runtime_context.h"
#include "zoffload/cpu_adam.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu/gpu_info.h"
#include "gpu/kernels.h"
#endif

namespace zoffload::internal {
namespace {

using testing::FaultPlan;
using testing::FaultRule;
using testing::InjectFaults;
using testing::TempDir;
using namespace testing;  // NOLINT(google-build-using-namespace): the shared test model

// The fp32 sums of micro-batch gradients, in the order the engine adds them.
void AddToSums(const std::vector<std::vector<uint16_t>>& grads, bool first,
               std::vector<std::vector<float>>* sums) {
  sums->resize(kSizes.size());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    (*sums)[i].resize(kSizes[i]);
    for (uint64_t j = 0; j < kSizes[i]; ++j) {
      (*sums)[i][j] = first ? FromBf16(grads[i][j]) : (*sums)[i][j] + FromBf16(grads[i][j]);
    }
  }
}

// The same training in plain memory: CPU Adam per whole tensor on the same gradients, after
// the same norm pass and clip decision.
struct Reference {
  StatePrecision precision;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<std::byte>> m, v;
  std::vector<std::vector<uint16_t>> copy;
  // float64 AdamW, fp32 state only.
  std::vector<std::vector<double>> p64, m64, v64;

  Reference(StatePrecision p, const Model& model) : precision(p) {
    for (size_t i = 0; i < kSizes.size(); ++i) {
      std::vector<float> x(kSizes[i]);
      for (uint64_t j = 0; j < kSizes[i]; ++j) x[j] = FromBf16(model.params[i][j]);
      p64.emplace_back(x.begin(), x.end());
      m64.emplace_back(kSizes[i], 0.0);
      v64.emplace_back(kSizes[i], 0.0);
      params.push_back(std::move(x));
      m.emplace_back(AdamMomentBytes(p, kSizes[i]));
      v.emplace_back(AdamMomentBytes(p, kSizes[i]));
      copy.emplace_back(kSizes[i]);
    }
  }

  // `sums`: the gradients as the step sees them (bf16 bits when `bf16`, else fp32 sums).
  // `norm`: the norm to clip with, when not the CPU's (the GPU's, checked against float64).
  bool Step(int step, const std::vector<std::vector<uint16_t>>& bf16,
            const std::vector<std::vector<float>>& sums, bool use_bf16, float loss_scale,
            float clip, const double* norm_used = nullptr) {
    std::vector<AdamShard> shards(kSizes.size());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      AdamShard& s = shards[i];
      s.params = params[i].data();
      s.n = kSizes[i];
      s.state = precision;
      s.m = m[i].data();
      s.v = v[i].data();
      s.grads = use_bf16 ? static_cast<const void*>(bf16[i].data()) : sums[i].data();
      s.grad_dtype = use_bf16 ? DType::kBf16 : DType::kFp32;
      s.param_copy = copy[i].data();
      s.copy = ParamCopy::kBf16;
    }
    const GradNorm norm = GradientNorm(shards, 2);
    if (!norm.finite) return false;
    double grad_norm;
    float clip_coef;
    const float grad_scale = ClipAndUnscale(norm_used != nullptr ? *norm_used : norm.l2, loss_scale,
                                            clip, &grad_norm, &clip_coef);
    const std::vector<ParamGroup> groups = Groups();
    double sumsq = 0;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      for (uint64_t j = 0; j < kSizes[i]; ++j) {
        const double g = use_bf16 ? FromBf16(bf16[i][j]) : sums[i][j];
        sumsq += g * g;
      }
    }
    const double norm64 = std::sqrt(sumsq) / loss_scale;
    if (norm_used != nullptr) {
      EXPECT_NEAR(*norm_used / loss_scale, norm64, 1e-12 * norm64);
    }
    const double coef64 = clip > 0 && norm64 > clip ? clip / (norm64 + 1e-6) : 1.0;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      AdamHyper h;
      const ParamGroup& g = groups[GroupOf(i)];
      h.lr = static_cast<float>(LrAt(step));
      h.beta1 = static_cast<float>(g.beta1);
      h.beta2 = static_cast<float>(g.beta2);
      h.eps = static_cast<float>(g.eps);
      h.weight_decay = static_cast<float>(g.weight_decay);
      h.step = step;
      EXPECT_TRUE(AdamUpdate(shards[i], h, grad_scale, 2).ok());
      // float64 AdamW.
      const double lr = static_cast<float>(LrAt(step)), b1 = g.beta1, b2 = g.beta2;
      for (uint64_t j = 0; j < kSizes[i]; ++j) {
        const double grad = (use_bf16 ? FromBf16(bf16[i][j]) : sums[i][j]) / loss_scale * coef64;
        double& p = p64[i][j];
        p *= 1 - lr * g.weight_decay;
        m64[i][j] = b1 * m64[i][j] + (1 - b1) * grad;
        v64[i][j] = b2 * v64[i][j] + (1 - b2) * grad * grad;
        const double mhat = m64[i][j] / (1 - std::pow(b1, step));
        const double vhat = v64[i][j] / (1 - std::pow(b2, step));
        p -= lr * mhat / (std::sqrt(vhat) + g.eps);
      }
    }
    return true;
  }
};

class EngineTest : public ::testing::TestWithParam<Case> {};

// 20 steps through the engine equal 20 steps of CPU Adam in memory, bit for bit: masters,
// both moments and the bf16 parameters; fp32 state also stays within 1e-6 of float64 AdamW.
TEST_P(EngineTest, TrainingIsBitIdenticalToInMemoryAdam) {
  const Case c = GetParam();
  TempDir dir;
  Model model(1);
  Reference ref(c.state, model);
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  auto engine = OffloadEngine::Create(MakeConfig(c, dir.path()), model.Specs(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_FALSE((*engine)->on_gpu());
  const float clip = c.clip ? 0.5f : 0.0f;
  for (int step = 1; step <= kSteps; ++step) {
    for (int g = 0; g < 2; ++g) {
      ParamGroup group = Groups()[g];
      group.lr = LrAt(step);
      ASSERT_TRUE((*engine)->SetGroup(g, group).ok());
    }
    std::vector<std::vector<uint16_t>> last;
    std::vector<std::vector<float>> sums;
    for (int micro = 0; micro < c.accumulation; ++micro) {
      last = Grads(1000 * step + micro);
      for (size_t i = kSizes.size(); i-- > 0;) {  // backward order
        // Without accumulation, written into the engine's own memory for it (taken in place).
        auto buffer = (*engine)->GradientBuffer(Name(i));
        ASSERT_TRUE(buffer.ok()) << buffer.status();
        ASSERT_EQ(*buffer != nullptr, c.accumulation == 1);
        const void* grad = last[i].data();
        if (*buffer != nullptr) grad = std::memcpy(*buffer, grad, 2 * kSizes[i]);
        ASSERT_TRUE((*engine)->GradientReady(Name(i), grad, kSizes[i], DType::kBf16).ok());
      }
      AddToSums(last, micro == 0, &sums);
    }
    auto stats = (*engine)->Step();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_FALSE(stats->skipped);
    EXPECT_EQ(stats->step, step);
    ASSERT_TRUE(ref.Step(step, last, sums, c.accumulation == 1, 1.0f, clip));
  }
  double worst64 = 0;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    SCOPED_TRACE(Name(i));
    std::vector<float> p(kSizes[i]);
    std::vector<std::byte> m(ref.m[i].size()), v(ref.v[i].size());
    ASSERT_TRUE((*engine)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, ref.params[i]);
    EXPECT_EQ(m, ref.m[i]);
    EXPECT_EQ(v, ref.v[i]);
    EXPECT_EQ(model.params[i], ref.copy[i]);  // the model's own parameters were written
    for (uint64_t j = 0; j < kSizes[i]; ++j) {
      worst64 = std::max(worst64,
                         std::abs(p[j] - ref.p64[i][j]) / std::max(1.0, std::abs(ref.p64[i][j])));
    }
  }
  if (c.state == StatePrecision::kFp32) {
    EXPECT_LE(worst64, 1e-6) << "fp32 masters against float64 AdamW";
  }
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (int gas : {1, 4}) {
    for (bool clip : {false, true}) {
      for (StatePrecision s :
           {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
        for (const char* home : {"host", "nvme", "nvme50"}) cases.push_back({gas, clip, s, home});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Combinations, EngineTest, ::testing::ValuesIn(AllCases()), CaseName);

// fp16 with dynamic loss scaling: an overflow skips the step (state and parameters untouched),
// halves the scale (hysteresis 1) and the next steps go on exactly as in memory.
// A checkpoint's restore: state read after 3 steps and loaded (with the step count) into an
// engine over other parameters continues bit-identically to the engine it came from, for each
// state precision, in host memory and on NVMe (half of it in host memory).
TEST(EngineRestore, LoadStateContinuesBitIdentically) {
  for (StatePrecision precision :
       {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
    for (const char* home : {"host", "nvme50"}) {
      SCOPED_TRACE(StrCat(ToString(precision), " ", home));
      const Case c{1, true, precision, home};
      TempDir dir_a, dir_b;
      Model a_model(1), b_model(7);
      EngineOptions eo;
      eo.host_params = true;
      eo.groups = Groups();
      auto a = OffloadEngine::Create(MakeConfig(c, dir_a.path()), a_model.Specs(), eo);
      auto b = OffloadEngine::Create(MakeConfig(c, dir_b.path()), b_model.Specs(), eo);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
      auto step = [](OffloadEngine& e, int seed) {
        const auto grads = Grads(seed);
        for (size_t i = 0; i < kSizes.size(); ++i) {
          ASSERT_TRUE(e.GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
        }
        ASSERT_TRUE(e.Step().ok());
      };
      for (int s = 1; s <= 3; ++s) step(**a, s);
      for (size_t i = 0; i < kSizes.size(); ++i) {
        std::vector<float> p(kSizes[i]);
        std::vector<std::byte> m(AdamMomentBytes(precision, kSizes[i])), v(m.size());
        ASSERT_TRUE((*a)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
        ASSERT_TRUE((*b)->LoadState(Name(i), p.data(), m.data(), v.data()).ok());
        EXPECT_EQ(b_model.params[i], a_model.params[i]) << "the parameter follows the master";
      }
      ASSERT_TRUE((*b)->SetSteps((*a)->steps()).ok());
      for (int s = 4; s <= 6; ++s) {
        step(**a, s);
        step(**b, s);
      }
      for (size_t i = 0; i < kSizes.size(); ++i) {
        std::vector<float> pa(kSizes[i]), pb(kSizes[i]);
        std::vector<std::byte> ma(AdamMomentBytes(precision, kSizes[i])), va(ma.size()),
            mb(ma.size()), vb(ma.size());
        ASSERT_TRUE((*a)->ReadState(Name(i), pa.data(), ma.data(), va.data()).ok());
        ASSERT_TRUE((*b)->ReadState(Name(i), pb.data(), mb.data(), vb.data()).ok());
        EXPECT_EQ(pa, pb) << Name(i);
        EXPECT_EQ(ma, mb) << Name(i);
        EXPECT_EQ(va, vb) << Name(i);
        EXPECT_EQ(a_model.params[i], b_model.params[i]) << Name(i);
      }
      EXPECT_FALSE((*b)->LoadState("nope", nullptr, nullptr, nullptr).ok());
      EXPECT_FALSE((*b)->SetSteps(-1).ok());
    }
  }
}

TEST(EngineFp16, OverflowSkipsTheStepAndHalvesTheScale) {
  TempDir dir;
  for (const char* home : {"host", "nvme"}) {
    SCOPED_TRACE(home);
    const std::string device = std::string(home) == "host" ? "cpu" : "nvme";
    auto config = ParseConfig(StrCat(R"({"fp16": {"enabled": true, "initial_scale_power": 8,
        "hysteresis": 1, "loss_scale_window": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": ")",
                                     device, R"(", "nvme_path": ")", dir.path(), R"("}},
        "aio": {"block_size": 65536},
        "zoffload": {"cpu_adam_threads": 2, "update_chunk_elements": )",
                                     kChunk, "}}"));
    ASSERT_TRUE(config.ok()) << config.status();
    // fp16 parameters (bit patterns of small values).
    std::vector<std::vector<uint16_t>> params;
    std::vector<ParameterSpec> specs;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      params.emplace_back(kSizes[i]);
      for (uint64_t j = 0; j < kSizes[i]; ++j) {
        params[i][j] = static_cast<uint16_t>(0x3000 + (j * 7919 + i * 31) % 0x0800);
      }
    }
    for (size_t i = 0; i < kSizes.size(); ++i) {
      specs.push_back({Name(i), params[i].data(), kSizes[i], DType::kFp16});
    }
    EngineOptions eo;
    eo.host_params = true;
    auto engine = OffloadEngine::Create(*config, specs, eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->loss_scale(), 256.0f);
    auto feed = [&](uint16_t poison) {
      for (size_t i = 0; i < kSizes.size(); ++i) {
        std::vector<uint16_t> g(kSizes[i], 0x2000);  // fp16 2^-7
        if (i == 4) g[77] = poison;
        ASSERT_TRUE((*engine)->GradientReady(Name(i), g.data(), kSizes[i], DType::kFp16).ok());
      }
    };
    feed(0x2000);
    ASSERT_TRUE((*engine)->Step().ok());
    auto snapshot = [&] {
      std::vector<std::vector<float>> masters;
      for (size_t i = 0; i < kSizes.size(); ++i) {
        std::vector<float> p(kSizes[i]);
        std::vector<std::byte> m(AdamMomentBytes(StatePrecision::kFp32, kSizes[i])), v(m.size());
        EXPECT_TRUE((*engine)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
        masters.push_back(std::move(p));
      }
      return masters;
    };
    const auto before = snapshot();
    const auto params_before = params;
    feed(0x7C00);  // fp16 +inf
    auto skipped = (*engine)->Step();
    ASSERT_TRUE(skipped.ok()) << skipped.status();
    EXPECT_TRUE(skipped->skipped);
    EXPECT_EQ(skipped->loss_scale, 256.0f);
    EXPECT_EQ((*engine)->loss_scale(), 128.0f);
    EXPECT_EQ((*engine)->steps(), 1);
    EXPECT_EQ(snapshot(), before);
    EXPECT_EQ(params, params_before);
    for (int k = 0; k < 3; ++k) {  // three good steps: the window doubles the scale again
      feed(0x2000);
      auto ok = (*engine)->Step();
      ASSERT_TRUE(ok.ok()) << ok.status();
      EXPECT_FALSE(ok->skipped);
    }
    EXPECT_EQ((*engine)->loss_scale(), 256.0f);
    EXPECT_EQ((*engine)->steps(), 4);
    EXPECT_NE(params, params_before);
  }
}

TEST(EngineTest, BadInputIsAClearErrorAndChangesNothing) {
  TempDir dir;
  Model model(2);
  const Case c{1, false, StatePrecision::kFp32, "host"};
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  // Create: a name twice, a group that does not exist, no memory.
  auto twice = model.Specs();
  twice[3].name = twice[1].name;
  auto refused = OffloadEngine::Create(MakeConfig(c, dir.path()), twice, eo);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'layer1.bias' is given twice"), std::string::npos)
      << refused.status();
  auto bad_group = model.Specs();
  bad_group[2].group = 5;
  refused = OffloadEngine::Create(MakeConfig(c, dir.path()), bad_group, eo);
  EXPECT_NE(refused.status().message().find("'layer2.weight' is in group 5"), std::string::npos)
      << refused.status();
  auto no_memory = model.Specs();
  no_memory[0].data = nullptr;
  EXPECT_EQ(OffloadEngine::Create(MakeConfig(c, dir.path()), no_memory, eo).status().code(),
            StatusCode::kInvalidArgument);
  auto none = ParseConfig(R"({"zero_optimization": {"stage": 2}})");
  refused = OffloadEngine::Create(*none, model.Specs(), eo);
  EXPECT_NE(refused.status().message().find("offload_optimizer.device"), std::string::npos)
      << refused.status();

  auto engine = OffloadEngine::Create(MakeConfig(c, dir.path()), model.Specs(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto grads = Grads(5);
  Status s = (*engine)->GradientReady("nope", grads[0].data(), 1, DType::kBf16);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("'nope'"), std::string::npos) << s;
  EXPECT_EQ((*engine)->GradientBuffer("nope").status().code(), StatusCode::kNotFound);
  s = (*engine)->GradientReady(Name(2), grads[2].data(), 999, DType::kBf16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("999"), std::string::npos) << s;
  EXPECT_NE(s.message().find("1000"), std::string::npos) << s;
  s = (*engine)->GradientReady(Name(2), grads[2].data(), 1000, DType::kFp32);
  EXPECT_NE(s.message().find("fp32"), std::string::npos) << s;
  ASSERT_TRUE((*engine)->GradientReady(Name(2), grads[2].data(), 1000, DType::kBf16).ok());
  // A second one adds up, as torch's .grad does (host mode, overlap "none": see
  // EngineAccumulation); the engine's own buffer cannot take it.
  ASSERT_TRUE((*engine)->GradientReady(Name(2), grads[2].data(), 1000, DType::kBf16).ok());
  void* own = *(*engine)->GradientBuffer(Name(2));
  EXPECT_EQ((*engine)->GradientReady(Name(2), own, 1000, DType::kBf16).code(),
            StatusCode::kInvalidArgument);
  auto missing = (*engine)->Step();
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(
      missing.status().message().find("5 of 6 parameters lack gradients: 'layer0.weight' (0 of 1)"),
      std::string::npos)
      << missing.status();
  EXPECT_EQ((*engine)->steps(), 0);
  std::vector<float> p(kSizes[2]);
  std::vector<std::byte> m(4 * kSizes[2]), v(m.size());
  ASSERT_TRUE((*engine)->ReadState(Name(2), p.data(), m.data(), v.data()).ok());
  for (uint64_t j = 0; j < kSizes[2]; ++j) ASSERT_EQ(p[j], FromBf16(model.params[2][j]));
  ParamGroup bad;
  bad.beta1 = 1.0;
  EXPECT_EQ((*engine)->SetGroup(0, bad).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*engine)->SetGroup(7, ParamGroup{}).code(), StatusCode::kOutOfRange);
}

// A read error on NVMe mid-step fails Step naming the tensor and leaves the state as before
// the step; Step again (the gradients are kept) then equals a step that never failed.
TEST(EngineTest, NvmeReadErrorFailsTheStepAndLeavesTheStateAsBefore) {
  TempDir dir;
  Model model(3);
  const Case c{1, false, StatePrecision::kFp32, "nvme"};
  RuntimeOptions ro = RuntimeOptions::FromConfig(MakeConfig(c, dir.path()));
  auto plan = std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kRead, FaultRule::Action::kFail, 3, 1, EIO}});
  auto context = RuntimeAccess::Create(ro, InjectFaults(plan));
  ASSERT_TRUE(context.ok());
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  eo.context = context->get();
  auto engine = OffloadEngine::Create(MakeConfig(c, dir.path()), model.Specs(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto grads = Grads(9);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    ASSERT_TRUE((*engine)->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
  }
  for (int g = 0; g < 2; ++g) {  // the reference's schedule
    ParamGroup group = Groups()[g];
    group.lr = LrAt(1);
    ASSERT_TRUE((*engine)->SetGroup(g, group).ok());
  }
  const auto params_before = model.params;
  Reference ref(c.state, model);
  auto failed = (*engine)->Step();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status();
  EXPECT_NE(failed.status().message().find("reading 'layer"), std::string::npos) << failed.status();
  EXPECT_EQ(plan->applied(), 1);
  EXPECT_EQ((*engine)->steps(), 0);
  for (size_t i = 0; i < kSizes.size(); ++i) {  // the state as before the step
    std::vector<float> p(kSizes[i]);
    std::vector<std::byte> m(ref.m[i].size()), v(m.size());
    ASSERT_TRUE((*engine)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, ref.params[i]) << i;
    EXPECT_EQ(m, ref.m[i]) << i;
  }
  auto retried = (*engine)->Step();
  ASSERT_TRUE(retried.ok()) << retried.status();
  ASSERT_TRUE(ref.Step(1, grads, {}, true, 1.0f, 0.0f));
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> p(kSizes[i]);
    std::vector<std::byte> m(ref.m[i].size()), v(m.size());
    ASSERT_TRUE((*engine)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, ref.params[i]) << i;
    EXPECT_EQ(m, ref.m[i]) << i;
    EXPECT_EQ(model.params[i], ref.copy[i]) << i;
  }
  EXPECT_NE(model.params, params_before);
}

#if ZO_HAVE_CUDA
#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define CUDA_EXPECT(expr) EXPECT_EQ((expr), cudaSuccess) << #expr

// The same training with the model's parameters in GPU memory and gradients written there by
// a CUDA kernel (a cast from fp32), handed over on a stream and overwritten at once after
// GradientReady returns, as a framework reusing the memory would.
class EngineGpu : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (auto n = UsableGpuCount(); !n.ok()) GTEST_SKIP() << n.status().message();
  }
};

TEST_P(EngineGpu, TrainingOnTheGpuIsBitIdenticalToInMemoryAdam) {
  const Case c = GetParam();
  TempDir dir;
  Model model(4);
  Reference ref(c.state, model);
  std::vector<void*> device(kSizes.size());
  for (size_t i = 0; i < kSizes.size(); ++i) {
    CUDA_OK(cudaMalloc(&device[i], 2 * kSizes[i]));
    CUDA_OK(cudaMemcpy(device[i], model.params[i].data(), 2 * kSizes[i], cudaMemcpyHostToDevice));
  }
  std::vector<ParameterSpec> specs = model.Specs();
  for (size_t i = 0; i < kSizes.size(); ++i) specs[i].data = device[i];
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* fp32 = nullptr;
  void* grad = nullptr;
  CUDA_OK(cudaMalloc(&fp32, 4 * 13001));
  CUDA_OK(cudaMalloc(&grad, 2 * 13001));
  {
    EngineOptions eo;
    eo.groups = Groups();
    auto engine = OffloadEngine::Create(MakeConfig(c, dir.path()), specs, eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_TRUE((*engine)->on_gpu());
    EXPECT_LE((*engine)->gpu_bytes(), 2 * (2 * kBucketElements + 256));  // two buckets
    const float clip = c.clip ? 0.5f : 0.0f;
    std::vector<float> host_fp32(13001);
    for (int step = 1; step <= kSteps; ++step) {
      for (int g = 0; g < 2; ++g) {
        ParamGroup group = Groups()[g];
        group.lr = LrAt(step);
        ASSERT_TRUE((*engine)->SetGroup(g, group).ok());
      }
      ASSERT_TRUE((*engine)->WaitParameters(stream).ok());
      std::vector<std::vector<uint16_t>> last;
      std::vector<std::vector<float>> sums(kSizes.size());
      for (int micro = 0; micro < c.accumulation; ++micro) {
        last = Grads(1000 * step + micro);
        for (size_t i = kSizes.size(); i-- > 0;) {
          for (uint64_t j = 0; j < kSizes[i]; ++j) host_fp32[j] = FromBf16(last[i][j]);
          CUDA_OK(cudaMemcpyAsync(fp32, host_fp32.data(), 4 * kSizes[i], cudaMemcpyHostToDevice,
                                  stream));
          ASSERT_TRUE(gpu::Cast(fp32, DType::kFp32, grad, DType::kBf16, kSizes[i], stream).ok());
          ASSERT_TRUE(
              (*engine)->GradientReady(Name(i), grad, kSizes[i], DType::kBf16, stream).ok());
          CUDA_OK(cudaMemsetAsync(grad, 0xFF, 2 * kSizes[i], stream));  // reused at once
          CUDA_OK(cudaStreamSynchronize(stream));  // host_fp32 is refilled next
        }
        AddToSums(last, micro == 0, &sums);
      }
      auto stats = (*engine)->Step();
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_FALSE(stats->skipped);
      EXPECT_EQ(stats->bytes_to_gpu, 2 * 18127u * 1);  // every parameter once
      EXPECT_EQ(stats->bytes_to_host, 2 * 18127u * static_cast<unsigned>(c.accumulation));
      // Accumulation 1: the norm is made on the GPU (a float64 sum in its own order); the
      // reference clips with it, and checks it against its float64 sum.
      const double norm = stats->grad_norm;
      ASSERT_TRUE(ref.Step(step, last, sums, c.accumulation == 1, 1.0f, clip,
                           c.accumulation == 1 ? &norm : nullptr));
      // Every step's values reach the model (with host state they go up from where the
      // gradients landed, which the next step's gradients overwrite).
      ASSERT_TRUE((*engine)->WaitParameters(stream).ok());
      CUDA_OK(cudaStreamSynchronize(stream));
      for (size_t i = 0; i < kSizes.size(); ++i) {
        std::vector<uint16_t> on_gpu(kSizes[i]);
        CUDA_OK(cudaMemcpy(on_gpu.data(), device[i], 2 * kSizes[i], cudaMemcpyDeviceToHost));
        ASSERT_EQ(on_gpu, ref.copy[i]) << Name(i) << " after step " << step;
      }
    }
    for (size_t i = 0; i < kSizes.size(); ++i) {
      SCOPED_TRACE(Name(i));
      std::vector<float> p(kSizes[i]);
      std::vector<std::byte> m(ref.m[i].size()), v(ref.v[i].size());
      ASSERT_TRUE((*engine)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
      EXPECT_EQ(p, ref.params[i]);
      EXPECT_EQ(m, ref.m[i]);
      EXPECT_EQ(v, ref.v[i]);
    }
    // A host pointer where device memory is expected is refused, naming it.
    std::vector<uint16_t> host_grad(kSizes[0]);
    const Status s =
        (*engine)->GradientReady(Name(0), host_grad.data(), kSizes[0], DType::kBf16, stream);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("host memory"), std::string::npos) << s;
  }
  for (void* p : device) CUDA_OK(cudaFree(p));
  CUDA_OK(cudaFree(fp32));
  CUDA_OK(cudaFree(grad));
  CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Combinations, EngineGpu,
                         ::testing::Values(Case{1, false, StatePrecision::kFp32, "host"},
                                           Case{1, true, StatePrecision::kBf16, "nvme50"},
                                           Case{4, false, StatePrecision::kFp32, "nvme"},
                                           Case{4, true, StatePrecision::kInt8, "host"},
                                           Case{1, false, StatePrecision::kInt8, "nvme"}),
                         CaseName);
#endif  // ZO_HAVE_CUDA

// ---- zoffload.overlap ------------------------------------------------------------------

Config OverlapConfig(int accumulation, const std::string& overlap, int warmup) {
  auto config = ParseConfig(StrCat(R"({"gradient_accumulation_steps": )", accumulation, R"(,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": )",
                                   kBucketElements, R"(,
                          "offload_optimizer": {"device": "cpu"}},
    "zoffload": {"cpu_adam_threads": 2, "update_chunk_elements": )",
                                   kChunk, R"(, "overlap": ")", overlap,
                                   R"(", "delayed_warmup_steps": )", warmup, "}}"));
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

// What a training run through the engine showed: the model's parameters as the next forward
// sees them after each Step, then after Flush; the masters at the end; each Step's figures.
struct Run {
  std::vector<std::vector<std::vector<uint16_t>>> visible;
  std::vector<std::vector<uint16_t>> flushed;
  std::vector<std::vector<float>> masters;
  std::vector<std::vector<std::byte>> moments;  // m then v, each parameter
  std::vector<double> norms;
  std::vector<int64_t> steps;
  std::vector<bool> skipped;
  std::vector<float> loss_scales;
  std::vector<std::string> speculation;  // EngineStepStats::speculation, each step
};

// What Train feeds beyond the schedule: clipping set from the loop each step (as
// clip_grad_norm_ does: SetGradientClipping, then GradientNorm, whose value must be the step's
// norm), and an inf in one gradient element at some steps.
struct Feed {
  double loop_clip = 0;        // > 0: the loop clips to it
  std::vector<int> inf_steps;  // these steps' gradients hold an inf
};

// A checkpoint in the middle of Train: after step `after`, Save into `dir`, drop the engine,
// put other values in the model, make a new engine from `config` and Load.
struct Resume {
  int after;
  std::string dir;
  Config config;
};

// kSteps steps of fixed gradients (they do not depend on the parameters, so every mode
// applies the same updates; only when the model sees them differs), a schedule changing the
// learning rate between steps; the model on the GPU when `gpu`, else in host memory.
Run Train(const Config& config, bool gpu, const Resume* resume = nullptr, const Feed& feed = {}) {
  Run run;
  Model model(7);
  std::vector<ParameterSpec> specs = model.Specs();
  std::vector<void*> device(kSizes.size(), nullptr);
  void* grad = nullptr;
  void* stream = nullptr;
#if ZO_HAVE_CUDA
  cudaStream_t cuda_stream = nullptr;
  if (gpu) {
    for (size_t i = 0; i < kSizes.size(); ++i) {
      CUDA_EXPECT(cudaMalloc(&device[i], 2 * kSizes[i]));
      CUDA_EXPECT(
          cudaMemcpy(device[i], model.params[i].data(), 2 * kSizes[i], cudaMemcpyHostToDevice));
      specs[i].data = device[i];
    }
    CUDA_EXPECT(cudaMalloc(&grad, 2 * 13001));
    CUDA_EXPECT(cudaStreamCreateWithFlags(&cuda_stream, cudaStreamNonBlocking));
    stream = cuda_stream;
  }
#endif
  auto visible = [&] {
    std::vector<std::vector<uint16_t>> out = model.params;
#if ZO_HAVE_CUDA
    if (gpu) {
      CUDA_EXPECT(cudaStreamSynchronize(cuda_stream));
      for (size_t i = 0; i < kSizes.size(); ++i) {
        CUDA_EXPECT(cudaMemcpy(out[i].data(), device[i], 2 * kSizes[i], cudaMemcpyDeviceToHost));
      }
    }
#endif
    return out;
  };
  {
    EngineOptions eo;
    eo.host_params = !gpu;
    eo.require_gpu = gpu;
    eo.groups = Groups();
    auto engine = OffloadEngine::Create(config, specs, eo);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return run;
    const int accumulation = static_cast<int>(*config.gradient_accumulation_steps);
    for (int step = 1; step <= kSteps; ++step) {
      for (int g = 0; g < 2; ++g) {
        ParamGroup group = Groups()[g];
        group.lr = LrAt(step);
        EXPECT_TRUE((*engine)->SetGroup(g, group).ok());
      }
      for (int micro = 0; micro < accumulation; ++micro) {
        auto grads = Grads(1000 * step + micro);
        if (std::ranges::find(feed.inf_steps, step) != feed.inf_steps.end() && micro == 0) {
          grads[3][5] = 0x7F80;  // +inf
        }
        for (size_t i = kSizes.size(); i-- > 0;) {  // backward order
          const void* g = grads[i].data();
          // Host mode: in the engine's own memory for it, where it takes the gradient in place.
          auto buffer = (*engine)->GradientBuffer(Name(i));
          EXPECT_TRUE(buffer.ok()) << buffer.status();
          const bool in_place =
              !gpu && accumulation == 1 && config.zoffload.overlap != Overlap::kDelayed;
          EXPECT_EQ(buffer.ok() && *buffer != nullptr, in_place);
          if (in_place && buffer.ok()) g = std::memcpy(*buffer, g, 2 * kSizes[i]);
#if ZO_HAVE_CUDA
          if (gpu) {
            CUDA_EXPECT(cudaMemcpyAsync(grad, grads[i].data(), 2 * kSizes[i],
                                        cudaMemcpyHostToDevice, cuda_stream));
            g = grad;
          }
#endif
          const Status s = (*engine)->GradientReady(Name(i), g, kSizes[i], DType::kBf16, stream);
          EXPECT_TRUE(s.ok()) << s;
#if ZO_HAVE_CUDA
          if (gpu) {
            CUDA_EXPECT(cudaMemsetAsync(grad, 0xFF, 2 * kSizes[i], cuda_stream));  // reused at once
            CUDA_EXPECT(cudaStreamSynchronize(cuda_stream));
          }
#endif
        }
      }
      std::optional<double> loop_norm;
      if (feed.loop_clip > 0) {
        EXPECT_TRUE((*engine)->SetGradientClipping(feed.loop_clip).ok());
        auto norm = (*engine)->GradientNorm();
        EXPECT_TRUE(norm.ok()) << norm.status();
        if (norm.ok()) loop_norm = *norm;
      }
      auto stats = (*engine)->Step();
      EXPECT_TRUE(stats.ok()) << stats.status();
      if (!stats.ok()) return run;
      if (loop_norm && std::isfinite(*loop_norm)) {
        EXPECT_EQ(*loop_norm, stats->grad_norm);
      }
      run.norms.push_back(stats->grad_norm);
      run.steps.push_back(stats->step);
      run.skipped.push_back(stats->skipped);
      run.loss_scales.push_back(stats->loss_scale);
      run.speculation.push_back(stats->speculation);
      EXPECT_TRUE((*engine)->WaitParameters(stream).ok());
      run.visible.push_back(visible());
      if (resume != nullptr && step == resume->after) {
        EXPECT_TRUE((*engine)->Save(resume->dir).ok());
        engine->reset();
        const Model other(8);
        for (size_t i = 0; i < kSizes.size(); ++i) {
          std::copy(other.params[i].begin(), other.params[i].end(), model.params[i].begin());
#if ZO_HAVE_CUDA
          if (gpu) {
            CUDA_EXPECT(cudaMemcpy(device[i], other.params[i].data(), 2 * kSizes[i],
                                   cudaMemcpyHostToDevice));
          }
#endif
        }
        engine = OffloadEngine::Create(resume->config, specs, eo);
        EXPECT_TRUE(engine.ok()) << engine.status();
        if (!engine.ok()) return run;
        const Status loaded = (*engine)->Load(resume->dir);
        EXPECT_TRUE(loaded.ok()) << loaded;
        EXPECT_TRUE((*engine)->WaitParameters(stream).ok());
        EXPECT_EQ(visible(), run.visible.back());  // the model has the masters again
      }
    }
    EXPECT_TRUE((*engine)->Flush(stream).ok());
    EXPECT_TRUE((*engine)->WaitParameters(stream).ok());
    run.flushed = visible();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      std::vector<float> p(kSizes[i]);
      std::vector<std::byte> m(AdamMomentBytes(config.zoffload.optimizer_state, kSizes[i]));
      std::vector<std::byte> v(m.size());
      EXPECT_TRUE((*engine)->ReadState(Name(i), p.data(), m.data(), v.data()).ok());
      run.masters.push_back(std::move(p));
      run.moments.push_back(std::move(m));
      run.moments.push_back(std::move(v));
    }
  }
#if ZO_HAVE_CUDA
  if (gpu) {
    for (void* p : device) CUDA_EXPECT(cudaFree(p));
    CUDA_EXPECT(cudaFree(grad));
    CUDA_EXPECT(cudaStreamDestroy(cuda_stream));
  }
#endif
  return run;
}

// "backward" updates each parameter while the others' gradients still come, and is bit for
// bit the exact step: parameters after every step, masters, the gradient norm.
void ExpectBackwardIsExact(bool gpu) {
  for (int accumulation : {1, 3}) {
    SCOPED_TRACE(StrCat("accumulation ", accumulation));
    const Run exact = Train(OverlapConfig(accumulation, "none", 0), gpu);
    const Run overlapped = Train(OverlapConfig(accumulation, "backward", 0), gpu);
    ASSERT_EQ(exact.visible.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(overlapped.visible.size(), static_cast<size_t>(kSteps));
    for (int t = 0; t < kSteps; ++t) EXPECT_EQ(overlapped.visible[t], exact.visible[t]) << t;
    EXPECT_EQ(overlapped.masters, exact.masters);
    EXPECT_EQ(overlapped.norms, exact.norms);
    EXPECT_EQ(overlapped.steps, exact.steps);
  }
}

// "delayed": after Step t the model holds step t-1's parameters (step t's update runs during
// the next forward and backward), the first `warmup` steps excepted; Flush brings the last.
// The updates themselves are the exact ones.
void ExpectDelayedIsOneStepBehind(bool gpu) {
  for (int accumulation : {1, 2}) {
    for (int warmup : {0, 3}) {
      SCOPED_TRACE(StrCat("accumulation ", accumulation, ", warm-up ", warmup));
      const Run exact = Train(OverlapConfig(accumulation, "none", 0), gpu);
      const Run delayed = Train(OverlapConfig(accumulation, "delayed", warmup), gpu);
      ASSERT_EQ(delayed.visible.size(), static_cast<size_t>(kSteps));
      const Model initial(7);
      for (int t = 0; t < kSteps; ++t) {  // after Step t + 1
        const auto& want = t < warmup ? exact.visible[t]
                           : t == 0   ? initial.params
                                      : exact.visible[t - 1];
        EXPECT_EQ(delayed.visible[t], want) << "after step " << t + 1;
        EXPECT_EQ(delayed.steps[t], t < warmup ? t + 1 : t) << "after step " << t + 1;
        // Each Step reports the norm of the update it collected: its own in warm-up, else the
        // one launched at the Step before (on the GPU that norm is made there, in float64
        // throughout; the host sums 16-vector runs in fp32 first: equal to ~1e-8 relative).
        if (t != warmup) {  // at t == warmup nothing is collected
          const double want_norm = exact.norms[t < warmup ? t : t - 1];
          EXPECT_NEAR(delayed.norms[t], want_norm, 1e-6 * want_norm) << "after step " << t + 1;
          if (!gpu) {
            EXPECT_EQ(delayed.norms[t], want_norm) << "after step " << t + 1;
          }
        }
      }
      EXPECT_EQ(delayed.flushed, exact.flushed);
      EXPECT_EQ(delayed.masters, exact.masters);
    }
  }
}

// A checkpoint mid-run (Save, a new engine over other values with the state in another home,
// Load) changes nothing: the model after every step, the masters at the end, bit for bit.
void ExpectResumeIsExact(bool gpu) {
  for (StatePrecision precision :
       {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
    for (int accumulation : {1, 2}) {
      SCOPED_TRACE(StrCat(ToString(precision), ", accumulation ", accumulation));
      TempDir swap, host_swap, ckpt;
      const Config host =
          MakeConfig(Case{accumulation, false, precision, "host"}, host_swap.path());
      const Resume resume{kSteps / 2, ckpt.path() + "/ckpt",
                          MakeConfig(Case{accumulation, false, precision, "nvme50"}, swap.path())};
      const Run straight = Train(host, gpu);
      const Run resumed = Train(host, gpu, &resume);
      ASSERT_EQ(resumed.visible.size(), static_cast<size_t>(kSteps));
      for (int t = 0; t < kSteps; ++t) EXPECT_EQ(resumed.visible[t], straight.visible[t]) << t;
      EXPECT_EQ(resumed.masters, straight.masters);
      EXPECT_EQ(resumed.norms, straight.norms);
    }
  }
}

// The overlap config with clipping to `clip`, state `precision`, fp16 with dynamic loss
// scaling (a window of 3 steps: the scale moves often) or bf16, and `room` for the rollback
// copies (absent: the default).
Config SpeculationConfig(int accumulation, const std::string& overlap, double clip,
                         StatePrecision precision, bool fp16, std::optional<uint64_t> room) {
  Config c = OverlapConfig(accumulation, overlap, 0);
  c.gradient_clipping = clip;
  c.zoffload.optimizer_state = precision;
  c.zoffload.rollback_bytes = room;
  if (fp16) {
    c.bf16.enabled = false;
    c.fp16.enabled = true;
    c.fp16.initial_scale_power = 4;
    c.fp16.loss_scale_window = 3;
    c.fp16.hysteresis = 1;
  }
  return c;
}

std::vector<uint64_t> Bits(const std::vector<double>& x) {
  std::vector<uint64_t> bits;
  for (double d : x) bits.push_back(std::bit_cast<uint64_t>(d));
  return bits;
}

// Runs `got` and `want` showed the same: the model after every step, masters, moments, norms
// (bits: a skipped step's is NaN or inf), step counts, skips and loss scales.
void ExpectSameRun(const Run& got, const Run& want) {
  ASSERT_EQ(got.visible.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(want.visible.size(), static_cast<size_t>(kSteps));
  for (int t = 0; t < kSteps; ++t) EXPECT_EQ(got.visible[t], want.visible[t]) << "step " << t + 1;
  EXPECT_EQ(got.masters, want.masters);
  EXPECT_EQ(got.moments, want.moments);
  EXPECT_EQ(Bits(got.norms), Bits(want.norms));
  EXPECT_EQ(got.steps, want.steps);
  EXPECT_EQ(got.skipped, want.skipped);
  EXPECT_EQ(got.loss_scales, want.loss_scales);
}

// Overlap "backward" with clipping (the max norm the median step norm: about half the steps
// clip), an inf at steps 6 and 13 (skipped), fp16 loss scaling or bf16, each state precision,
// accumulation 1 and 3, room for every copy or for a few (the rest wait until the step),
// clipping from the loop instead of the config, a checkpoint saved and loaded into a new
// engine mid-run: the run is overlap "none"'s, bit for bit; and
// it did speculate: some steps committed, some were redone, some ran exact by choice.
void ExpectSpeculationIsExact(bool gpu) {
  for (int accumulation : {1, 3}) {
    for (StatePrecision precision : {StatePrecision::kFp32, StatePrecision::kInt8}) {
      for (bool fp16 : {false, true}) {
        SCOPED_TRACE(StrCat("accumulation ", accumulation, ", ", ToString(precision),
                            fp16 ? ", fp16" : ", bf16"));
        auto config = [&](const char* overlap, double clip, std::optional<uint64_t> room = {}) {
          return SpeculationConfig(accumulation, overlap, clip, precision, fp16, room);
        };
        const Feed infs{0, {6, 13}};
        std::vector<double> norms;  // the finite ones (clipping changes neither them nor the scale)
        for (double norm : Train(config("none", 0), gpu, nullptr, infs).norms) {
          if (std::isfinite(norm)) norms.push_back(norm);
        }
        ASSERT_EQ(norms.size(), static_cast<size_t>(kSteps - 2));
        std::ranges::sort(norms);
        const double clip = norms[norms.size() / 2];
        const Run exact = Train(config("none", clip), gpu, nullptr, infs);
        std::map<std::string, int> kinds;
        for (std::optional<uint64_t> room :
             {std::optional<uint64_t>(), std::optional<uint64_t>(40000)}) {
          SCOPED_TRACE(room ? "room for a few copies" : "room for all");
          const Run speculated = Train(config("backward", clip, room), gpu, nullptr, infs);
          ExpectSameRun(speculated, exact);
          for (const std::string& kind : speculated.speculation) ++kinds[kind];
        }
        {
          SCOPED_TRACE("clipping from the loop");
          ExpectSameRun(Train(config("backward", 0), gpu, nullptr, Feed{clip, {6, 13}}), exact);
        }
        SCOPED_TRACE("a checkpoint mid-run");
        TempDir ckpt;
        const Resume resume{kSteps / 2, ckpt.path() + "/ckpt", config("backward", clip)};
        ExpectSameRun(Train(config("backward", clip), gpu, &resume, infs), exact);
        EXPECT_GT(kinds["committed"], 0);
        EXPECT_GT(kinds["redone"], 0);
        EXPECT_GT(kinds["exact"], 0);
        EXPECT_EQ(kinds[""], 0);
      }
    }
  }
}

TEST(EngineCheckpoint, ResumeMidRunIsBitIdentical) { ExpectResumeIsExact(false); }
TEST(EngineSpeculation, BackwardWithClippingAndOverflowIsTheExactStep) {
  ExpectSpeculationIsExact(false);
}

TEST(EngineOverlap, BackwardIsBitIdenticalToTheExactStep) { ExpectBackwardIsExact(false); }
TEST(EngineOverlap, DelayedRunsOneStepBehindThenFlushes) { ExpectDelayedIsOneStepBehind(false); }

// What each mode cannot do is refused by the config, naming both keys.
TEST(EngineOverlap, ImpossibleCombinationsAreConfigErrors) {
  const std::string base = R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": )";
  struct Bad {
    std::string json;
    std::string other_key;
  };
  const std::vector<Bad> bad = {
      {R"({"fp16": {"enabled": true}, "zoffload": {"overlap": "delayed"}})", "fp16.enabled"},
      {"{" + base + R"("nvme", "nvme_path": "/tmp"}}, "zoffload": {"overlap": "backward"}})",
       "offload_optimizer.device"},
      {R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
           "offload_param": {"device": "cpu"}}, "zoffload": {"overlap": "delayed"}})",
       "offload_param"},
      {R"({"zoffload": {"overlap": "sideways"}})", "sideways"},
      {R"({"zoffload": {"delayed_warmup_steps": -1}})", "delayed_warmup_steps"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.json);
    auto config = ParseConfig(b.json);
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), StatusCode::kInvalidArgument);
    const std::string message(config.status().message());
    EXPECT_NE(message.find("zoffload."), std::string::npos) << message;
    EXPECT_NE(message.find(b.other_key), std::string::npos) << message;
  }
  // Clipping is fine with "delayed" (its update has every gradient before it starts) and with
  // "backward" (it redoes a step that clips), fp16 with "backward" and "auto".
  for (const char* mode : {"delayed", "backward", "auto"}) {
    EXPECT_TRUE(ParseConfig(StrCat(R"({"gradient_clipping": 1.0, "zoffload": {"overlap": ")", mode,
                                   R"("}})"))
                    .ok());
  }
  EXPECT_TRUE(
      ParseConfig(R"({"fp16": {"enabled": true}, "zoffload": {"overlap": "backward"}})").ok());
}

// "backward": a group changed after the window's updates began is refused (the updates used
// the old one); an inf gradient skips the whole step, as with "none" (the updates already made
// are undone).
TEST(EngineOverlap, BackwardRefusesLateGroupChangesAndSkipsInfGradients) {
  Model model(3);
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  auto engine = OffloadEngine::Create(OverlapConfig(1, "backward", 0), model.Specs(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto grads = Grads(5);
  grads[2][7] = 0x7F80;  // +inf
  for (size_t i = kSizes.size(); i-- > 0;) {
    ASSERT_TRUE((*engine)->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
    if (i == 3) {
      ParamGroup changed = Groups()[0];
      changed.lr = 0.5;
      EXPECT_EQ((*engine)->SetGroup(0, changed).code(), StatusCode::kFailedPrecondition);
      EXPECT_TRUE((*engine)->SetGroup(0, Groups()[0]).ok());  // unchanged: fine
    }
  }
  auto stats = (*engine)->Step();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->skipped);
  EXPECT_EQ(stats->speculation, "redone");
  // At most parameters 5, 4 and 3 went before the inf (how many of them depends on the
  // updater's progress when Step found the inf: the rest were left to the redo).
  EXPECT_LE(stats->speculated_elements, kSizes[5] + kSizes[4] + kSizes[3]);
  EXPECT_EQ((*engine)->steps(), 0);
  EXPECT_EQ(model.params, Model(3).params);  // the model is as before, every parameter
  // The next step runs exact (the last one overflowed), then speculation resumes.
  for (const char* want : {"exact", "committed"}) {
    grads = Grads(6);
    for (size_t i = kSizes.size(); i-- > 0;) {
      ASSERT_TRUE((*engine)->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
    }
    stats = (*engine)->Step();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->speculation, want);
  }
}

// "backward" with no room for copies (zoffload.rollback_bytes 0): in the first window, where
// the loop may still set clipping, the updates wait for Step; then, with neither clipping nor
// fp16, they run during backward without copies. An inf gradient after them cannot be
// undone: every finite gradient is applied, Step fails with DATA_LOSS naming the other, and
// clipping set then is refused (the updates it would change were made).
TEST(EngineOverlap, BackwardWithoutRoomForCopiesAppliesWhatItCanOfAnInfStep) {
  Model model(3);
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  Config config = OverlapConfig(1, "backward", 0);
  config.zoffload.rollback_bytes = 0;
  auto engine = OffloadEngine::Create(config, model.Specs(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto feed = [&](int seed, bool inf) {
    auto grads = Grads(seed);
    if (inf) grads[0][0] = 0x7F80;  // the last to land
    for (size_t i = kSizes.size(); i-- > 0;) {
      ASSERT_TRUE((*engine)->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
    }
  };
  feed(1, false);
  auto stats = (*engine)->Step();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->speculation, "committed");
  EXPECT_EQ(stats->speculated_elements, 0u);  // every update waited for Step
  const std::vector<std::vector<uint16_t>> before = model.params;
  feed(2, true);
  EXPECT_EQ((*engine)->SetGradientClipping(1.0).code(), StatusCode::kFailedPrecondition);
  stats = (*engine)->Step();
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(stats.status().message().find(Name(0)), std::string::npos) << stats.status();
  EXPECT_EQ(model.params[0], before[0]);
  for (size_t i = 1; i < kSizes.size(); ++i) EXPECT_NE(model.params[i], before[i]) << i;
  EXPECT_EQ((*engine)->steps(), 2);
}

// ---- checkpoints ----------------------------------------------------------------------

// 20 steps straight equal 10 steps, Save, an engine over other parameter values (and another
// state home), Load, 10 more: masters, moments and the model's parameters, bit for bit.
TEST(EngineCheckpoint, SaveThenLoadResumesBitIdentically) {
  for (StatePrecision precision :
       {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
    for (int accumulation : {1, 2}) {
      SCOPED_TRACE(StrCat(ToString(precision), ", accumulation ", accumulation));
      TempDir swap_a, swap_b, swap_c, ckpt;
      const Case host{accumulation, true, precision, "host"};
      const Case nvme{accumulation, true, precision, "nvme50"};
      Model straight_model(11), first_model(11), second_model(12);
      auto straight = HostEngine(host, swap_a.path(), straight_model);
      auto first = HostEngine(nvme, swap_b.path(), first_model);
      ASSERT_TRUE(straight && first);
      RunSteps(*straight, 1, 20, accumulation);
      RunSteps(*first, 1, 10, accumulation);
      const std::string dir = ckpt.path() + "/step10";
      ASSERT_TRUE(first->Save(dir).ok());
      ASSERT_TRUE(first->Save(dir).ok());  // replacing one works too
      first.reset();
      auto second = HostEngine(host, swap_c.path(), second_model);
      ASSERT_TRUE(second);
      const Status loaded = second->Load(dir);
      ASSERT_TRUE(loaded.ok()) << loaded;
      EXPECT_EQ(second->steps(), 10);
      RunSteps(*second, 11, 20, accumulation);
      EXPECT_EQ(AllState(*second, precision), AllState(*straight, precision));
      EXPECT_EQ(second_model.params, straight_model.params);
    }
  }
}

// A damaged or mismatched checkpoint is an error naming the file or the parameter, and the
// engine is as before; a save cut between its renames is found in DIR.prev.
TEST(EngineCheckpoint, BadCheckpointsAreClearErrorsAndChangeNothing) {
  TempDir swap, other_swap, ckpt;
  const Case c{1, false, StatePrecision::kFp32, "host"};
  Model model(13);
  auto engine = HostEngine(c, swap.path(), model);
  ASSERT_TRUE(engine);
  RunSteps(*engine, 1, 3, 1);
  const std::string dir = ckpt.path() + "/ckpt";
  ASSERT_TRUE(engine->Save(dir).ok());
  RunSteps(*engine, 4, 5, 1);
  const auto before = AllState(*engine, StatePrecision::kFp32);
  const auto params_before = model.params;

  EXPECT_EQ(engine->Load(ckpt.path() + "/absent").code(), StatusCode::kNotFound);
  {  // One flipped byte in the last parameter's state.
    std::fstream f(dir + "/state.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x5a');
  }
  Status s = engine->Load(dir);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(Name(kSizes.size() - 1)), std::string::npos) << s;
  EXPECT_NE(s.message().find("state.bin"), std::string::npos) << s;
  EXPECT_EQ(AllState(*engine, StatePrecision::kFp32), before);
  EXPECT_EQ(model.params, params_before);

  // Other parameters: named.
  ASSERT_TRUE(engine->Save(dir).ok());
  std::vector<uint16_t> small(5);
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  auto other = OffloadEngine::Create(MakeConfig(c, other_swap.path()),
                                     {{Name(0), small.data(), 5, DType::kBf16, nullptr, 0}}, eo);
  ASSERT_TRUE(other.ok());
  s = (*other)->Load(dir);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  const std::string message(s.message());
  EXPECT_NE(message.find(StrCat("'", Name(0), "' is saved with 1 bf16")), std::string::npos) << s;
  EXPECT_NE(message.find(StrCat("'", Name(1), "' is saved but not registered")), std::string::npos)
      << s;

  // Killed between the renames: only DIR.prev is left, and it loads.
  ASSERT_EQ(::rename(dir.c_str(), (dir + ".prev").c_str()), 0);
  s = engine->Load(dir);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(AllState(*engine, StatePrecision::kFp32), before);

  // Mid-step: refused.
  const auto grads = Grads(99);
  ASSERT_TRUE(engine->GradientReady(Name(0), grads[0].data(), kSizes[0], DType::kBf16).ok());
  EXPECT_EQ(engine->Save(dir).code(), StatusCode::kFailedPrecondition);
}

// The export: a safetensors file (8-byte little-endian header length, a JSON header, the data)
// holding each master as F32 with its registered shape; a damaged checkpoint or an existing
// output (without overwrite) leaves nothing written.
TEST(EngineCheckpoint, ExportWritesTheMastersAsSafetensors) {
  TempDir swap, dir;
  const Case c{1, false, StatePrecision::kBf16, "host"};
  Model model(31);
  std::vector<ParameterSpec> specs = model.Specs();
  specs[2].shape = {10, 100};
  specs[4].shape = {1, 13001, 1};
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  auto engine = OffloadEngine::Create(MakeConfig(c, swap.path()), specs, eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  RunSteps(**engine, 1, 4, 1);
  const std::string ckpt = dir.File("ckpt"), out = dir.File("model.safetensors");
  ASSERT_TRUE((*engine)->Save(ckpt).ok());
  const Status exported = ExportSafetensors(ckpt, out);
  ASSERT_TRUE(exported.ok()) << exported;

  std::ifstream in(out, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(file.size(), 8u);
  uint64_t header_size = 0;
  for (int b = 7; b >= 0; --b) header_size = header_size << 8 | static_cast<uint8_t>(file[b]);
  EXPECT_EQ((8 + header_size) % 8, 0u);
  const auto header = nlohmann::json::parse(file.substr(8, header_size));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["__metadata__"]["zoffload_steps"], "4");
  const auto state = AllState(**engine, c.state);
  uint64_t end = 0;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    SCOPED_TRACE(Name(i));
    const auto& t = header[Name(i)];
    EXPECT_EQ(t["dtype"], "F32");
    const std::vector<uint64_t> shape =
        specs[i].shape.empty() ? std::vector<uint64_t>{kSizes[i]} : specs[i].shape;
    EXPECT_EQ(t["shape"].get<std::vector<uint64_t>>(), shape);
    const uint64_t begin = t["data_offsets"][0], stop = t["data_offsets"][1];
    EXPECT_EQ(stop - begin, 4 * kSizes[i]);
    end = std::max(end, stop);
    ASSERT_LE(8 + header_size + stop, file.size());
    EXPECT_EQ(std::memcmp(file.data() + 8 + header_size + begin, state[i].data(), 4 * kSizes[i]),
              0);
  }
  EXPECT_EQ(8 + header_size + end, file.size());

  // An existing output is kept without overwrite, replaced with it.
  Status again = ExportSafetensors(ckpt, out);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again;
  EXPECT_TRUE(ExportSafetensors(ckpt, out, /*overwrite=*/true).ok());
  // A damaged checkpoint: an error naming the parameter, and no output.
  {
    std::fstream f(ckpt + "/state.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x11');
  }
  const std::string damaged_out = dir.File("damaged.safetensors");
  Status damaged = ExportSafetensors(ckpt, damaged_out);
  EXPECT_EQ(damaged.code(), StatusCode::kDataLoss) << damaged;
  EXPECT_NE(damaged.message().find(Name(0)), std::string::npos) << damaged;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    files += entry.path().filename().string().starts_with("damaged") ? 1 : 0;
  }
  EXPECT_EQ(files, 0);
  // A shape that does not hold the elements is refused when registering.
  specs[2].shape = {10, 99};
  auto bad = OffloadEngine::Create(MakeConfig(c, swap.path()), specs, eo);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("shape [10, 99] (990 elements) but 1000"),
            std::string::npos)
      << bad.status();
}

// An engine dropped mid-step (gradients handed over, an update running on the worker) stops
// cleanly: the worker finishes what it has, then the memory goes (the sanitizers check).
TEST(EngineOverlap, DroppingTheEngineMidStepIsClean) {
  for (const char* overlap : {"backward", "delayed"}) {
    SCOPED_TRACE(overlap);
    Model model(21);
    EngineOptions eo;
    eo.host_params = true;
    eo.groups = Groups();
    auto engine = OffloadEngine::Create(OverlapConfig(1, overlap, 0), model.Specs(), eo);
    ASSERT_TRUE(engine.ok()) << engine.status();
    RunSteps(**engine, 1, 1, 1);  // delayed: this update is still running
    const auto grads = Grads(77);
    for (size_t i = kSizes.size(); i-- > 2;) {
      ASSERT_TRUE((*engine)->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
    }
    engine->reset();
  }
}

#if ZO_HAVE_CUDA
class EngineGpuOverlap : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto n = UsableGpuCount(); !n.ok()) GTEST_SKIP() << n.status().message();
  }
};
TEST_F(EngineGpuOverlap, BackwardIsBitIdenticalToTheExactStep) { ExpectBackwardIsExact(true); }
TEST_F(EngineGpuOverlap, BackwardWithClippingAndOverflowIsTheExactStep) {
  ExpectSpeculationIsExact(true);
}
TEST_F(EngineGpuOverlap, DelayedRunsOneStepBehindThenFlushes) {
  ExpectDelayedIsOneStepBehind(true);
}
using EngineGpuCheckpoint = EngineGpuOverlap;
TEST_F(EngineGpuCheckpoint, ResumeMidRunIsBitIdentical) { ExpectResumeIsExact(true); }

// On the GPU (accumulation 1) each gradient's squares are made there as it goes down: the
// norms match the host's, made on the CPU, in every overlap mode. The host adds runs of 16
// vectors in fp32 before its float64 total (~1e-8 relative off float64, as the delayed test
// above allows 1e-6 for); the GPU's own norm is checked against float64 to 1e-12 in
// EngineGpu.TrainingOnTheGpuIsBitIdenticalToInMemoryAdam.
TEST_F(EngineGpuOverlap, GradientNormsMadeOnTheGpuMatchTheHost) {
  for (const char* overlap : {"none", "backward", "delayed"}) {
    SCOPED_TRACE(overlap);
    const auto host = Train(OverlapConfig(1, overlap, 0), false);
    const auto gpu = Train(OverlapConfig(1, overlap, 0), true);
    ASSERT_EQ(gpu.norms.size(), host.norms.size());
    for (size_t t = 0; t < host.norms.size(); ++t) {
      EXPECT_NEAR(gpu.norms[t], host.norms[t], 1e-6 * host.norms[t]) << t;
    }
    EXPECT_GT(gpu.norms.back(), 0.0);
  }
}

// An inf in one gradient, found on the GPU: the exact step is skipped and changes nothing;
// overlap "backward" leaves that parameter out and names it.
TEST_F(EngineGpuOverlap, InfInAGradientIsFoundOnTheGpu) {
  for (const char* overlap : {"none", "backward"}) {
    SCOPED_TRACE(overlap);
    Model model(5);
    std::vector<ParameterSpec> specs = model.Specs();
    std::vector<void*> device(kSizes.size());
    for (size_t i = 0; i < kSizes.size(); ++i) {
      CUDA_OK(cudaMalloc(&device[i], 2 * kSizes[i]));
      CUDA_OK(cudaMemcpy(device[i], model.params[i].data(), 2 * kSizes[i], cudaMemcpyHostToDevice));
      specs[i].data = device[i];
    }
    void* grad = nullptr;
    CUDA_OK(cudaMalloc(&grad, 2 * 13001));
    {
      EngineOptions eo;
      eo.require_gpu = true;
      eo.groups = Groups();
      auto engine = OffloadEngine::Create(OverlapConfig(1, overlap, 0), specs, eo);
      ASSERT_TRUE(engine.ok()) << engine.status();
      auto grads = Grads(99);
      grads[4][77] = 0x7F80;  // bf16 +inf
      for (size_t i = kSizes.size(); i-- > 0;) {
        CUDA_OK(cudaMemcpy(grad, grads[i].data(), 2 * kSizes[i], cudaMemcpyHostToDevice));
        const Status s = (*engine)->GradientReady(Name(i), grad, kSizes[i], DType::kBf16, nullptr);
        ASSERT_TRUE(s.ok()) << s;
        CUDA_OK(cudaDeviceSynchronize());  // `grad` is reused
      }
      auto stats = (*engine)->Step();
      if (std::string(overlap) == "none") {
        ASSERT_TRUE(stats.ok()) << stats.status();
        EXPECT_TRUE(stats->skipped);
        EXPECT_EQ((*engine)->steps(), 0);
      } else {
        EXPECT_EQ(stats.status().code(), StatusCode::kDataLoss) << stats.status();
        EXPECT_NE(stats.status().message().find("of 1 parameters ('" + Name(4) + "')"),
                  std::string::npos)
            << stats.status();
      }
      // The parameter with the inf keeps its values.
      std::vector<float> p(kSizes[4]);
      std::vector<std::byte> m(AdamMomentBytes(StatePrecision::kFp32, kSizes[4])), v(m.size());
      ASSERT_TRUE((*engine)->ReadState(Name(4), p.data(), m.data(), v.data()).ok());
      for (uint64_t j = 0; j < kSizes[4]; ++j) ASSERT_EQ(p[j], FromBf16(model.params[4][j])) << j;
    }
    for (void* d : device) CUDA_OK(cudaFree(d));
    CUDA_OK(cudaFree(grad));
  }
}
#endif  // ZO_HAVE_CUDA

}  // namespace
}  // namespace zoffload::internal

// ---- accumulation as torch does it ----------------------------------------------------------

namespace zoffload::internal::testing {
namespace {

// bf16 round to nearest even of a double that is exact in fp32 (a sum of two bf16 values):
// the test's own rounding, for the reference.
uint16_t RoundToBf16(double x) {
  const auto f = static_cast<float>(x);
  uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t lower = u & 0xffffu, half = 0x8000u;
  u >>= 16;
  if (lower > half || (lower == half && (u & 1u))) ++u;
  return static_cast<uint16_t>(u);
}

// `grads` into `sums` (`first`: they are the sums) as torch adds into a bf16 .grad: each sum
// rounded to bf16.
void AddAsTorch(const std::vector<std::vector<uint16_t>>& grads, bool first,
                std::vector<std::vector<uint16_t>>* sums) {
  if (first) {
    *sums = grads;
    return;
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    for (uint64_t k = 0; k < grads[i].size(); ++k) {
      (*sums)[i][k] = RoundToBf16(static_cast<double>(FromBf16((*sums)[i][k])) +
                                  static_cast<double>(FromBf16(grads[i][k])));
    }
  }
}

// Host mode, overlap "none", no gradient_accumulation_steps: three backward passes a step are
// added into the first in bf16 (each sum rounded, as torch adds into a bf16 .grad), and the
// steps equal, bit for bit, an engine given each step's sum as one gradient. Under overlap
// "backward" an undeclared micro-batch is refused with the key to set.
TEST(EngineAccumulation, UndeclaredMicroBatchesAddUpAsTorchsGrad) {
  TempDir swap_a, swap_b;
  const Case c{1, true, StatePrecision::kFp32, "host"};
  Model repeated_model(21), summed_model(21);
  auto repeated = HostEngine(c, swap_a.path(), repeated_model);
  auto summed = HostEngine(c, swap_b.path(), summed_model);
  ASSERT_TRUE(repeated && summed);
  for (int step = 1; step <= 4; ++step) {
    std::vector<std::vector<uint16_t>> sums;
    for (int micro = 0; micro < 3; ++micro) {
      const auto grads = Grads(100 * step + micro);
      for (size_t i = 0; i < kSizes.size(); ++i) {
        ASSERT_TRUE(
            repeated->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
      }
      AddAsTorch(grads, micro == 0, &sums);
    }
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_TRUE(summed->GradientReady(Name(i), sums[i].data(), kSizes[i], DType::kBf16).ok());
    }
    auto a = repeated->Step();
    auto b = summed->Step();
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_EQ(a->grad_norm, b->grad_norm);
  }
  EXPECT_EQ(AllState(*repeated, StatePrecision::kFp32), AllState(*summed, StatePrecision::kFp32));
  EXPECT_EQ(repeated_model.params, summed_model.params);

  // Overlap "backward" updates at each parameter's declared last gradient: refused, naming the
  // key.
  Config backward = MakeConfig({1, false, StatePrecision::kFp32, "host"}, swap_a.path());
  backward.zoffload.overlap = Overlap::kBackward;
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = Groups();
  Model m(22);
  auto engine = OffloadEngine::Create(backward, m.Specs(), eo);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto grads = Grads(7);
  ASSERT_TRUE((*engine)->GradientReady(Name(0), grads[0].data(), kSizes[0], DType::kBf16).ok());
  const Status s = (*engine)->GradientReady(Name(0), grads[0].data(), kSizes[0], DType::kBf16);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("gradient_accumulation_steps"), std::string::npos) << s;
}

// GradientNorm (a loop's clip_grad_norm_) is the norm Step then reports and clips with, and
// SetGradientClipping changes the clip from the next Step on.
TEST(EngineAccumulation, GradientNormIsTheStepsNormAndSetsTheClip) {
  TempDir swap_a, swap_b;
  const Case no_clip{1, false, StatePrecision::kFp32, "host"},
      clip{1, true, StatePrecision::kFp32, "host"};
  Model a_model(23), b_model(23);
  auto a = HostEngine(no_clip, swap_a.path(), a_model);  // clipped by the loop
  auto b = HostEngine(clip, swap_b.path(), b_model);     // by the config (0.5)
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->GradientNorm().status().code(), StatusCode::kFailedPrecondition);  // no gradients
  for (int step = 1; step <= 3; ++step) {
    const auto grads = Grads(step);
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_TRUE(a->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
      ASSERT_TRUE(b->GradientReady(Name(i), grads[i].data(), kSizes[i], DType::kBf16).ok());
    }
    double want = 0;
    for (const auto& g : grads) {
      for (uint16_t x : g) want += static_cast<double>(FromBf16(x)) * FromBf16(x);
    }
    auto norm = a->GradientNorm();
    ASSERT_TRUE(norm.ok()) << norm.status();
    // The host's norm pass adds runs of squares in fp32 before float64: relative 1e-6.
    EXPECT_NEAR(*norm, std::sqrt(want), 1e-6 * std::sqrt(want));
    ASSERT_TRUE(a->SetGradientClipping(0.5).ok());
    auto sa = a->Step();
    auto sb = b->Step();
    ASSERT_TRUE(sa.ok() && sb.ok());
    EXPECT_EQ(sa->grad_norm, *norm);
    EXPECT_EQ(sa->clip_coef, sb->clip_coef);
    EXPECT_LT(sa->clip_coef, 1.0f);
  }
  EXPECT_EQ(AllState(*a, StatePrecision::kFp32), AllState(*b, StatePrecision::kFp32));
  EXPECT_EQ(a->SetGradientClipping(-1).code(), StatusCode::kInvalidArgument);
}

#if ZO_HAVE_CUDA
// The same with the parameters on a GPU: an undeclared micro-batch's gradient goes down through
// the ring into a landing buffer and the worker adds it into the first in bf16. The state and
// the model's parameters equal, bit for bit, a host engine's given each step's sum (its norm,
// from the host's pass over the sum, equals the host engine's), with host and NVMe state.
TEST(EngineGpuAccumulation, UndeclaredMicroBatchesAddUpAsTorchsGrad) {
  if (auto n = UsableGpuCount(); !n.ok()) GTEST_SKIP() << n.status().message();
  for (const char* home : {"host", "nvme"}) {
    SCOPED_TRACE(home);
    TempDir swap_a, swap_b;
    const Case c{1, false, StatePrecision::kFp32, home};
    Model gpu_model(31), host_model(31);
    std::vector<void*> device(kSizes.size());
    std::vector<ParameterSpec> specs = gpu_model.Specs();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_EQ(cudaMalloc(&device[i], 2 * kSizes[i]), cudaSuccess);
      ASSERT_EQ(
          cudaMemcpy(device[i], gpu_model.params[i].data(), 2 * kSizes[i], cudaMemcpyHostToDevice),
          cudaSuccess);
      specs[i].data = device[i];
    }
    void* grad = nullptr;
    ASSERT_EQ(cudaMalloc(&grad, 2 * 13001), cudaSuccess);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    {
      EngineOptions eo;
      eo.groups = Groups();
      eo.require_gpu = true;
      auto engine = OffloadEngine::Create(MakeConfig(c, swap_a.path()), specs, eo);
      ASSERT_TRUE(engine.ok()) << engine.status();
      auto host = HostEngine(c, swap_b.path(), host_model);
      ASSERT_TRUE(host);
      for (int step = 1; step <= 3; ++step) {
        ASSERT_TRUE((*engine)->WaitParameters(stream).ok());
        std::vector<std::vector<uint16_t>> sums;
        for (int micro = 0; micro < 3; ++micro) {
          const auto grads = Grads(100 * step + micro);
          for (size_t i = kSizes.size(); i-- > 0;) {
            ASSERT_EQ(cudaMemcpyAsync(grad, grads[i].data(), 2 * kSizes[i], cudaMemcpyHostToDevice,
                                      stream),
                      cudaSuccess);
            ASSERT_TRUE(
                (*engine)->GradientReady(Name(i), grad, kSizes[i], DType::kBf16, stream).ok());
            ASSERT_EQ(cudaMemsetAsync(grad, 0xFF, 2 * kSizes[i], stream), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          }
          AddAsTorch(grads, micro == 0, &sums);
        }
        for (size_t i = 0; i < kSizes.size(); ++i) {
          ASSERT_TRUE(host->GradientReady(Name(i), sums[i].data(), kSizes[i], DType::kBf16).ok());
        }
        auto norm = (*engine)->GradientNorm();
        auto a = (*engine)->Step();
        auto b = host->Step();
        ASSERT_TRUE(norm.ok() && a.ok() && b.ok()) << norm.status() << a.status() << b.status();
        EXPECT_EQ(*norm, a->grad_norm);
        EXPECT_NEAR(a->grad_norm, b->grad_norm, 1e-12 * b->grad_norm);
      }
      ASSERT_TRUE((*engine)->WaitParameters(stream).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_EQ(AllState(**engine, StatePrecision::kFp32), AllState(*host, StatePrecision::kFp32));
      for (size_t i = 0; i < kSizes.size(); ++i) {
        std::vector<uint16_t> on_gpu(kSizes[i]);
        ASSERT_EQ(cudaMemcpy(on_gpu.data(), device[i], 2 * kSizes[i], cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(on_gpu, host_model.params[i]) << Name(i);
      }
    }
    for (void* d : device) EXPECT_EQ(cudaFree(d), cudaSuccess);
    EXPECT_EQ(cudaFree(grad), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  }
}
#endif  // ZO_HAVE_CUDA

}  // namespace
}  // namespace zoffload::internal::testing
