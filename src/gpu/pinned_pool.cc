#include "gpu/pinned_pool.h"

#include <sys/resource.h>

#include <cuda_runtime_api.h>

#include <bit>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "common/log.h"
#include "common/strings.h"
#include "common/topology.h"
#include "gpu/cuda_status.h"
#include "gpu/gpu_info.h"

namespace zoffload::internal {

// Lets this thread make CUDA calls that are "potentially unsafe" during stream capture
// (pinned allocation), for the lifetime of the guard.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

struct PinnedPoolState {
  std::mutex mu;
  uint64_t budget = 0;
  uint64_t in_use = 0;  // handed out + registered
  uint64_t cached = 0;
  std::multimap<size_t, std::byte*> cache;  // block size -> block
  int numa_node = -1;
  std::optional<Topology> topology;  // set when buffers are bound to numa_node

  ~PinnedPoolState() { FreeCachedLocked(cached); }

  // Frees cached blocks, largest first, until at least `bytes` are freed or none are left.
  void FreeCachedLocked(uint64_t bytes) {
    RelaxedCaptureMode relaxed;
    uint64_t freed = 0;
    while (freed < bytes && !cache.empty()) {
      auto it = std::prev(cache.end());
      const cudaError_t err = cudaFreeHost(it->second);
      if (err != cudaSuccess) {
        Log(LogLevel::kWarning, StrCat("cudaFreeHost: ", cudaGetErrorString(err)));
      }
      freed += it->first;
      cached -= it->first;
      cache.erase(it);
    }
  }

  void Release(std::byte* data, size_t block) {
    std::lock_guard lock(mu);
    in_use -= block;
    cache.emplace(block, data);
    cached += block;
  }

  void Unregister(void* data, size_t bytes) {
    const cudaError_t err = cudaHostUnregister(data);
    if (err != cudaSuccess) {
      Log(LogLevel::kWarning, StrCat("cudaHostUnregister: ", cudaGetErrorString(err)));
    }
    std::lock_guard lock(mu);
    in_use -= bytes;
  }

  // Reserves `bytes` of budget, dropping cached blocks if that makes room.
  Status ReserveLocked(uint64_t bytes, const char* what) {
    if (in_use + cached + bytes > budget) FreeCachedLocked(in_use + cached + bytes - budget);
    if (in_use + bytes > budget) {
      return ResourceExhaustedError(StrCat("pinned memory budget: cannot ", what, " ",
                                           HumanBytes(bytes), "; ", HumanBytes(in_use),
                                           " in use of a budget of ", HumanBytes(budget)));
    }
    in_use += bytes;
    return Status::Ok();
  }
};

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// Size classes: powers of two from 4 KiB below 2 MiB, multiples of 2 MiB above.
size_t BlockSize(size_t bytes) {
  if (bytes >= kHugePage) return (bytes + kHugePage - 1) / kHugePage * kHugePage;
  return std::max<size_t>(4096, std::bit_ceil(bytes));
}

std::string MemlockLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  return limit.rlim_cur == RLIM_INFINITY ? "unlimited" : HumanBytes(limit.rlim_cur);
}

}  // namespace

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) pool_->Release(data_, block_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : pool_(std::move(other.pool_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      block_(std::exchange(other.block_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    PinnedBuffer dying(std::move(*this));
    pool_ = std::move(other.pool_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    block_ = std::exchange(other.block_, 0);
  }
  return *this;
}

HostRegistration::~HostRegistration() {
  if (data_ != nullptr) pool_->Unregister(data_, size_);
}

HostRegistration::HostRegistration(HostRegistration&& other) noexcept
    : pool_(std::move(other.pool_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    HostRegistration dying(std::move(*this));
    pool_ = std::move(other.pool_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Result<PinnedPool> PinnedPool::Create(const PinnedPoolOptions& options) {
  ZO_ASSIGN_OR_RETURN(const int gpus, UsableGpuCount());
  if (options.device < 0 || options.device >= gpus) {
    return InvalidArgumentError(
        StrCat("pinned pool: GPU ", options.device, " does not exist (", gpus, " GPUs)"));
  }
  auto state = std::make_shared<PinnedPoolState>();
  state->budget = options.budget_bytes;
  auto topology = Topology::Load();
  if (topology.ok() && topology->NumaNodes() > 1) {
    ZO_ASSIGN_OR_RETURN(const std::string bus_id, PciBusIdOf(options.device));
    auto node = topology->NumaNodeOfPciDevice(bus_id);
    if (node.ok()) {
      state->numa_node = *node;
      state->topology = std::move(*topology);
    } else {
      LogOnce(LogLevel::kWarning, "pinned-numa",
              StrCat("pinned pool: NUMA node of GPU ", options.device, " unknown (",
                     node.status().message(), "); buffers use the default memory policy"));
    }
  }
  return PinnedPool(std::move(state));
}

Result<PinnedBuffer> PinnedPool::Allocate(size_t bytes) {
  if (bytes == 0) return PinnedBuffer();
  const size_t block = BlockSize(bytes);
  PinnedPoolState& s = *state_;
  {
    std::lock_guard lock(s.mu);
    auto it = s.cache.find(block);
    if (it != s.cache.end()) {
      std::byte* data = it->second;
      s.cache.erase(it);
      s.cached -= block;
      s.in_use += block;
      return PinnedBuffer(state_, data, bytes, block);
    }
    ZO_RETURN_IF_ERROR(s.ReserveLocked(block, "allocate"));
  }
  void* data = nullptr;
  cudaError_t err;
  {
    RelaxedCaptureMode relaxed;
    if (s.topology) s.topology->BindThisThreadMemoryToNumaNode(s.numa_node).IgnoreError();
    err = cudaHostAlloc(&data, block, cudaHostAllocPortable);
    if (s.topology) s.topology->BindThisThreadMemoryToNumaNode(-1).IgnoreError();
  }
  if (err != cudaSuccess) {
    {
      std::lock_guard lock(s.mu);
      s.in_use -= block;
    }
    return CudaStatus(err, "cudaHostAlloc", __FILE__, __LINE__)
        .WithContext(StrCat("pinned pool: cannot pin ", HumanBytes(block), " (",
                            HumanBytes(in_use_bytes()), " in use, budget ", HumanBytes(s.budget),
                            ", ulimit -l ", MemlockLimit(), ")"));
  }
  return PinnedBuffer(state_, static_cast<std::byte*>(data), bytes, block);
}

Result<HostRegistration> PinnedPool::Register(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) {
    return InvalidArgumentError("pinned pool: cannot register an empty range");
  }
  PinnedPoolState& s = *state_;
  {
    std::lock_guard lock(s.mu);
    ZO_RETURN_IF_ERROR(s.ReserveLocked(bytes, "register"));
  }
  cudaError_t err;
  {
    RelaxedCaptureMode relaxed;
    err = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  }
  if (err != cudaSuccess) {
    {
      std::lock_guard lock(s.mu);
      s.in_use -= bytes;
    }
    return CudaStatus(err, "cudaHostRegister", __FILE__, __LINE__)
        .WithContext(StrCat("pinned pool: cannot register ", HumanBytes(bytes), " at ", data,
                            " (ulimit -l ", MemlockLimit(), ")"));
  }
  return HostRegistration(state_, data, bytes);
}

uint64_t PinnedPool::budget_bytes() const { return state_->budget; }

uint64_t PinnedPool::in_use_bytes() const {
  std::lock_guard lock(state_->mu);
  return state_->in_use;
}

uint64_t PinnedPool::cached_bytes() const {
  std::lock_guard lock(state_->mu);
  return state_->cached;
}

int PinnedPool::numa_node() const { return state_->numa_node; }

void PinnedPool::Trim() {
  std::lock_guard lock(state_->mu);
  state_->FreeCachedLocked(state_->cached);
}

}  // namespace zoffload::internal
