// TensorStore: tensors by stable key, each with a dtype, a size, a home tier (GPU memory, host
// memory, NVMe) and a residency, under per-tier byte budgets.
//
// 1. Register(key, dtype, elements, home) reserves the tensor's home: device memory (gpu),
//    host memory (host; pinned when a GPU exists, so copies run at PCIe speed), or a swap
//    tensor (nvme).
// 2. Acquire(key, access[, at]) returns a Future<Lease>; its lease gives the bytes where the
//    caller asked for them: by default device memory for gpu tensors and host memory for host
//    and nvme tensors; `at` = gpu puts a host or nvme tensor in device memory too. An nvme
//    tensor is read into a host cache buffer (unless the access is kWrite, which overwrites all
//    of it); a GPU copy is uploaded from the host copy through the CopyEngine. Prefetch starts
//    those moves early. Releasing a lease that could write marks that copy newer than the
//    slower ones; changes move down when the copy is evicted, when the tensor is next leased
//    elsewhere, or at Flush.
// 3. Residency: a host or nvme tensor on the GPU keeps its host copy (the staging for its
//    moves). Host tensors and the NVMe cache count against the context's host budget; gpu
//    tensors and GPU copies against its GPU budget (both shared with the context's other
//    parts; the store evicts only its own copies). When a budget is hit the store evicts by next
//    use: the order of acquisitions repeats every training step, so once a key comes round again
//    the recorded cycle tells which cached copy is needed last (Belady's choice); before that, the
//    least recently used one. Leased copies are never evicted; a request that cannot fit even so
//    fails with RESOURCE_EXHAUSTED naming the budget.
// 4. Leases of one tensor may be out at one place at a time, or at both when all of them only
//    read. A GPU lease is released once the caller's device work on it has finished (e.g.
//    after synchronizing its stream): the store copies from it right after.
// 5. Flush moves every released change down to the tensor's home, writes dirty cached tensors
//    back to NVMe and commits the swap space (see src/swap/swap_space.h for what a crash
//    leaves behind).
//
// Thread-safety: every member may be called from any thread. A lease must be released (or
// destroyed) before the store is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/dtype.h"
#include "zoffload/export.h"
#include "zoffload/future.h"
#include "zoffload/runtime.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

enum class Tier : uint8_t { kGpu, kHost, kNvme };
std::string_view ToString(Tier tier);

enum class Access : uint8_t {
  kRead,       ///< the data is read; the lease does not change it
  kWrite,      ///< the data is overwritten in full (an NVMe tensor is not read first)
  kReadWrite,  ///< read and changed
};

/// What a tensor is to a training step; its home tier follows the config.
enum class TensorRole : uint8_t { kParameter, kGradient, kOptimizerState };

/// The home tier `config` gives tensors of `role`: parameters by offload_param.device (none:
/// gpu, cpu: host, nvme: nvme); optimizer state by offload_optimizer.device (the same map; the
/// ratio's split is OptimizerState's); gradients in host memory when the optimizer state is
/// offloaded (the CPU optimizer reads them there), else on the GPU.
Tier PlacementFor(TensorRole role, const Config& config);

class TensorStore;
struct StoreEntry;  ///< a tensor's entry in its store (the library's; opaque here)

/// A tensor made resident; released when destroyed or by Release.
class Lease {
 public:
  Lease() = default;
  ~Lease();
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  std::byte* data() const { return data_; }  ///< device memory when where() is gpu
  uint64_t size() const { return size_; }    ///< bytes
  DType dtype() const { return dtype_; }
  uint64_t elements() const { return size_ / DTypeBytes(dtype_); }
  Tier where() const { return where_; }
  /// Releases now (also what the destructor does).
  void Release();

 private:
  friend class TensorStore;
  TensorStore* store_ = nullptr;
  StoreEntry* entry_ = nullptr;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  DType dtype_ = DType::kFp32;
  Tier where_ = Tier::kHost;
  Access access_ = Access::kRead;
};

struct StoreOptions {
  /// The host copies of nvme tensors (the NVMe cache) take at most this many bytes, evicted as
  /// the host budget's are; 0: only the host budget bounds them.
  uint64_t nvme_cache_bytes = 0;
};

class TensorStore {
 public:
  /// A store whose budgets, swap space, pinned memory and copy engine are `context`'s
  /// (which must outlive it).
  static Result<std::unique_ptr<TensorStore>> Open(RuntimeContext& context,
                                                   StoreOptions options = {});
  ~TensorStore();
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;

  /// Reserves `elements` (>= 1) of `dtype` for `key` in its home tier. An nvme tensor already
  /// in the swap space with the same size is reused with its data; other new tensors are zeros
  /// (device memory of gpu tensors is not initialized).
  Status Register(const std::string& key, DType dtype, uint64_t elements, Tier home);
  /// Frees the tensor; it must not be leased.
  Status Unregister(const std::string& key);

  /// Leases `key` at `at` (default: gpu for gpu tensors, host for the others). `at` may be
  /// gpu for any tensor and host for host and nvme tensors. The lease arrives once its moves
  /// (an NVMe read, an upload) are in; a failed move is cleaned up by the thread that collects
  /// the future (Get or Wait), and a future dropped uncollected gives its lease back.
  Future<Lease> Acquire(const std::string& key, Access access, std::optional<Tier> at = {});
  /// Hint: `key` will be acquired at `at` soon; its moves there start now (an nvme tensor's
  /// read; the upload of a tensor whose host copy is present).
  void Prefetch(const std::string& key, std::optional<Tier> at = {});
  /// Moves every released change down to the tensors' homes and commits the NVMe tier.
  Status Flush();

  struct Stats {
    uint64_t host_bytes = 0, gpu_bytes = 0;                    ///< held now (host: tensors + cache)
    uint64_t hits = 0, misses = 0, evictions = 0;              ///< NVMe cache in host memory
    uint64_t gpu_hits = 0, gpu_misses = 0, gpu_evictions = 0;  ///< GPU copies
    uint64_t bytes_read = 0, bytes_written = 0;                ///< NVMe traffic
    uint64_t bytes_to_gpu = 0, bytes_from_gpu = 0;             ///< PCIe traffic
  };
  Stats stats() const;
  bool Contains(const std::string& key) const;

 private:
  friend class Lease;
  struct Impl;
  explicit TensorStore(std::unique_ptr<Impl> impl);
  void Release(Lease& lease);
  // The lease of a request whose moves finished with `moved`; a failure drops the copy.
  Result<Lease> FinishLease(StoreEntry& e, Tier at, Access access, const Status& moved);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoffload
ZO_API_END
