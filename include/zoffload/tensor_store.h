// TensorStore: tensors by stable key, each with a home tier (GPU memory, host memory, NVMe)
// and a residency, under per-tier byte budgets.
//
// 1. Register(key, bytes, home) reserves the tensor's home: device memory (gpu), host memory
//    (host; pinned when a GPU exists, so copies run at PCIe speed), or a swap tensor (nvme).
// 2. Acquire(key, access) returns a LeaseFuture; its lease gives the bytes where the caller can
//    use them: device memory for gpu tensors, host memory for host and nvme tensors. An nvme
//    tensor is read into a host cache buffer (unless the access is kWrite, which overwrites all
//    of it); Prefetch starts that read early. Releasing a lease that could write marks the
//    cached copy dirty; it goes back to NVMe when evicted, or at Flush.
// 3. The host budget holds host tensors and the NVMe cache. When the cache needs room it evicts
//    by next use: the order of acquisitions repeats every training step, so once a key comes
//    round again the recorded cycle tells which cached tensor is needed last (Belady's choice);
//    before that, the least recently used one. Leased tensors are never evicted; a request
//    that cannot fit even so fails with RESOURCE_EXHAUSTED naming the budget.
// 4. Flush writes every dirty cached tensor back and commits the swap space (see
//    src/swap/swap_space.h for what a crash leaves behind).
//
// Thread-safety: every member may be called from any thread. A lease must be released (or
// destroyed) before the store is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload {

enum class Tier : uint8_t { kGpu, kHost, kNvme };
std::string_view ToString(Tier tier);

enum class Access : uint8_t {
  kRead,       ///< the data is read; the lease does not change it
  kWrite,      ///< the data is overwritten in full (an NVMe tensor is not read first)
  kReadWrite,  ///< read and changed
};

struct TensorStoreOptions {
  uint64_t host_budget_bytes = 0;       ///< host tensors + NVMe cache; 0 = no budget
  uint64_t gpu_budget_bytes = 0;        ///< gpu tensors; 0 = no budget
  std::vector<std::string> nvme_paths;  ///< swap directories (needed for nvme tensors)
  AioConfig aio;
  bool checksums = true;  ///< CRC32C of every NVMe block
  bool pin_host = true;   ///< host memory from the pinned pool when a GPU is present
  int device = 0;         ///< the GPU of gpu tensors and of pinned memory

  /// Budgets from zoffload.budgets (host: pinned_host_bytes, else host_bytes), NVMe paths
  /// from zoffload.nvme_paths or offload_optimizer.nvme_path, aio, offload_optimizer.pin_memory.
  static TensorStoreOptions FromConfig(const Config& config);
};

class TensorStore;
namespace internal {
struct StoreEntry;
struct LeaseState;
}  // namespace internal

/// A tensor made resident; released when destroyed or by Release.
class Lease {
 public:
  Lease() = default;
  ~Lease();
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  std::byte* data() const { return data_; }  ///< device memory for gpu tensors
  uint64_t size() const { return size_; }
  Tier where() const { return where_; }
  /// Releases now (also what the destructor does).
  void Release();

 private:
  friend class TensorStore;
  friend class LeaseFuture;
  TensorStore* store_ = nullptr;
  internal::StoreEntry* entry_ = nullptr;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  Tier where_ = Tier::kHost;
  Access access_ = Access::kRead;
};

/// A lease that may still be arriving from NVMe.
class [[nodiscard]] LeaseFuture {
 public:
  LeaseFuture() = default;
  ~LeaseFuture();
  LeaseFuture(LeaseFuture&&) noexcept;
  LeaseFuture& operator=(LeaseFuture&&) noexcept;
  /// Waits for the data; the lease, or why it could not be had.
  Result<Lease> Get();
  bool Ready() const;

 private:
  friend class TensorStore;
  std::unique_ptr<internal::LeaseState> state_;
};

class TensorStore {
 public:
  static Result<std::unique_ptr<TensorStore>> Open(TensorStoreOptions options);
  ~TensorStore();
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  /// Reserves `bytes` (>= 1) for `key` in its home tier. An nvme tensor already in the swap
  /// space with the same size is reused with its data.
  Status Register(const std::string& key, uint64_t bytes, Tier home);
  /// Frees the tensor; it must not be leased.
  Status Unregister(const std::string& key);

  LeaseFuture Acquire(const std::string& key, Access access);
  /// Hint: `key` will be acquired soon; an nvme tensor starts loading into the cache now.
  void Prefetch(const std::string& key);
  /// Writes every dirty cached tensor back to NVMe and commits.
  Status Flush();

  struct Stats {
    uint64_t host_bytes = 0, gpu_bytes = 0;  ///< held now (host: tensors + cache)
    uint64_t hits = 0, misses = 0, evictions = 0;
    uint64_t bytes_read = 0, bytes_written = 0;  ///< NVMe traffic
  };
  Stats stats() const;
  bool Contains(const std::string& key) const;

 private:
  friend class Lease;
  friend class LeaseFuture;
  struct Impl;
  explicit TensorStore(std::unique_ptr<Impl> impl);
  void Release(Lease& lease);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoffload
