// One conformance suite for every tier of the TensorStore (gpu only with a GPU), then the
// NVMe tier's cache: budget, next-use eviction, write-back, persistence.
#include "zoffload/tensor_store.h"

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "build_info.h"
#include "common/strings.h"
#include "swap/fault_backend.h"
#include "test_util.h"
#include "tiers/runtime_context.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal {
namespace {

using testing::TempDir;

std::vector<std::byte> Pattern(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Copies between the caller and a lease's memory, wherever it is.
void Put(const Lease& lease, const std::vector<std::byte>& data) {
#if ZO_HAVE_CUDA
  if (lease.where() == Tier::kGpu) {
    ASSERT_EQ(cudaMemcpy(lease.data(), data.data(), data.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    return;
  }
#endif
  std::memcpy(lease.data(), data.data(), data.size());
}
std::vector<std::byte> Get(const Lease& lease) {
  std::vector<std::byte> out(lease.size());
#if ZO_HAVE_CUDA
  if (lease.where() == Tier::kGpu) {
    EXPECT_EQ(cudaMemcpy(out.data(), lease.data(), out.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }
#endif
  std::memcpy(out.data(), lease.data(), out.size());
  return out;
}

// A TensorStore in a runtime context of its own (closed after the store).
struct StoreUnderTest {
  std::unique_ptr<RuntimeContext> context;
  std::unique_ptr<TensorStore> store;
  TensorStore* operator->() const { return store.get(); }
  TensorStore& operator*() const { return *store; }
  void reset() {
    store.reset();
    context.reset();
  }
};

Result<StoreUnderTest> OpenStore(const RuntimeOptions& options, StoreOptions store = {},
                                 WrapBackend wrap_backend = nullptr) {
  StoreUnderTest s;
  ZO_ASSIGN_OR_RETURN(s.context, RuntimeAccess::Create(options, std::move(wrap_backend)));
  ZO_ASSIGN_OR_RETURN(s.store, TensorStore::Open(*s.context, store));
  return s;
}

class TierConformance : public ::testing::TestWithParam<Tier> {
 protected:
  void SetUp() override {
    if (GetParam() == Tier::kGpu) {
#if ZO_HAVE_CUDA
      if (auto n = UsableGpuCount(); !n.ok()) GTEST_SKIP() << n.status().message();
#else
      GTEST_SKIP() << "this build has no CUDA";
#endif
    }
    options_.nvme_paths = {dir_.path()};
    options_.aio.block_size = 64 << 10;
    options_.host_budget_bytes = 64 << 20;
    options_.gpu_budget_bytes = 64 << 20;
  }
  TempDir dir_;
  RuntimeOptions options_;
};

TEST_P(TierConformance, WhatIsWrittenIsReadBack) {
  auto store = OpenStore(options_);
  ASSERT_TRUE(store.ok()) << store.status();
  const Tier tier = GetParam();
  for (uint64_t n : {uint64_t{1}, uint64_t{4095}, uint64_t{65536}, uint64_t{(1 << 20) + 3}}) {
    const std::string key = StrCat("t", n);
    ASSERT_TRUE((*store)->Register(key, DType::kBf16, n, tier).ok());
    const auto data = Pattern(2 * n, static_cast<uint32_t>(n));
    {
      auto lease = (*store)->Acquire(key, Access::kWrite).Get();
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(lease->size(), 2 * n);
      EXPECT_EQ(lease->elements(), n);
      EXPECT_EQ(lease->dtype(), DType::kBf16);
      EXPECT_EQ(lease->where(), tier == Tier::kGpu ? Tier::kGpu : Tier::kHost);
      Put(*lease, data);
    }
    ASSERT_TRUE((*store)->Flush().ok());
    auto lease = (*store)->Acquire(key, Access::kRead).Get();
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(Get(*lease), data) << n;
  }
}

TEST_P(TierConformance, FreshTensorsReadAsZeros) {
  auto store = OpenStore(options_);
  ASSERT_TRUE(store.ok());
  if (GetParam() == Tier::kGpu) GTEST_SKIP() << "device memory is not zeroed by the store";
  ASSERT_TRUE((*store)->Register("z", DType::kFp32, 1000, GetParam()).ok());
  auto lease = (*store)->Acquire("z", Access::kRead).Get();
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(Get(*lease), std::vector<std::byte>(4000));
}

TEST_P(TierConformance, BadRequestsAreClearErrors) {
  auto store = OpenStore(options_);
  ASSERT_TRUE(store.ok());
  const Tier tier = GetParam();
  EXPECT_EQ((*store)->Acquire("missing", Access::kRead).Get().status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ((*store)->Register("", DType::kFp32, 5, tier).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*store)->Register("zero", DType::kFp32, 0, tier).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*store)->Register("a", DType::kFp32, 100, tier).ok());
  EXPECT_EQ((*store)->Register("a", DType::kFp32, 100, tier).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ((*store)->Acquire("a", Access::kRead, Tier::kNvme).Get().status().code(),
            StatusCode::kInvalidArgument);
  {
    auto lease = (*store)->Acquire("a", Access::kRead).Get();
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ((*store)->Unregister("a").code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE((*store)->Unregister("a").ok());
  EXPECT_FALSE((*store)->Contains("a"));
  if (tier != Tier::kNvme) {  // nvme tensors only need disk; the others hit their budget
    const Status over = (*store)->Register("huge", DType::kFp32, uint64_t{17} << 20, tier);
    EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over;
    EXPECT_NE(over.message().find("budget"), std::string::npos) << over;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiers, TierConformance,
                         ::testing::Values(Tier::kHost, Tier::kNvme, Tier::kGpu),
                         [](const ::testing::TestParamInfo<Tier>& param_info) {
                           return std::string(ToString(param_info.param));
                         });

RuntimeOptions NvmeOptions(const std::string& dir, uint64_t budget) {
  RuntimeOptions o;
  o.nvme_paths = {dir};
  o.aio.block_size = 64 << 10;
  o.host_budget_bytes = budget;
  o.pin_host = false;
  return o;
}

// Registers nvme tensors w0.. of 1 MiB each.
void RegisterTensors(TensorStore& store, int tensors) {
  for (int t = 0; t < tensors; ++t) {
    ASSERT_TRUE(store.Register(StrCat("w", t), DType::kFp32, 1 << 18, Tier::kNvme).ok());
  }
}

// `rounds` passes over tensors w0..w(tensors-1): each holds in its first 4 bytes the number of
// passes it has seen, checked and incremented under a read-write lease; `check` runs after
// each access.
void CountPasses(
    TensorStore& store, int tensors, int rounds, const std::function<void()>& check = [] {}) {
  for (int round = 0; round < rounds; ++round) {
    for (int t = 0; t < tensors; ++t) {
      auto lease = store.Acquire(StrCat("w", t), Access::kReadWrite).Get();
      ASSERT_TRUE(lease.ok()) << lease.status();
      uint32_t counter;
      std::memcpy(&counter, lease->data(), 4);
      ASSERT_EQ(counter, static_cast<uint32_t>(round)) << "tensor " << t << " pass " << round;
      ++counter;
      std::memcpy(lease->data(), &counter, 4);
      check();
    }
  }
}

// A fresh store over `options`' directory finds tensors w0.. (1 MiB each) holding `counter`
// in their first 4 bytes.
void ExpectCountersOnDisk(const RuntimeOptions& options, int tensors, uint32_t counter) {
  auto store = OpenStore(options);
  ASSERT_TRUE(store.ok()) << store.status();
  RegisterTensors(**store, tensors);
  for (int t = 0; t < tensors; ++t) {
    auto lease = (*store)->Acquire(StrCat("w", t), Access::kRead).Get();
    ASSERT_TRUE(lease.ok()) << lease.status();
    uint32_t value;
    std::memcpy(&value, lease->data(), 4);
    EXPECT_EQ(value, counter) << "w" << t;
  }
}

// Six 1 MiB tensors used in a repeating order through a cache of three: least-recently-used
// would miss every access; next use (the recorded cycle) keeps two of three hits per cycle.
TEST(TensorStoreNvme, EvictsByNextUseAndWritesBackDirtyTensors) {
  TempDir dir;
  auto store = OpenStore(NvmeOptions(dir.path(), 3 << 20));
  ASSERT_TRUE(store.ok());
  constexpr int kTensors = 6;
  RegisterTensors(**store, kTensors);
  ASSERT_NO_FATAL_FAILURE(CountPasses(**store, kTensors, 4));
  const TensorStore::Stats stats = (*store)->stats();
  EXPECT_LE(stats.host_bytes, uint64_t{3} << 20);
  EXPECT_GT(stats.evictions, 0u);
  // LRU: 24 misses. Next use: the first cycle misses all 6, later ones at most 4 each.
  EXPECT_LE(stats.misses, 6u + 3 * 4) << stats.hits << " hits";
  EXPECT_GE(stats.hits, 3u * 2);
  // Persistence: flushed, a fresh store on the same directory sees step 4's values.
  ASSERT_TRUE((*store)->Flush().ok());
  store->reset();
  ExpectCountersOnDisk(NvmeOptions(dir.path(), 3 << 20), kTensors, 4);
}

// An eviction's write-back runs with the store's mutex released: while one thread waits for a
// slow write, another leases a resident tensor, reads the counters and registers a tensor.
TEST(TensorStoreNvme, NoWaitForAWriteBackHoldsTheStore) {
  TempDir dir;
  const RuntimeOptions o = NvmeOptions(dir.path(), (2 << 20) + 4096);  // a, b and h; not c too
  auto store = OpenStore(
      o, {},
      testing::InjectFaults(std::make_shared<testing::FaultPlan>(std::vector<testing::FaultRule>{
          {IoOp::kWrite, testing::FaultRule::Action::kDelay, 0, -1, 0, 0, 100}})));
  ASSERT_TRUE(store.ok());
  for (const char* k : {"a", "b", "c"}) {
    ASSERT_TRUE((*store)->Register(k, DType::kFp32, 1 << 18, Tier::kNvme).ok());
  }
  ASSERT_TRUE((*store)->Register("h", DType::kFp32, 16, Tier::kHost).ok());
  { ASSERT_TRUE((*store)->Acquire("a", Access::kWrite).Get().ok()); }  // dirty: a write-back
  { ASSERT_TRUE((*store)->Acquire("b", Access::kWrite).Get().ok()); }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::thread evicting([&] {  // "c" needs room: "a" is written back (100 ms per batch)
    EXPECT_TRUE((*store)->Acquire("c", Access::kWrite).Get().ok());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto others = Clock::now();
  {
    auto h = (*store)->Acquire("h", Access::kRead).Get();
    EXPECT_TRUE(h.ok()) << h.status();
  }
  EXPECT_EQ((*store)->stats().evictions, 0u);  // the eviction is still under way
  EXPECT_TRUE((*store)->Contains("b"));
  const double waited = std::chrono::duration<double>(Clock::now() - others).count();
  evicting.join();
  const double evicted = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(evicted, 0.2);  // the write-back was slow...
  EXPECT_LT(waited, 0.1);   // ...and nobody else waited for it
  EXPECT_EQ((*store)->stats().evictions, 1u);
}

TEST(TensorStoreNvme, LeasedTensorsAreNeverEvicted) {
  TempDir dir;
  auto store = OpenStore(NvmeOptions(dir.path(), 2 << 20));
  ASSERT_TRUE(store.ok());
  for (const char* k : {"a", "b", "c"})
    ASSERT_TRUE((*store)->Register(k, DType::kFp32, 1 << 18, Tier::kNvme).ok());
  auto a = (*store)->Acquire("a", Access::kWrite).Get();
  auto b = (*store)->Acquire("b", Access::kWrite).Get();
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = (*store)->Acquire("c", Access::kWrite).Get();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kResourceExhausted) << c.status();
  EXPECT_NE(c.status().message().find("'c'"), std::string::npos) << c.status();
  a->Release();
  auto c2 = (*store)->Acquire("c", Access::kWrite).Get();
  EXPECT_TRUE(c2.ok()) << c2.status();
}

// The NVMe cache's own cap (StoreOptions::nvme_cache_bytes) holds below a larger host budget:
// host tensors do not count against it, the cached copies are evicted by it (and written back),
// and a tensor it cannot hold even when empty is a clear error naming the cap.
TEST(TensorStoreNvme, TheCacheCapHoldsUnderALargerBudget) {
  TempDir dir;
  auto store = OpenStore(NvmeOptions(dir.path(), 64 << 20), {.nvme_cache_bytes = 2 << 20});
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Register("host", DType::kFp32, 1 << 20, Tier::kHost).ok());  // 4 MiB
  RegisterTensors(**store, 4);  // four 1 MiB nvme tensors
  ASSERT_NO_FATAL_FAILURE(CountPasses(**store, 4, 3, [&] {
    EXPECT_LE((*store)->stats().host_bytes, (uint64_t{4} << 20) + (uint64_t{2} << 20));
  }));
  EXPECT_GT((*store)->stats().evictions, 0u);
  EXPECT_GT((*store)->stats().bytes_written, 0u);
  ASSERT_TRUE((*store)->Register("big", DType::kFp32, 3 << 18, Tier::kNvme).ok());  // 3 MiB
  auto big = (*store)->Acquire("big", Access::kWrite).Get();
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("host cache of NVMe tensors (2.00 MiB"), std::string::npos)
      << big.status();
  // A full cache of prefetches still being read makes room once they are in (never fails).
  for (int round = 0; round < 5; ++round) {
    (*store)->Prefetch("w0");
    (*store)->Prefetch("w1");
    auto lease = (*store)->Acquire(StrCat("w", 2 + round % 2), Access::kRead).Get();
    ASSERT_TRUE(lease.ok()) << lease.status();
  }
}

TEST(TensorStoreNvme, PrefetchLoadsAheadAndNoNvmePathIsAClearError) {
  TempDir dir;
  auto store = OpenStore(NvmeOptions(dir.path(), 8 << 20));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Register("p", DType::kBf16, 1 << 19, Tier::kNvme).ok());
  {
    auto lease = (*store)->Acquire("p", Access::kWrite).Get();
    ASSERT_TRUE(lease.ok());
    std::memset(lease->data(), 7, 1 << 20);
  }
  ASSERT_TRUE((*store)->Flush().ok());
  (*store)->Prefetch("p");
  auto future = (*store)->Acquire("p", Access::kRead);
  auto lease = future.Get();
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->data()[12345], std::byte{7});
  EXPECT_GE((*store)->stats().hits, 1u);
  RuntimeOptions no_nvme;
  no_nvme.pin_host = false;
  auto bare = OpenStore(no_nvme);
  ASSERT_TRUE(bare.ok());
  const Status s = (*bare)->Register("x", DType::kFp32, 10, Tier::kNvme);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("nvme_paths"), std::string::npos) << s;
}

TEST(TensorStore, PlacementFollowsTheConfig) {
  auto none = ParseConfig(R"({"zero_optimization": {"stage": 2}})");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(PlacementFor(TensorRole::kParameter, *none), Tier::kGpu);
  EXPECT_EQ(PlacementFor(TensorRole::kGradient, *none), Tier::kGpu);
  EXPECT_EQ(PlacementFor(TensorRole::kOptimizerState, *none), Tier::kGpu);
  auto infinity = ParseConfig(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
      "offload_param": {"device": "cpu"}}})");
  ASSERT_TRUE(infinity.ok()) << infinity.status();
  EXPECT_EQ(PlacementFor(TensorRole::kParameter, *infinity), Tier::kHost);
  EXPECT_EQ(PlacementFor(TensorRole::kGradient, *infinity), Tier::kHost);
  EXPECT_EQ(PlacementFor(TensorRole::kOptimizerState, *infinity), Tier::kNvme);
}

// ---- GPU residency: host and nvme tensors leased in device memory ---------------------------

class TensorStoreGpu : public ::testing::Test {
 protected:
  void SetUp() override {
#if ZO_HAVE_CUDA
    if (auto n = UsableGpuCount(); !n.ok()) GTEST_SKIP() << n.status().message();
#else
    GTEST_SKIP() << "this build has no CUDA";
#endif
  }
  TempDir dir_;
};

// Each home, with pinned host copies (direct DMA) and pageable ones (staged copies): a change
// made on the host is seen on the GPU, a change made on the GPU comes back to the host and,
// for nvme tensors, to disk.
TEST_F(TensorStoreGpu, HostAndNvmeTensorsMoveToTheGpuAndBack) {
  constexpr uint64_t kElements = 300001;
  for (Tier home : {Tier::kHost, Tier::kNvme}) {
    for (bool pinned : {true, false}) {
      SCOPED_TRACE(StrCat(ToString(home), pinned ? " pinned" : " pageable"));
      const std::string key = StrCat(ToString(home), pinned ? "-pinned" : "-pageable");
      RuntimeOptions o = NvmeOptions(dir_.path(), 0);
      o.pin_host = pinned;
      auto store = OpenStore(o);
      ASSERT_TRUE(store.ok()) << store.status();
      ASSERT_TRUE((*store)->Register(key, DType::kFp32, kElements, home).ok());
      const auto a = Pattern(4 * kElements, 1), b = Pattern(4 * kElements, 2);
      {
        auto lease = (*store)->Acquire(key, Access::kWrite).Get();
        ASSERT_TRUE(lease.ok()) << lease.status();
        Put(*lease, a);
      }
      {
        auto on_gpu = (*store)->Acquire(key, Access::kRead, Tier::kGpu).Get();
        ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
        EXPECT_EQ(on_gpu->where(), Tier::kGpu);
        EXPECT_EQ(Get(*on_gpu), a);
        auto on_host = (*store)->Acquire(key, Access::kRead).Get();  // readers may share
        ASSERT_TRUE(on_host.ok()) << on_host.status();
        EXPECT_EQ(Get(*on_host), a);
        const Status writer = (*store)->Acquire(key, Access::kReadWrite).Get().status();
        EXPECT_EQ(writer.code(), StatusCode::kFailedPrecondition) << writer;
      }
      {
        auto on_gpu = (*store)->Acquire(key, Access::kReadWrite, Tier::kGpu).Get();
        ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
        Put(*on_gpu, b);
      }
      {
        auto on_host = (*store)->Acquire(key, Access::kRead).Get();
        ASSERT_TRUE(on_host.ok()) << on_host.status();
        EXPECT_EQ(Get(*on_host), b);
      }
      const TensorStore::Stats stats = (*store)->stats();
      EXPECT_EQ(stats.bytes_to_gpu, 4 * kElements);  // the second GPU lease hit the copy
      EXPECT_EQ(stats.bytes_from_gpu, 4 * kElements);
      EXPECT_EQ(stats.gpu_hits, 1u);
      ASSERT_TRUE((*store)->Flush().ok());
      if (home != Tier::kNvme) continue;
      store->reset();
      auto again = OpenStore(o);
      ASSERT_TRUE(again.ok());
      ASSERT_TRUE((*again)->Register(key, DType::kFp32, kElements, home).ok());
      auto lease = (*again)->Acquire(key, Access::kRead, Tier::kGpu).Get();
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(Get(*lease), b);
    }
  }
  auto store = OpenStore(NvmeOptions(dir_.path(), 0));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Register("g", DType::kBf16, 10, Tier::kGpu).ok());
  const Status s = (*store)->Acquire("g", Access::kRead, Tier::kHost).Get().status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
}

// Prefetch to the GPU of an nvme tensor with a pinned host copy is a pipeline of its own: the
// upload starts when the read completes, so the lease is ready without anyone calling Get.
TEST_F(TensorStoreGpu, PrefetchToTheGpuUploadsWhenTheReadCompletes) {
  RuntimeOptions o = NvmeOptions(dir_.path(), 0);
  o.pin_host = true;
  auto store = OpenStore(o);
  ASSERT_TRUE(store.ok());
  constexpr uint64_t kElements = 1 << 20;
  ASSERT_TRUE((*store)->Register("w", DType::kFp32, kElements, Tier::kNvme).ok());
  const auto data = Pattern(4 * kElements, 9);
  {
    auto lease = (*store)->Acquire("w", Access::kWrite).Get();
    ASSERT_TRUE(lease.ok());
    Put(*lease, data);
  }
  ASSERT_TRUE((*store)->Flush().ok());
  store->reset();
  store = OpenStore(o);  // a cold cache: the tensor is only on disk
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Register("w", DType::kFp32, kElements, Tier::kNvme).ok());
  (*store)->Prefetch("w", Tier::kGpu);
  Future<Lease> future = (*store)->Acquire("w", Access::kRead, Tier::kGpu);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!future.Ready() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(future.Ready()) << "the upload waited for Get";
  auto lease = future.Get();
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(Get(*lease), data);
  const TensorStore::Stats stats = (*store)->stats();
  EXPECT_EQ(stats.bytes_read, 4 * kElements);
  EXPECT_EQ(stats.bytes_to_gpu, 4 * kElements);
  EXPECT_EQ(stats.gpu_hits, 1u);  // the prefetch made the copy; the acquisition found it
}

// Six 1 MiB nvme tensors updated on the GPU in a repeating order, with room for three GPU
// copies and four host copies: GPU copies are evicted by next use, their changes go down to
// the host copies and, when those are evicted, to disk.
TEST_F(TensorStoreGpu, GpuCopiesAreEvictedByNextUseAndWrittenBack) {
  RuntimeOptions o = NvmeOptions(dir_.path(), 4 << 20);
  o.gpu_budget_bytes = 3 << 20;
  auto store = OpenStore(o);
  ASSERT_TRUE(store.ok());
  constexpr int kTensors = 6;
  RegisterTensors(**store, kTensors);
  for (int step = 0; step < 4; ++step) {
    for (int t = 0; t < kTensors; ++t) {
      auto lease = (*store)->Acquire(StrCat("w", t), Access::kReadWrite, Tier::kGpu).Get();
      ASSERT_TRUE(lease.ok()) << lease.status();
      std::vector<std::byte> data = Get(*lease);
      uint32_t counter;
      std::memcpy(&counter, data.data(), 4);
      ASSERT_EQ(counter, static_cast<uint32_t>(step)) << "tensor " << t << " step " << step;
      ++counter;
      std::memcpy(data.data(), &counter, 4);
      Put(*lease, data);
    }
  }
  const TensorStore::Stats stats = (*store)->stats();
  EXPECT_LE(stats.gpu_bytes, uint64_t{3} << 20);
  EXPECT_LE(stats.host_bytes, uint64_t{4} << 20);
  EXPECT_GT(stats.gpu_evictions, 0u);
  EXPECT_GE(stats.gpu_hits, 3u * 2) << stats.gpu_misses << " misses";
  ASSERT_TRUE((*store)->Flush().ok());
  store->reset();
  ExpectCountersOnDisk(o, kTensors, 4);
}

// Without a GPU a GPU lease is a clear error, and the tensor stays usable on the host.
TEST(TensorStore, GpuLeaseWithoutGpuIsAClearError) {
#if ZO_HAVE_CUDA
  if (UsableGpuCount().ok()) GTEST_SKIP() << "a GPU is present";
#endif
  TempDir dir;
  auto store = OpenStore(NvmeOptions(dir.path(), 0));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->Register("h", DType::kFp32, 100, Tier::kHost).ok());
  {
    auto lease = (*store)->Acquire("h", Access::kWrite).Get();
    ASSERT_TRUE(lease.ok());
    std::memset(lease->data(), 5, lease->size());
  }
  const Status s = (*store)->Acquire("h", Access::kRead, Tier::kGpu).Get().status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("GPU"), std::string::npos) << s;
  auto lease = (*store)->Acquire("h", Access::kRead).Get();
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->data()[399], std::byte{5});
  EXPECT_EQ((*store)->stats().gpu_bytes, 0u);
}

}  // namespace
}  // namespace zoffload::internal
