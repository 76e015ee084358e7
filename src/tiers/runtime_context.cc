#include "tiers/runtime_context.h"

#include <limits>
#include <utility>

#include "common/log.h"
#include "common/strings.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "gpu/cuda_status.h"
#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal {

// ---- ByteBudget ---------------------------------------------------------------------------

bool ByteBudget::Fits(uint64_t bytes) const { return limit_ == 0 || used() + bytes <= limit_; }

Status ByteBudget::Reserve(uint64_t bytes, std::string_view what) {
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (limit_ != 0 && used + bytes > limit_) {
      return ResourceExhaustedError(StrCat(name_, " ", HumanBytes(limit_), " cannot hold ", what,
                                           " (", HumanBytes(bytes), "): ", HumanBytes(used),
                                           " already in use"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return Status::Ok();
}

// ---- HostMemory, DeviceMemory -------------------------------------------------------------

HostMemory& HostMemory::operator=(HostMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    aligned_ = std::move(other.aligned_);
#if ZO_HAVE_CUDA
    pinned_ = std::move(other.pinned_);
    registration_ = std::move(other.registration_);
#endif
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    budget_ = std::exchange(other.budget_, nullptr);
  }
  return *this;
}

bool HostMemory::pinned() const {
#if ZO_HAVE_CUDA
  return pinned_.data() != nullptr || registration_.data() != nullptr;
#else
  return false;
#endif
}

void HostMemory::Reset() {
  if (budget_ != nullptr) budget_->Release(size_);
#if ZO_HAVE_CUDA
  registration_ = HostRegistration();
  pinned_ = PinnedBuffer();
#endif
  aligned_ = AlignedBuffer();
  data_ = nullptr;
  size_ = 0;
  budget_ = nullptr;
}

#if ZO_HAVE_CUDA
DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    buffer_ = std::move(other.buffer_);
    budget_ = std::exchange(other.budget_, nullptr);
  }
  return *this;
}

void DeviceMemory::Reset() {
  if (budget_ != nullptr) budget_->Release(buffer_.size());
  buffer_ = DeviceBuffer();
  budget_ = nullptr;
}
#endif

// ---- Runtime ----------------------------------------------------------------------------

Runtime::Runtime(RuntimeOptions options, WrapBackend wrap_backend)
    : options_(std::move(options)),
      wrap_backend_(std::move(wrap_backend)),
      host_("host budget (zoffload.budgets.host_bytes)", options_.host_budget_bytes),
      gpu_("GPU budget (zoffload.budgets.gpu_bytes)", options_.gpu_budget_bytes) {
  if (!options_.trace_path.empty()) tracer_ = std::make_unique<Tracer>(options_.trace_path);
}

Runtime::~Runtime() {
#if ZO_HAVE_CUDA
  copies_.reset();  // its staging buffers go back to the pool first
#endif
  swap_.reset();  // finishes every request in flight before the trace is written
  if (tracer_ != nullptr) {
    if (Status s = tracer_->Write(); !s.ok()) {
      Log(LogLevel::kWarning, StrCat("trace: ", s.message()));
    }
  }
}

Result<SwapSpace*> Runtime::Swap() {
  std::lock_guard lock(mu_);
  if (swap_ != nullptr) return swap_.get();
  if (options_.nvme_paths.empty()) {
    return InvalidArgumentError(
        "no NVMe directory configured: set zoffload.nvme_paths or "
        "zero_optimization.offload_optimizer.nvme_path");
  }
  SwapSpaceOptions so;
  so.paths = options_.nvme_paths;
  so.aio = options_.aio;
  so.checksums = options_.checksums;
  so.durable = options_.durable;
  so.tracer = tracer_.get();
  so.wrap_backend = wrap_backend_;
  ZO_ASSIGN_OR_RETURN(swap_, SwapSpace::Open(std::move(so)));
  return swap_.get();
}

Result<HostMemory> Runtime::AllocateHost(uint64_t bytes, std::string_view what, bool pin,
                                         bool prefault) {
  ZO_RETURN_IF_ERROR(host_.Reserve(bytes, what));
  HostMemory memory;
  memory.budget_ = &host_;
  memory.size_ = bytes;  // from here on, destroying `memory` gives the bytes back
#if ZO_HAVE_CUDA
  if (pin && pinned_ != nullptr && bytes < AlignedBuffer::kHugePageSize) {
    ZO_ASSIGN_OR_RETURN(memory.pinned_, pinned_->Allocate(bytes));
    memory.data_ = memory.pinned_.data();
    return memory;
  }
  if (pin && pinned_ != nullptr) {
    // Faulted in as huge pages by many threads, then pinned where it is.
    ZO_ASSIGN_OR_RETURN(memory.aligned_, AlignedBuffer::Allocate(bytes, 4096, true));
    memory.data_ = memory.aligned_.data();
    auto registration = pinned_->Register(memory.data_, bytes);
    if (!registration.ok()) return registration.status().WithContext(what);
    memory.registration_ = std::move(registration).value();
    return memory;
  }
#else
  (void)pin;
#endif
  ZO_ASSIGN_OR_RETURN(memory.aligned_, AlignedBuffer::Allocate(bytes, 4096, prefault));
  memory.data_ = memory.aligned_.data();
  return memory;
}

bool Runtime::has_gpu() const {
#if ZO_HAVE_CUDA
  return pinned_ != nullptr;
#else
  return false;
#endif
}

Result<int> Runtime::DeviceOf(const void* ptr) const {
#if ZO_HAVE_CUDA
  if (!has_gpu()) return -1;
  cudaPointerAttributes attributes{};
  ZO_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, ptr));
  const bool device =
      attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  return device ? attributes.device : -1;
#else
  (void)ptr;
  return -1;
#endif
}

#if ZO_HAVE_CUDA
Result<DeviceMemory> Runtime::AllocateDevice(uint64_t bytes, std::string_view what) {
  ZO_RETURN_IF_ERROR(gpu_.Reserve(bytes, what));
  DeviceMemory memory;
  auto buffer = DeviceBuffer::Allocate(bytes);
  if (!buffer.ok()) {
    gpu_.Release(bytes);
    return buffer.status().WithContext(what);
  }
  memory.buffer_ = std::move(buffer).value();
  memory.budget_ = &gpu_;
  return memory;
}

Result<CopyEngine*> Runtime::Copies() {
  std::lock_guard lock(mu_);
  if (copies_ != nullptr) return copies_.get();
  if (pinned_ == nullptr) {
    ZO_RETURN_IF_ERROR(UsableGpuCount().status());
    return FailedPreconditionError(
        "a GPU appeared after the runtime context was made; make a new context");
  }
  ZO_ASSIGN_OR_RETURN(copies_, CopyEngine::Create(*pinned_));
  return copies_.get();
}
#endif

}  // namespace zoffload::internal

namespace zoffload {

// ---- RuntimeOptions, RuntimeContext -------------------------------------------------------

RuntimeOptions RuntimeOptions::FromConfig(const Config& config) {
  RuntimeOptions o;
  const ZeroConfig& zero = config.zero_optimization;
  o.nvme_paths = config.zoffload.nvme_paths;
  for (const std::string* single :
       {&zero.offload_optimizer.nvme_path, &zero.offload_param.nvme_path}) {
    if (o.nvme_paths.empty() && !single->empty()) o.nvme_paths.push_back(*single);
  }
  o.aio = config.aio;
  const TierBudgets& b = config.zoffload.budgets;
  o.host_budget_bytes = b.host_bytes.value_or(b.pinned_host_bytes.value_or(0));
  o.gpu_budget_bytes = b.gpu_bytes.value_or(0);
  o.pin_host = zero.offload_optimizer.pin_memory || zero.offload_param.pin_memory;
  o.trace_path = config.zoffload.trace_path;
  return o;
}

RuntimeContext::RuntimeContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RuntimeContext::~RuntimeContext() = default;

Result<std::unique_ptr<RuntimeContext>> RuntimeContext::Create(RuntimeOptions options) {
  return internal::RuntimeAccess::Create(std::move(options), nullptr);
}

Result<std::unique_ptr<RuntimeContext>> RuntimeContext::Access::Create(
    RuntimeOptions options, internal::WrapBackend wrap_backend) {
  auto impl = std::make_unique<Impl>(std::move(options), std::move(wrap_backend));
#if ZO_HAVE_CUDA
  if (internal::UsableGpuCount().ok()) {
    // One pool, and no second cap: the host budget is enforced by AllocateHost, for every
    // tensor and buffer the parts hold. (The copy engine's own staging, 48 MiB, comes from
    // the pool outside it.)
    internal::PinnedPoolOptions po;
    po.device = impl->options_.device;
    po.budget_bytes = std::numeric_limits<uint64_t>::max();
    ZO_ASSIGN_OR_RETURN(internal::PinnedPool pool, internal::PinnedPool::Create(po));
    impl->pinned_ = std::make_unique<internal::PinnedPool>(std::move(pool));
  }
#endif
  return std::unique_ptr<RuntimeContext>(new RuntimeContext(std::move(impl)));
}

const RuntimeOptions& RuntimeContext::options() const { return impl_->options(); }

RuntimeContext::Stats RuntimeContext::stats() const {
  Stats s;
  s.host_bytes = impl_->host_budget().used();
  s.host_budget = impl_->host_budget().limit();
  s.gpu_bytes = impl_->gpu_budget().used();
  s.gpu_budget = impl_->gpu_budget().limit();
  return s;
}

}  // namespace zoffload
