// The internal side of RuntimeContext (include/zoffload/runtime.h): the shared resources the
// tiers, the engine and ZeRO borrow, and the budgeted host and device memory they allocate.
//
// Thread-safety: every member of Runtime may be called from any thread.
// HostMemory and DeviceMemory handles are not synchronized.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "build_info.h"
#include "common/aligned_buffer.h"
#include "common/trace.h"
#include "swap/swap_space.h"
#include "zoffload/runtime.h"
#include "zoffload/status.h"
#if ZO_HAVE_CUDA
#include "gpu/copy_engine.h"
#include "gpu/device_buffer.h"
#include "gpu/pinned_pool.h"
#endif

namespace zoffload::internal {

/// Bytes held against a limit; shared by every part of a context.
class ByteBudget {
 public:
  /// `name` names the budget in errors ("host budget (zoffload.budgets.host_bytes)");
  /// `limit` 0 = no limit.
  ByteBudget(std::string name, uint64_t limit) : name_(std::move(name)), limit_(limit) {}
  /// Takes `bytes`, or RESOURCE_EXHAUSTED naming the budget, `what` and the bytes in use.
  Status Reserve(uint64_t bytes, std::string_view what);
  void Release(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  /// Whether `bytes` more would fit now.
  bool Fits(uint64_t bytes) const;
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }

 private:
  std::string name_;
  uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

/// Host memory held against the host budget: pinned when asked for and a GPU is present,
/// page-aligned (huge pages for large blocks) otherwise. Large pinned blocks are huge pages
/// pinned in place (cudaHostRegister), since cudaHostAlloc's 4 KiB pages slow down the CPU's
/// passes over them (a TLB miss every 4 KiB). Gives its bytes back when destroyed.
class HostMemory {
 public:
  HostMemory() = default;
  ~HostMemory() { Reset(); }
  HostMemory(HostMemory&& other) noexcept { *this = std::move(other); }
  HostMemory& operator=(HostMemory&& other) noexcept;
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  bool pinned() const;
  std::span<std::byte> span() const { return {data_, size_}; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }
  void Reset();

 private:
  friend class Runtime;
  AlignedBuffer aligned_;
#if ZO_HAVE_CUDA
  PinnedBuffer pinned_;
  HostRegistration registration_;  // of aligned_; released first
#endif
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  ByteBudget* budget_ = nullptr;
};

#if ZO_HAVE_CUDA
/// Device memory held against the GPU budget; gives its bytes back when destroyed.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory() { Reset(); }
  DeviceMemory(DeviceMemory&& other) noexcept { *this = std::move(other); }
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  void* data() const { return buffer_.data(); }
  uint64_t size() const { return buffer_.size(); }
  template <typename T>
  T* as() const {
    return buffer_.as<T>();
  }
  void Reset();

 private:
  friend class Runtime;
  DeviceBuffer buffer_;
  ByteBudget* budget_ = nullptr;
};
#endif

/// A test hook at the I/O seam (fault injection): wraps each I/O thread's backend.
using WrapBackend = std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)>;

class Runtime {
 public:
  explicit Runtime(RuntimeOptions options, WrapBackend wrap_backend = nullptr);
  ~Runtime();

  const RuntimeOptions& options() const { return options_; }
  ByteBudget& host_budget() { return host_; }
  ByteBudget& gpu_budget() { return gpu_; }
  /// The trace, when options().trace_path is set; else null.
  Tracer* tracer() const { return tracer_.get(); }

  /// The swap space over options().nvme_paths, opened on the first call (NOT_FOUND-style
  /// errors name the directory; INVALID_ARGUMENT when no directory is configured).
  Result<SwapSpace*> Swap();

  /// `bytes` of host memory for `what`, reserved from the host budget. `pin`: from the
  /// pinned pool when a GPU is present (else page-aligned memory).
  /// `prefault` touches every page now (see AlignedBuffer).
  Result<HostMemory> AllocateHost(uint64_t bytes, std::string_view what, bool pin,
                                  bool prefault = false);

  /// Whether a usable GPU was found when the context was made.
  bool has_gpu() const;
  /// The CUDA device `ptr` points into, or -1 for host memory (always, without a GPU).
  Result<int> DeviceOf(const void* ptr) const;
#if ZO_HAVE_CUDA
  /// `bytes` of device memory for `what`, reserved from the GPU budget.
  Result<DeviceMemory> AllocateDevice(uint64_t bytes, std::string_view what);
  /// The copy engine, made on the first call (FAILED_PRECONDITION without a GPU).
  Result<CopyEngine*> Copies();
#endif

 private:
  friend struct ::zoffload::RuntimeContext::Access;  // makes the pinned pool
  RuntimeOptions options_;
  WrapBackend wrap_backend_;
  ByteBudget host_, gpu_;
  std::unique_ptr<Tracer> tracer_;
  std::mutex mu_;  // makes swap_ and copies_ once
  std::unique_ptr<SwapSpace> swap_;
#if ZO_HAVE_CUDA
  std::unique_ptr<PinnedPool> pinned_;
  std::unique_ptr<CopyEngine> copies_;
#endif
};

}  // namespace zoffload::internal

namespace zoffload {

struct RuntimeContext::Impl : internal::Runtime {
  using Runtime::Runtime;
};

/// The parts' way into a RuntimeContext (its public header shows only what a user needs).
struct RuntimeContext::Access {
  static internal::Runtime& Of(const RuntimeContext& context) { return *context.impl_; }
  /// RuntimeContext::Create, with `wrap_backend` around each I/O thread's backend.
  static Result<std::unique_ptr<RuntimeContext>> Create(RuntimeOptions options,
                                                        internal::WrapBackend wrap_backend);
};

namespace internal {
using RuntimeAccess = RuntimeContext::Access;
}  // namespace internal

}  // namespace zoffload
