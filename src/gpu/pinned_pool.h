// PinnedPool: page-locked host memory for DMA, under one byte budget.
//
// 1. Our buffers come from cudaHostAlloc, made while the calling thread's memory policy is
//    bound to the GPU's NUMA node (cudaHostAlloc populates every page at once, so they all land
//    there). On a one-node machine nothing is bound.
// 2. Caller memory (a framework's tensors) is pinned in place with Register (cudaHostRegister);
//    it counts against the same budget while registered.
// 3. Released buffers stay cached by size class and are handed out again without a CUDA call,
//    so steady-state allocation is free and is also safe during CUDA graph capture. The CUDA
//    calls the pool does make run in the thread's relaxed capture mode, so a first allocation
//    inside a capture succeeds too. Cached blocks are freed when the budget needs room, by
//    Trim, and when the last handle goes away.
// 4. Going over the budget, or the driver refusing to pin more, is RESOURCE_EXHAUSTED naming
//    the request, what is in use, the budget and `ulimit -l`.
//
// Thread-safety: every member may be called from any thread; buffers and registrations may be
// released from any thread and may outlive the PinnedPool object (they keep its state alive).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "zoffload/status.h"

namespace zoffload::internal {

struct PinnedPoolOptions {
  uint64_t budget_bytes = uint64_t{4} << 30;  ///< in use + cached, bytes
  int device = 0;                             ///< the GPU whose NUMA node the memory comes from
};

struct PinnedPoolState;

/// A pinned allocation; returns to its pool's cache when destroyed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }  ///< as requested; the block may be larger
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

 private:
  friend class PinnedPool;
  PinnedBuffer(std::shared_ptr<PinnedPoolState> pool, std::byte* data, size_t size, size_t block)
      : pool_(std::move(pool)), data_(data), size_(size), block_(block) {}
  std::shared_ptr<PinnedPoolState> pool_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t block_ = 0;
};

/// Caller memory pinned in place; unregistered when destroyed.
class HostRegistration {
 public:
  HostRegistration() = default;
  ~HostRegistration();
  HostRegistration(HostRegistration&& other) noexcept;
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  friend class PinnedPool;
  HostRegistration(std::shared_ptr<PinnedPoolState> pool, void* data, size_t size)
      : pool_(std::move(pool)), data_(data), size_(size) {}
  std::shared_ptr<PinnedPoolState> pool_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

class PinnedPool {
 public:
  /// Fails without a usable GPU (the reason says why).
  static Result<PinnedPool> Create(const PinnedPoolOptions& options);

  /// `bytes` of pinned memory (aligned to 4 KiB; blocks of 2 MiB and more to 2 MiB).
  Result<PinnedBuffer> Allocate(size_t bytes);
  /// Pins [data, data + bytes) of caller memory in place.
  Result<HostRegistration> Register(void* data, size_t bytes);

  uint64_t budget_bytes() const;
  uint64_t in_use_bytes() const;  ///< handed out + registered
  uint64_t cached_bytes() const;  ///< released, kept for reuse
  int numa_node() const;          ///< where buffers are placed; -1 when not bound
  /// Frees every cached block.
  void Trim();

 private:
  explicit PinnedPool(std::shared_ptr<PinnedPoolState> state) : state_(std::move(state)) {}
  std::shared_ptr<PinnedPoolState> state_;
};

}  // namespace zoffload::internal
