#include "tiers/optimizer_state.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "swap/fault_backend.h"
#include "test_util.h"

namespace zoffload::internal {
namespace {

using testing::FaultPlan;
using testing::FaultRule;
using testing::InjectFaults;
using testing::TempDir;

constexpr uint64_t kChunk = 16384;
const std::vector<uint64_t> kSizes = {1, 1000, kChunk, kChunk + 1, 3 * kChunk + 777};

uint16_t Bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The same tensors in plain memory, updated by AdamUpdate over each whole tensor.
struct Reference {
  std::vector<std::vector<float>> params;
  std::vector<std::vector<std::byte>> m, v;
  std::vector<std::vector<uint16_t>> copy;
  Reference(StatePrecision precision, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint64_t n : kSizes) {
      std::vector<float> p(n);
      for (float& x : p) x = normal(rng);
      params.push_back(std::move(p));
      m.emplace_back(AdamMomentBytes(precision, n));
      v.emplace_back(AdamMomentBytes(precision, n));
      copy.emplace_back(n);
    }
  }
};

std::vector<std::vector<uint16_t>> RandomGrads(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<std::vector<uint16_t>> grads;
  for (uint64_t n : kSizes) {
    std::vector<uint16_t> g(n);
    for (uint16_t& x : g) x = Bf16(normal(rng));
    grads.push_back(std::move(g));
  }
  return grads;
}

std::vector<OptimizerTensor> Tensors() {
  std::vector<OptimizerTensor> tensors;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    tensors.push_back({"layer" + std::to_string(i) + ".weight", kSizes[i]});
  }
  return tensors;
}

// The state's options and those of the runtime context it is made in.
struct TestOptions {
  OptimizerStateOptions state;
  RuntimeOptions runtime;
  WrapBackend wrap_backend;  // faults at the I/O seam
};

TestOptions Options(StateHome home, StatePrecision precision, const std::string& dir) {
  TestOptions o;
  o.state.home = home;
  o.state.precision = precision;
  o.state.pipeline.chunk_elements = kChunk;
  o.state.threads = 2;
  o.runtime.nvme_paths = {dir};
  o.runtime.aio.block_size = 64 << 10;
  return o;
}

// An OptimizerState in a runtime context of its own (closed after the state).
struct StateUnderTest {
  std::unique_ptr<RuntimeContext> context;
  std::unique_ptr<OptimizerState> state;
  OptimizerState* operator->() const { return state.get(); }
  void reset() {
    state.reset();
    context.reset();
  }
};

Result<StateUnderTest> Make(std::vector<OptimizerTensor> tensors, const TestOptions& o) {
  StateUnderTest s;
  ZO_ASSIGN_OR_RETURN(s.context, RuntimeAccess::Create(o.runtime, o.wrap_backend));
  ZO_ASSIGN_OR_RETURN(s.state, OptimizerState::Create(std::move(tensors), *s.context, o.state));
  return s;
}

struct Variant {
  StateHome home;
  StatePrecision precision;
  PipelineOptions pipeline;
  double offload_ratio = 1.0;  ///< home nvme: the rest of the tensors stay in host memory
};

std::string Name(const ::testing::TestParamInfo<Variant>& info) {
  const Variant& v = info.param;
  return StrCat(
      v.home == StateHome::kHost ? "host_" : "nvme_", ToString(v.precision), "_b",
      v.pipeline.buffers, v.pipeline.overlap_read ? "_r" : "", v.pipeline.overlap_write ? "_w" : "",
      v.offload_ratio < 1 ? StrCat("_ratio", static_cast<int>(100 * v.offload_ratio)) : "");
}

class OptimizerStateTest : public ::testing::TestWithParam<Variant> {};

// Three steps through the store equal three whole-tensor AdamUpdates in memory, bit for bit:
// parameters, both moments and the bf16 copy, for every precision and pipeline shape.
TEST_P(OptimizerStateTest, StepsAreBitIdenticalToInMemoryAdam) {
  const Variant variant = GetParam();
  TempDir dir;
  TestOptions o = Options(variant.home, variant.precision, dir.path());
  o.state.pipeline.buffers = variant.pipeline.buffers;
  o.state.pipeline.overlap_read = variant.pipeline.overlap_read;
  o.state.pipeline.overlap_write = variant.pipeline.overlap_write;
  o.state.offload_ratio = variant.offload_ratio;
  o.runtime.trace_path = dir.File("trace.json");
  auto state = Make(Tensors(), o);
  ASSERT_TRUE(state.ok()) << state.status();
  Reference ref(variant.precision, 1);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const Status init = (*state)->Write(i, ref.params[i].data());
    ASSERT_TRUE(init.ok()) << init;
  }
  std::vector<std::vector<uint16_t>> copies;
  for (uint64_t n : kSizes) copies.emplace_back(n, 0xFFFF);
  AdamHyper hyper;
  hyper.lr = 1e-2f;
  hyper.weight_decay = 0.1f;
  for (int step = 1; step <= 3; ++step) {
    hyper.step = step;
    const auto grads = RandomGrads(100 + step);
    std::vector<TensorGrads> tg;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      tg.push_back({grads[i].data(), DType::kBf16, copies[i].data(), ParamCopy::kBf16});
      AdamShard shard;
      shard.params = ref.params[i].data();
      shard.n = kSizes[i];
      shard.state = variant.precision;
      shard.m = ref.m[i].data();
      shard.v = ref.v[i].data();
      shard.grads = grads[i].data();
      shard.grad_dtype = DType::kBf16;
      shard.param_copy = ref.copy[i].data();
      shard.copy = ParamCopy::kBf16;
      ASSERT_TRUE(AdamUpdate(shard, hyper, 1.0f, 2).ok());
    }
    auto result = (*state)->Step(tg, hyper);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_FALSE(result->skipped);
  }
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> p(kSizes[i]);
    std::vector<std::byte> m(ref.m[i].size()), v(ref.v[i].size());
    ASSERT_TRUE((*state)->Read(i, p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, ref.params[i]) << i;
    EXPECT_EQ(m, ref.m[i]) << i;
    EXPECT_EQ(v, ref.v[i]) << i;
    EXPECT_EQ(copies[i], ref.copy[i]) << i;
  }
  if (variant.home == StateHome::kNvme) {
    const StepStats& stats = (*state)->last_step();
    EXPECT_GT(stats.bytes_read, 0u);
    EXPECT_EQ(stats.bytes_read, stats.bytes_written);
    // Host memory is the pipeline's slots and the host share, not the NVMe share.
    uint64_t host_state = 0, nvme_elements = 0;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      if ((*state)->in_host(i)) {
        host_state += 4 * kSizes[i] + 2 * AdamMomentBytes(variant.precision, kSizes[i]);
      } else {
        nvme_elements += kSizes[i];
      }
    }
    if (variant.offload_ratio < 1) {
      EXPECT_GT(host_state, 0u);
    }
    EXPECT_GT(nvme_elements, 0u);
    EXPECT_LE((*state)->host_bytes(),
              host_state + static_cast<uint64_t>(variant.pipeline.buffers) * 3 * (128 << 10));
  }
  Tracer& tracer = *internal::RuntimeAccess::Of(*state->context).tracer();
  EXPECT_GT(tracer.events(), 0u);
  ASSERT_TRUE(tracer.Write().ok());
  std::ifstream trace(dir.File("trace.json"));
  std::string text((std::istreambuf_iterator<char>(trace)), {});
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
  // The Adam threads' shares; tiles are handed out dynamically, so any thread may take them all.
  EXPECT_NE(text.find("adam thread "), std::string::npos);
  if (variant.home == StateHome::kNvme) {
    EXPECT_NE(text.find("nvme slot 1"), std::string::npos);  // each slot's requests
    EXPECT_NE(text.find("nvme ring 0"), std::string::npos);  // each ring's busy spans
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, OptimizerStateTest,
    ::testing::Values(Variant{StateHome::kHost, StatePrecision::kFp32, {}},
                      Variant{StateHome::kHost, StatePrecision::kInt8, {}},
                      Variant{StateHome::kNvme, StatePrecision::kFp32, {4, true, true, 0}},
                      Variant{StateHome::kNvme, StatePrecision::kBf16, {4, true, true, 0}},
                      Variant{StateHome::kNvme, StatePrecision::kInt8, {3, true, true, 0}},
                      Variant{StateHome::kNvme, StatePrecision::kFp32, {2, false, false, 0}},
                      Variant{StateHome::kNvme, StatePrecision::kFp32, {2, true, false, 0}},
                      Variant{StateHome::kNvme, StatePrecision::kFp32, {2, true, true, 0}},
                      Variant{StateHome::kNvme, StatePrecision::kFp32, {4, true, true, 0}, 0.8},
                      Variant{StateHome::kNvme, StatePrecision::kInt8, {3, true, true, 0}, 0.5}),
    Name);

// The tensors in host memory are updated between the NVMe chunks, so their CPU Adam runs while
// the disk works: the sink sees every chunk once, each tensor's in order, an even share of the
// host chunks before each NVMe chunk. Once one of them is updated, a step whose NVMe part then
// fails leaves the object refusing further steps (its host share is a step ahead).
TEST(OptimizerStateTest, HostShareIsUpdatedBetweenTheNvmeChunks) {
  struct Recorder final : ParamSink {
    std::vector<std::pair<size_t, uint64_t>> ends;
    std::vector<uint16_t> copy = std::vector<uint16_t>(kChunk);
    Result<void*> Begin(size_t, uint64_t, uint64_t) override {
      return static_cast<void*>(copy.data());
    }
    Status End(size_t t, uint64_t first, uint64_t, const float*) override {
      ends.emplace_back(t, first);
      return Status::Ok();
    }
  };
  TempDir dir;
  TestOptions o = Options(StateHome::kNvme, StatePrecision::kFp32, dir.path());
  o.state.offload_ratio = 0.5;  // layers 0-3 (5 chunks) in host memory, layer 4 (4) on NVMe
  auto state = Make(Tensors(), o);
  ASSERT_TRUE(state.ok()) << state.status();
  Reference ref(StatePrecision::kFp32, 4);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    EXPECT_EQ((*state)->in_host(i), i < 4) << i;
    ASSERT_TRUE((*state)->Write(i, ref.params[i].data()).ok());
  }
  const auto grads = RandomGrads(5);
  std::vector<TensorGrads> tg;
  for (const auto& g : grads) tg.push_back({g.data(), DType::kBf16, nullptr, ParamCopy::kBf16});
  Recorder sink;
  auto step = (*state)->Step(tg, AdamHyper{}, 1.0f, 0.0f, &sink);
  ASSERT_TRUE(step.ok()) << step.status();
  const std::vector<std::pair<size_t, uint64_t>> expected = {
      {0, 0}, {1, 0},          {4, 0},      {2, 0},         {4, kChunk},
      {3, 0}, {4, 2 * kChunk}, {3, kChunk}, {4, 3 * kChunk}};
  EXPECT_EQ(sink.ends, expected);

  state->reset();
  o.wrap_backend = InjectFaults(std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kRead, FaultRule::Action::kFail, 0, -1, EIO}}));
  state = Make(Tensors(), o);
  ASSERT_TRUE(state.ok()) << state.status();
  auto failed = (*state)->Step(tg, AdamHyper{}, 1.0f, 0.0f, &sink);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status();
  auto refused = (*state)->Step(tg, AdamHyper{}, 1.0f, 0.0f, &sink);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("failed midway"), std::string::npos)
      << refused.status();
}

TEST(OptimizerStateFaults, OverflowSkipsWithoutWriting) {
  TempDir dir;
  auto plan = std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kWrite, FaultRule::Action::kFail, 0, -1, EIO}});
  TestOptions o = Options(StateHome::kNvme, StatePrecision::kFp32, dir.path());
  auto state = Make(Tensors(), o);
  ASSERT_TRUE(state.ok()) << state.status();
  Reference ref(StatePrecision::kFp32, 3);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    ASSERT_TRUE((*state)->Write(i, ref.params[i].data()).ok());
  }
  state->reset();
  o.wrap_backend = InjectFaults(plan);  // from now on every write would fail
  state = Make(Tensors(), o);
  ASSERT_TRUE(state.ok()) << state.status();
  auto grads = RandomGrads(7);
  grads[2][5] = 0x7FC0;  // bf16 NaN
  std::vector<TensorGrads> tg;
  for (auto& g : grads) tg.push_back({g.data(), DType::kBf16});
  auto result = (*state)->Step(tg, AdamHyper{});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->skipped);
  EXPECT_EQ(plan->applied(), 0);                // no write was even tried
  for (size_t i = 0; i < kSizes.size(); ++i) {  // and the state is as before
    std::vector<float> p(kSizes[i]);
    std::vector<std::byte> m(AdamMomentBytes(StatePrecision::kFp32, kSizes[i])), v(m.size());
    ASSERT_TRUE((*state)->Read(i, p.data(), m.data(), v.data()).ok());
    EXPECT_EQ(p, ref.params[i]);
  }
}

// The state as Read gives it: params, m and v of every tensor.
std::vector<std::vector<std::byte>> Snapshot(OptimizerState& state) {
  std::vector<std::vector<std::byte>> out;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<std::byte> all(12 * kSizes[i]);
    EXPECT_TRUE(state
                    .Read(i, reinterpret_cast<float*>(all.data()), all.data() + 4 * kSizes[i],
                          all.data() + 8 * kSizes[i])
                    .ok());
    out.push_back(std::move(all));
  }
  return out;
}

// A read error mid-step fails the step naming the tensor and leaves the state as before the
// step (the copy being written is void, the current one untouched): the step can be retried
// and then equals a step that never failed. A flipped bit on disk fails it naming the tensor
// and byte range, every time, and no other tensor.
TEST(OptimizerStateFaults, ReadErrorAndChecksumMismatchLeaveTheStateAsBefore) {
  for (int fault = 0; fault < 2; ++fault) {
    SCOPED_TRACE(fault == 0 ? "read error" : "checksum mismatch");
    TempDir dir;
    Reference ref(StatePrecision::kFp32, 3);
    std::vector<std::vector<std::byte>> before;
    const auto grads = RandomGrads(11);
    std::vector<TensorGrads> tg;
    for (const auto& g : grads) tg.push_back({g.data(), DType::kBf16});
    {
      TestOptions o = Options(StateHome::kNvme, StatePrecision::kFp32, dir.path());
      if (fault == 0) {
        o.wrap_backend = InjectFaults(std::make_shared<FaultPlan>(
            std::vector<FaultRule>{{IoOp::kRead, FaultRule::Action::kFail, 9, 1, EIO}}));
      }
      auto state = Make(Tensors(), o);
      ASSERT_TRUE(state.ok()) << state.status();
      for (size_t i = 0; i < kSizes.size(); ++i) {
        ASSERT_TRUE((*state)->Write(i, ref.params[i].data()).ok());
      }
      if (fault == 1) {  // flip one byte of layer4's m, in its first chunk, in the current copy
        // Each chunk is its params, m and v images, each padded to 64 KiB blocks: layers 0..2
        // take 3 blocks each, layer 3 twice 3; layer 4's first m image starts at block 16.
        bool flipped = false;
        for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
          const std::string file = entry.path().filename().string();
          if (!file.ends_with(".a.s0.zoswap")) continue;
          std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
          f.seekg(16 * 65536 + 1000);
          const char old_byte = static_cast<char>(f.get());
          f.seekp(16 * 65536 + 1000);
          f.put(static_cast<char>(old_byte ^ 0x5A));
          flipped = true;
        }
        ASSERT_TRUE(flipped);
      }
      for (size_t i = 0; i < kSizes.size() && fault == 0; ++i) {  // as initialized
        std::vector<std::byte> all(12 * kSizes[i], std::byte{0});
        std::memcpy(all.data(), ref.params[i].data(), 4 * kSizes[i]);
        before.push_back(std::move(all));
      }
      AdamHyper hyper;
      auto result = (*state)->Step(tg, hyper);
      ASSERT_FALSE(result.ok());
      EXPECT_EQ(result.status().code(), fault == 0 ? StatusCode::kIoError : StatusCode::kDataLoss)
          << result.status();
      EXPECT_NE(result.status().message().find("reading 'layer"), std::string::npos)
          << result.status();
      if (fault == 1) {
        EXPECT_NE(result.status().message().find("reading 'layer4.weight' elements [0, 16384)"),
                  std::string::npos)
            << result.status();
        EXPECT_NE(result.status().message().find("checksum"), std::string::npos) << result.status();
        // The flipped tensor stays unreadable; the others read as initialized.
        for (size_t i = 0; i < kSizes.size(); ++i) {
          std::vector<float> p(kSizes[i]);
          std::vector<std::byte> m(4 * kSizes[i]), v(m.size());
          const Status read = (*state)->Read(i, p.data(), m.data(), v.data());
          EXPECT_EQ(read.ok(), i != 4) << i << ": " << read;
          if (i != 4) {
            EXPECT_EQ(p, ref.params[i]);
          }
        }
        EXPECT_FALSE((*state)->Step(tg, hyper).ok());
        continue;
      }
      EXPECT_EQ(Snapshot(*state->state), before);  // as before the step
      auto again = (*state)->Step(tg, hyper);      // the fault was transient
      ASSERT_TRUE(again.ok()) << again.status();
    }
    // Reopened, the retried step is there, equal to one step in memory.
    auto reopened = Make(Tensors(), Options(StateHome::kNvme, StatePrecision::kFp32, dir.path()));
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      AdamShard shard;
      shard.params = ref.params[i].data();
      shard.n = kSizes[i];
      shard.m = ref.m[i].data();
      shard.v = ref.v[i].data();
      shard.grads = grads[i].data();
      shard.grad_dtype = DType::kBf16;
      ASSERT_TRUE(AdamUpdate(shard, AdamHyper{}, 1.0f, 2).ok());
      std::vector<float> p(kSizes[i]);
      std::vector<std::byte> m(ref.m[i].size()), v(m.size());
      ASSERT_TRUE((*reopened)->Read(i, p.data(), m.data(), v.data()).ok());
      EXPECT_EQ(p, ref.params[i]) << i;
      EXPECT_EQ(m, ref.m[i]) << i;
    }
  }
}

// A process killed in the middle of a step loses that step only: reopened, the state is the
// one before it, bit for bit.
TEST(OptimizerStateFaults, KilledMidStepLosesOnlyThatStep) {
  TempDir dir;
  Reference ref(StatePrecision::kFp32, 5);
  std::vector<std::vector<std::byte>> before;
  {
    auto state = Make(Tensors(), Options(StateHome::kNvme, StatePrecision::kFp32, dir.path()));
    ASSERT_TRUE(state.ok()) << state.status();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      ASSERT_TRUE((*state)->Write(i, ref.params[i].data()).ok());
    }
    before = Snapshot(*state->state);
  }
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    TestOptions o = Options(StateHome::kNvme, StatePrecision::kFp32, dir.path());
    o.state.threads = 1;  // libgomp's thread pool does not survive fork(); one thread needs none
    o.wrap_backend = InjectFaults(std::make_shared<FaultPlan>(
        std::vector<FaultRule>{{IoOp::kWrite, FaultRule::Action::kDelay, 0, -1, 0, 0, 200}}));
    auto state = Make(Tensors(), o);
    if (!state.ok()) ::_exit(3);
    const auto grads = RandomGrads(13);
    std::vector<TensorGrads> tg;
    for (const auto& g : grads) tg.push_back({g.data(), DType::kBf16});
    if (::write(ready[1], "r", 1) != 1) ::_exit(5);
    (*state)->Step(tg, AdamHyper{}).status().IgnoreError();  // slow: every write delayed
    ::_exit(4);
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::usleep(300 * 1000);
  ::kill(child, SIGKILL);
  int status;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child finished its step before the kill";
  auto reopened = Make(Tensors(), Options(StateHome::kNvme, StatePrecision::kFp32, dir.path()));
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ(Snapshot(*reopened->state), before);
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(OptimizerStateTest, RejectsBadInput) {
  TempDir dir;
  EXPECT_EQ(Make({{"a", 5}, {"a", 6}}, Options(StateHome::kHost, StatePrecision::kFp32, dir.path()))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Make({{"a", 0}}, Options(StateHome::kHost, StatePrecision::kFp32, dir.path()))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  TestOptions one = Options(StateHome::kNvme, StatePrecision::kFp32, dir.path());
  one.state.pipeline.buffers = 1;
  auto refused = Make({{"a", 5}}, one);
  EXPECT_NE(refused.status().message().find("buffer_count"), std::string::npos) << refused.status();
  auto missing =
      Make({{"a", 5}}, Options(StateHome::kNvme, StatePrecision::kFp32, dir.File("nope")));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status();
  auto host = Make({{"a", 5}}, Options(StateHome::kHost, StatePrecision::kFp32, dir.path()));
  ASSERT_TRUE(host.ok());
  std::vector<uint16_t> g(5);
  std::vector<TensorGrads> two(2, TensorGrads{g.data(), DType::kBf16});
  EXPECT_EQ((*host)->Step(two, AdamHyper{}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoffload::internal
