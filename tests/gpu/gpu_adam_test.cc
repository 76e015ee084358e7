// The GPU Adam against the CPU Adam (which the cpu_adam tests check against float64): the
// same float operations from the same coefficients, so the same results.
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"
#include "gpu/kernels.h"
#include "zoffload/cpu_adam.h"

namespace zoffload::internal {
namespace {

using testing::Poisoned;
using testing::ToDevice;
using testing::ToHost;

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

uint16_t Bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

int64_t UlpDistance(float a, float b) {
  auto key = [](float x) {
    const int32_t i = std::bit_cast<int32_t>(x);
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};
  };
  return std::abs(key(a) - key(b));
}

// A tensor held on both sides.
struct Tensor {
  std::vector<float> p, m, v;
  std::vector<uint16_t> copy;
  DeviceBuffer dp, dm, dv, dg, dcopy;
};

struct Case {
  DType grad;
  ParamCopy copy;
  bool decoupled;
};

class GpuAdamTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { ZO_SKIP_WITHOUT_GPU(); }
};

INSTANTIATE_TEST_SUITE_P(Paths, GpuAdamTest,
                         ::testing::Values(Case{DType::kFp32, ParamCopy::kNone, true},
                                           Case{DType::kFp32, ParamCopy::kNone, false},
                                           Case{DType::kBf16, ParamCopy::kBf16, true},
                                           Case{DType::kFp16, ParamCopy::kFp16, true}),
                         [](const ::testing::TestParamInfo<Case>& param_info) {
                           return std::string(ToString(param_info.param.grad)) + "_copy_" +
                                  std::string(ToString(param_info.param.copy)) +
                                  (param_info.param.decoupled ? "_adamw" : "_adam");
                         });

// Ten steps over 300 tensors (two launches) of awkward sizes, some unaligned; fresh random
// gradients each step. Every element within 1 ulp of the CPU Adam; the copy equal.
TEST_P(GpuAdamTest, MatchesCpuAdamOverTenSteps) {
  const Case c = GetParam();
  constexpr int kTensors = 300;
  std::vector<Tensor> tensors(kTensors);
  std::vector<size_t> sizes(kTensors);
  for (int t = 0; t < kTensors; ++t) {
    sizes[t] = t == 7 ? (size_t{1} << 20) + 3 : static_cast<size_t>(t * 13 % 41);
    Tensor& T = tensors[t];
    T.p = Random(sizes[t], 1000 + t, 1.0f);
    T.m.assign(sizes[t], 0.0f);
    T.v.assign(sizes[t], 0.0f);
    T.copy.assign(sizes[t], 0);
    T.dp = ToDevice(T.p);
    T.dm = ToDevice(T.m);
    T.dv = ToDevice(T.v);
    T.dcopy = Poisoned(sizes[t] * 2);
  }
  const size_t grad_elem = c.grad == DType::kFp32 ? 4 : 2;
  for (int step = 1; step <= 10; ++step) {
    AdamHyper hyper;
    hyper.lr = 1e-2f;
    hyper.weight_decay = 0.05f;
    hyper.decoupled_weight_decay = c.decoupled;
    hyper.step = step;
    std::vector<gpu::GpuAdamTensor> gpu_tensors;
    for (int t = 0; t < kTensors; ++t) {
      Tensor& T = tensors[t];
      const std::vector<float> g = Random(sizes[t], 50 * step + t, 0.1f);
      std::vector<uint16_t> g16(sizes[t]);
      for (size_t i = 0; i < g.size(); ++i) {
        g16[i] = c.grad == DType::kBf16 ? Bf16(g[i])
                                        : std::bit_cast<uint16_t>(static_cast<_Float16>(g[i]));
      }
      const void* host_grads = c.grad == DType::kFp32 ? static_cast<const void*>(g.data())
                                                      : static_cast<const void*>(g16.data());
      // Unaligned grads for every third tensor: an offset of one element on the device.
      const size_t offset = t % 3 == 0 ? 1 : 0;
      T.dg = Poisoned((sizes[t] + offset) * grad_elem);
      auto* dg = static_cast<std::byte*>(T.dg.data()) + offset * grad_elem;
      ZO_ASSERT_CUDA(cudaMemcpy(dg, host_grads, sizes[t] * grad_elem, cudaMemcpyHostToDevice));
      AdamShard shard;
      shard.params = T.p.data();
      shard.n = sizes[t];
      shard.m = T.m.data();
      shard.v = T.v.data();
      shard.grads = host_grads;
      shard.grad_dtype = c.grad;
      shard.copy = c.copy;
      shard.param_copy = T.copy.data();
      ASSERT_TRUE(AdamUpdate(shard, hyper, 0.5f).ok());
      gpu_tensors.push_back(
          {T.dp.as<float>(), T.dm.as<float>(), T.dv.as<float>(), dg, T.dcopy.data(), sizes[t]});
    }
    gpu::GpuAdamStep gpu_step;
    gpu_step.hyper = hyper;
    gpu_step.grad_dtype = c.grad;
    gpu_step.copy = c.copy;
    gpu_step.loss_scale = 2.0f;  // grad scale 0.5, as on the CPU
    ASSERT_TRUE(gpu::GpuAdam(gpu_tensors, gpu_step, nullptr).ok());
  }
  int64_t worst = 0, differing = 0;
  for (int t = 0; t < kTensors; ++t) {
    const Tensor& T = tensors[t];
    const auto p = ToHost<float>(T.dp.data(), sizes[t]);
    const auto m = ToHost<float>(T.dm.data(), sizes[t]);
    const auto v = ToHost<float>(T.dv.data(), sizes[t]);
    for (size_t i = 0; i < sizes[t]; ++i) {
      const int64_t d = std::max(
          {UlpDistance(p[i], T.p[i]), UlpDistance(m[i], T.m[i]), UlpDistance(v[i], T.v[i])});
      worst = std::max(worst, d);
      differing += d > 0;
    }
    if (c.copy != ParamCopy::kNone) {
      const auto copy = ToHost<uint16_t>(T.dcopy.data(), sizes[t]);
      for (size_t i = 0; i < sizes[t]; ++i) {
        ASSERT_LE(UlpDistance(p[i], T.p[i]), 1);
        if (p[i] == T.p[i]) {
          ASSERT_EQ(copy[i], T.copy[i]) << t << ":" << i;
        }
      }
    }
  }
  EXPECT_LE(worst, 1) << differing << " elements differ from the CPU Adam";
  RecordProperty("elements_differing_from_cpu", static_cast<int>(differing));
}

// With the norm on the device: an inf/NaN skips the step (state bit-identical), clipping
// follows AdamStep on the CPU.
TEST(GpuAdamStepTest, SkipsOnOverflowAndClipsLikeCpuAdamStep) {
  ZO_SKIP_WITHOUT_GPU();
  constexpr size_t kN = 100003;
  std::vector<float> p = Random(kN, 1, 1.0f), m(kN, 0.0f), v(kN, 0.0f);
  std::vector<float> g = Random(kN, 2, 1.0f);
  DeviceBuffer dp = ToDevice(p), dm = ToDevice(m), dv = ToDevice(v), dg = ToDevice(g);
  auto workspace = gpu::GradNormWorkspace::Create();
  ASSERT_TRUE(workspace.ok());
  const gpu::DeviceSpan span{dg.data(), kN};
  gpu::GpuAdamStep step;
  step.loss_scale = 4.0f;
  step.max_grad_norm = 1.0f;
  step.norm = workspace->result();
  const gpu::GpuAdamTensor tensor{dp.as<float>(), dm.as<float>(), dv.as<float>(),
                                  dg.data(),      nullptr,        kN};
  // Overflow: NaN in the gradients.
  const float nan = std::nanf("");
  ZO_ASSERT_CUDA(cudaMemcpy(dg.as<float>() + 77, &nan, 4, cudaMemcpyHostToDevice));
  ASSERT_TRUE(gpu::MultiTensorGradNorm({&span, 1}, DType::kFp32, *workspace, nullptr).ok());
  ASSERT_TRUE(gpu::GpuAdam({&tensor, 1}, step, nullptr).ok());
  EXPECT_EQ(ToHost<float>(dp.data(), kN), p);
  EXPECT_EQ(ToHost<float>(dm.data(), kN), m);
  EXPECT_EQ(ToHost<float>(dv.data(), kN), v);
  // Finite: clipped (norm ~ sqrt(kN)/4 >> 1) like the CPU AdamStep.
  ZO_ASSERT_CUDA(cudaMemcpy(dg.as<float>() + 77, &g[77], 4, cudaMemcpyHostToDevice));
  ASSERT_TRUE(gpu::MultiTensorGradNorm({&span, 1}, DType::kFp32, *workspace, nullptr).ok());
  ASSERT_TRUE(gpu::GpuAdam({&tensor, 1}, step, nullptr).ok());
  AdamShard shard;
  shard.params = p.data();
  shard.n = kN;
  shard.m = m.data();
  shard.v = v.data();
  shard.grads = g.data();
  auto cpu = AdamStep({&shard, 1}, step.hyper, step.loss_scale, step.max_grad_norm);
  ASSERT_TRUE(cpu.ok());
  ASSERT_LT(cpu->clip_coef, 0.1f);
  const auto gp = ToHost<float>(dp.data(), kN);
  for (size_t i = 0; i < kN; ++i) ASSERT_LE(UlpDistance(gp[i], p[i]), 2) << i;
}

TEST(GpuAdamStepTest, RejectsBadArguments) {
  ZO_SKIP_WITHOUT_GPU();
  gpu::GpuAdamStep step;
  step.hyper.step = 0;
  EXPECT_EQ(gpu::GpuAdam({}, step, nullptr).code(), StatusCode::kInvalidArgument);
  step.hyper.step = 1;
  const gpu::GpuAdamTensor missing{nullptr, nullptr, nullptr, nullptr, nullptr, 5};
  EXPECT_EQ(gpu::GpuAdam({&missing, 1}, step, nullptr).code(), StatusCode::kInvalidArgument);
  step.hyper.rule = UpdateRule::kLion;  // the GPU runs Adam/AdamW only
  const Status lion = gpu::GpuAdam({}, step, nullptr);
  EXPECT_EQ(lion.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(lion.message().find("lion"), std::string::npos) << lion;
}

}  // namespace
}  // namespace zoffload::internal
