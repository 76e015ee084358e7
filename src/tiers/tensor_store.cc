#include "zoffload/tensor_store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "build_info.h"
#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "swap/swap_space.h"
#if ZO_HAVE_CUDA
#include "gpu/device_buffer.h"
#include "gpu/gpu_info.h"
#include "gpu/pinned_pool.h"
#endif

namespace zoffload {

std::string_view ToString(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      break;
  }
  return "nvme";
}

TensorStoreOptions TensorStoreOptions::FromConfig(const Config& config) {
  TensorStoreOptions o;
  const TierBudgets& b = config.zoffload.budgets;
  o.host_budget_bytes = b.pinned_host_bytes.value_or(b.host_bytes.value_or(0));
  o.gpu_budget_bytes = b.gpu_bytes.value_or(0);
  auto swap = SwapSpaceOptions::ForOptimizerState(config);
  if (swap.ok()) o.nvme_paths = swap->paths;
  o.aio = config.aio;
  o.pin_host = config.zero_optimization.offload_optimizer.pin_memory ||
               config.zero_optimization.offload_param.pin_memory;
  return o;
}

namespace internal {

// Host memory: pinned when the store has a pinned pool, aligned otherwise.
struct HostBlock {
  AlignedBuffer aligned;
#if ZO_HAVE_CUDA
  PinnedBuffer pinned;
#endif
  std::byte* data() const {
#if ZO_HAVE_CUDA
    if (pinned.data() != nullptr) return pinned.data();
#endif
    return const_cast<std::byte*>(aligned.data());
  }
  bool empty() const { return data() == nullptr; }
  void Reset() { *this = HostBlock(); }
};

struct StoreEntry {
  std::string key;
  uint64_t bytes = 0;
  Tier home = Tier::kHost;
  HostBlock host;  // host home, or the NVMe cache
#if ZO_HAVE_CUDA
  DeviceBuffer device;
#endif
  int leases = 0;
  bool dirty = false;    // the cached copy is newer than the disk's
  bool on_disk = false;  // the swap tensor holds data
  uint64_t last_use = 0;
  // A read into the cache in flight (guarded by load_mu, not the store's mutex).
  std::mutex load_mu;
  IoFuture load;
  Status load_status;
};

struct LeaseState {
  TensorStore* store = nullptr;
  StoreEntry* entry = nullptr;
  Access access = Access::kRead;
  Status error;  // the request failed before any I/O
};

}  // namespace internal

using internal::StoreEntry;

struct TensorStore::Impl {
  TensorStoreOptions options;
  mutable std::mutex mu;
  std::unordered_map<std::string, std::unique_ptr<StoreEntry>> entries;
  std::unique_ptr<SwapSpace> swap;  // opened on the first nvme tensor
#if ZO_HAVE_CUDA
  std::unique_ptr<PinnedPool> pinned;
#endif
  uint64_t host_used = 0, gpu_used = 0, tick = 0;
  Stats stats;
  // Next-use eviction: the acquisition order until a key comes round again, then the cycle.
  std::vector<std::string> history;
  std::unordered_map<std::string, std::vector<size_t>> cycle;  // key -> positions in it
  size_t cycle_length = 0, position = 0;

  uint64_t HostBudget() const {
    return options.host_budget_bytes == 0 ? std::numeric_limits<uint64_t>::max()
                                          : options.host_budget_bytes;
  }

  Result<internal::HostBlock> AllocateHost(uint64_t bytes) {
    internal::HostBlock block;
#if ZO_HAVE_CUDA
    if (pinned != nullptr) {
      ZO_ASSIGN_OR_RETURN(block.pinned, pinned->Allocate(bytes));
      return block;
    }
#endif
    ZO_ASSIGN_OR_RETURN(block.aligned, AlignedBuffer::Allocate(bytes, 4096));
    return block;
  }

  void NoteAccess(const std::string& key) {
    ++tick;
    if (cycle_length == 0) {
      if (!history.empty() && key == history.front() && history.size() > 1) {
        for (size_t i = 0; i < history.size(); ++i) cycle[history[i]].push_back(i);
        cycle_length = history.size();
        position = 0;
        history.clear();
      } else {
        history.push_back(key);
        return;
      }
    }
    // Where in the cycle this access is: the key's next position at or after the current one.
    auto it = cycle.find(key);
    if (it == cycle.end()) return;
    size_t best = it->second.front();
    for (size_t p : it->second) {
      if (p >= position) {
        best = p;
        break;
      }
    }
    position = best;
  }

  // Accesses until `key` is used again (larger: evict first).
  uint64_t NextUse(const StoreEntry& e) const {
    if (cycle_length == 0) return tick - e.last_use;  // LRU until the cycle is known
    auto it = cycle.find(e.key);
    if (it == cycle.end()) return std::numeric_limits<uint64_t>::max();
    uint64_t best = std::numeric_limits<uint64_t>::max();
    for (size_t p : it->second) {
      const uint64_t d = (p + cycle_length - position - 1) % cycle_length + 1;
      best = std::min(best, d);
    }
    return best;
  }

  Status WriteBack(StoreEntry& e) {
    ZO_RETURN_IF_ERROR(swap->Write(e.key, 0, {e.host.data(), e.bytes}).Wait());
    stats.bytes_written += e.bytes;
    e.dirty = false;
    e.on_disk = true;
    return Status::Ok();
  }

  // Frees cache until `bytes` more fit in the host budget (mu held).
  Status MakeRoom(uint64_t bytes, const std::string& for_key) {
    while (host_used + bytes > HostBudget()) {
      StoreEntry* victim = nullptr;
      uint64_t farthest = 0;
      for (auto& [key, e] : entries) {
        if (e->home != Tier::kNvme || e->host.empty() || e->leases > 0 || e->load.valid()) {
          continue;
        }
        const uint64_t d = NextUse(*e);
        if (victim == nullptr || d > farthest) {
          victim = e.get();
          farthest = d;
        }
      }
      if (victim == nullptr) {
        return ResourceExhaustedError(
            StrCat("tensor store: host budget ", HumanBytes(HostBudget()), " cannot hold '",
                   for_key, "' (", HumanBytes(bytes), "): ", HumanBytes(host_used),
                   " in use by host tensors and leased or loading NVMe tensors"));
      }
      if (victim->dirty) ZO_RETURN_IF_ERROR(WriteBack(*victim));
      host_used -= victim->bytes;
      victim->host.Reset();
      ++stats.evictions;
    }
    return Status::Ok();
  }

  // Makes an nvme tensor cached, starting its read unless it is to be overwritten (mu held).
  Status Load(StoreEntry& e, bool read) {
    if (!e.host.empty()) return Status::Ok();
    ZO_RETURN_IF_ERROR(MakeRoom(e.bytes, e.key));
    ZO_ASSIGN_OR_RETURN(e.host, AllocateHost(e.bytes));
    host_used += e.bytes;
    if (!read) return Status::Ok();
    if (!e.on_disk) {  // never written: zeros
      std::memset(e.host.data(), 0, e.bytes);
      return Status::Ok();
    }
    std::lock_guard load_lock(e.load_mu);
    e.load = swap->Read(e.key, 0, {e.host.data(), e.bytes});
    e.load_status = Status::Ok();
    stats.bytes_read += e.bytes;
    return Status::Ok();
  }
};

// ---- Lease and LeaseFuture ----------------------------------------------------------------

Lease::~Lease() { Release(); }

Lease::Lease(Lease&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      entry_(std::exchange(other.entry_, nullptr)),
      data_(other.data_),
      size_(other.size_),
      where_(other.where_),
      access_(other.access_) {}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    entry_ = std::exchange(other.entry_, nullptr);
    data_ = other.data_;
    size_ = other.size_;
    where_ = other.where_;
    access_ = other.access_;
  }
  return *this;
}

void Lease::Release() {
  if (store_ != nullptr) store_->Release(*this);
  store_ = nullptr;
  entry_ = nullptr;
  data_ = nullptr;
}

void TensorStore::Release(Lease& lease) {
  std::lock_guard lock(impl_->mu);
  StoreEntry& e = *lease.entry_;
  --e.leases;
  if (lease.access_ != Access::kRead && e.home == Tier::kNvme) e.dirty = true;
}

LeaseFuture::~LeaseFuture() {
  if (state_ != nullptr && state_->entry != nullptr && state_->error.ok()) {
    // Never collected: give the lease back once the data has arrived.
    Result<Lease> lease = Get();
  }
}
LeaseFuture::LeaseFuture(LeaseFuture&&) noexcept = default;
LeaseFuture& LeaseFuture::operator=(LeaseFuture&&) noexcept = default;

bool LeaseFuture::Ready() const {
  if (state_ == nullptr || !state_->error.ok()) return true;
  StoreEntry& e = *state_->entry;
  std::lock_guard load_lock(e.load_mu);
  return !e.load.valid() || e.load.Ready();
}

Result<Lease> LeaseFuture::Get() {
  if (state_ == nullptr) return FailedPreconditionError("LeaseFuture: no request (or taken)");
  std::unique_ptr<internal::LeaseState> state = std::move(state_);
  if (!state->error.ok()) return state->error;
  StoreEntry& e = *state->entry;
  Status status;
  {
    std::lock_guard load_lock(e.load_mu);
    if (e.load.valid()) {
      e.load_status = e.load.Wait();
      e.load = IoFuture();
    }
    status = e.load_status;
  }
  Lease lease;
  lease.store_ = state->store;
  lease.entry_ = &e;
  lease.size_ = e.bytes;
  lease.access_ = state->access;
  lease.where_ = e.home == Tier::kGpu ? Tier::kGpu : Tier::kHost;
#if ZO_HAVE_CUDA
  lease.data_ = e.home == Tier::kGpu ? static_cast<std::byte*>(e.device.data()) : e.host.data();
#else
  lease.data_ = e.host.data();
#endif
  if (!status.ok()) {
    {
      std::lock_guard lock(state->store->impl_->mu);
      --e.leases;
      if (!e.host.empty()) {  // the failed copy is dropped (once, by whoever sees it first)
        state->store->impl_->host_used -= e.bytes;
        e.host.Reset();
      }
    }
    lease.store_ = nullptr;
    return status.WithContext(StrCat("tensor store: loading '", e.key, "'"));
  }
  return lease;
}

// ---- TensorStore --------------------------------------------------------------------------

TensorStore::TensorStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TensorStore::~TensorStore() {
  for (auto& [key, e] : impl_->entries) {
    std::lock_guard load_lock(e->load_mu);
    if (e->load.valid()) e->load.Wait().IgnoreError();
  }
}

Result<std::unique_ptr<TensorStore>> TensorStore::Open(TensorStoreOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
#if ZO_HAVE_CUDA
  if (impl->options.pin_host && UsableGpuCount().ok()) {
    PinnedPoolOptions po;
    po.device = impl->options.device;
    po.budget_bytes = impl->options.host_budget_bytes == 0 ? std::numeric_limits<uint64_t>::max()
                                                           : impl->options.host_budget_bytes;
    ZO_ASSIGN_OR_RETURN(PinnedPool pool, PinnedPool::Create(po));
    impl->pinned = std::make_unique<PinnedPool>(std::move(pool));
  }
#endif
  return std::unique_ptr<TensorStore>(new TensorStore(std::move(impl)));
}

Status TensorStore::Register(const std::string& key, uint64_t bytes, Tier home) {
  if (key.empty() || bytes == 0) {
    return InvalidArgumentError(
        StrCat("tensor store: tensor '", key, "' needs a key and at least 1 byte"));
  }
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  if (s.entries.contains(key)) {
    return Status(StatusCode::kAlreadyExists, StrCat("tensor store: '", key, "' is registered"));
  }
  auto e = std::make_unique<StoreEntry>();
  e->key = key;
  e->bytes = bytes;
  e->home = home;
  switch (home) {
    case Tier::kHost: {
      if (s.host_used + bytes > s.HostBudget()) ZO_RETURN_IF_ERROR(s.MakeRoom(bytes, key));
      ZO_ASSIGN_OR_RETURN(e->host, s.AllocateHost(bytes));
      std::memset(e->host.data(), 0, bytes);
      s.host_used += bytes;
      break;
    }
    case Tier::kGpu: {
#if ZO_HAVE_CUDA
      if (s.options.gpu_budget_bytes != 0 && s.gpu_used + bytes > s.options.gpu_budget_bytes) {
        return ResourceExhaustedError(StrCat(
            "tensor store: GPU budget ", HumanBytes(s.options.gpu_budget_bytes), " cannot hold '",
            key, "' (", HumanBytes(bytes), "): ", HumanBytes(s.gpu_used), " in use"));
      }
      ZO_RETURN_IF_ERROR(UsableGpuCount().status());
      ZO_ASSIGN_OR_RETURN(e->device, DeviceBuffer::Allocate(bytes));
      s.gpu_used += bytes;
      break;
#else
      return FailedPreconditionError(
          StrCat("tensor store: '", key, "' cannot live on the GPU: this build has no CUDA"));
#endif
    }
    case Tier::kNvme: {
      if (s.swap == nullptr) {
        if (s.options.nvme_paths.empty()) {
          return InvalidArgumentError(
              StrCat("tensor store: '", key,
                     "' lives on NVMe but no NVMe directory is configured (zoffload.nvme_paths)"));
        }
        SwapSpaceOptions so;
        so.paths = s.options.nvme_paths;
        so.aio = s.options.aio;
        so.checksums = s.options.checksums;
        ZO_ASSIGN_OR_RETURN(s.swap, SwapSpace::Open(std::move(so)));
      }
      e->on_disk = s.swap->Contains(key);
      ZO_RETURN_IF_ERROR(s.swap->Allocate(key, bytes));
      break;
    }
  }
  s.entries.emplace(key, std::move(e));
  return Status::Ok();
}

Status TensorStore::Unregister(const std::string& key) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  auto it = s.entries.find(key);
  if (it == s.entries.end()) return NotFoundError(StrCat("tensor store: no tensor '", key, "'"));
  StoreEntry& e = *it->second;
  if (e.leases > 0) {
    return FailedPreconditionError(StrCat("tensor store: '", key, "' is leased"));
  }
  {
    std::lock_guard load_lock(e.load_mu);
    if (e.load.valid()) e.load.Wait().IgnoreError();
  }
  if (!e.host.empty()) s.host_used -= e.bytes;
  if (e.home == Tier::kGpu) s.gpu_used -= e.bytes;
  if (e.home == Tier::kNvme) ZO_RETURN_IF_ERROR(s.swap->Remove(key));
  s.entries.erase(it);
  return Status::Ok();
}

LeaseFuture TensorStore::Acquire(const std::string& key, Access access) {
  Impl& s = *impl_;
  LeaseFuture future;
  future.state_ = std::make_unique<internal::LeaseState>();
  future.state_->store = this;
  future.state_->access = access;
  std::lock_guard lock(s.mu);
  auto it = s.entries.find(key);
  if (it == s.entries.end()) {
    future.state_->error = NotFoundError(StrCat("tensor store: no tensor '", key, "'"));
    return future;
  }
  StoreEntry& e = *it->second;
  s.NoteAccess(key);
  if (e.home == Tier::kNvme) {
    const bool cached = !e.host.empty();
    ++(cached ? s.stats.hits : s.stats.misses);
    if (Status st = s.Load(e, access != Access::kWrite); !st.ok()) {
      future.state_->error = st;
      return future;
    }
  }
  e.last_use = s.tick;
  ++e.leases;
  future.state_->entry = &e;
  return future;
}

void TensorStore::Prefetch(const std::string& key) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  auto it = s.entries.find(key);
  if (it == s.entries.end() || it->second->home != Tier::kNvme) return;
  s.Load(*it->second, true).IgnoreError();  // a hint: no room now means no prefetch
}

Status TensorStore::Flush() {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  if (s.swap == nullptr) return Status::Ok();
  for (auto& [key, e] : s.entries) {
    if (e->home == Tier::kNvme && e->dirty) ZO_RETURN_IF_ERROR(s.WriteBack(*e));
  }
  return s.swap->Commit();
}

TensorStore::Stats TensorStore::stats() const {
  std::lock_guard lock(impl_->mu);
  Stats st = impl_->stats;
  st.host_bytes = impl_->host_used;
  st.gpu_bytes = impl_->gpu_used;
  return st;
}

bool TensorStore::Contains(const std::string& key) const {
  std::lock_guard lock(impl_->mu);
  return impl_->entries.contains(key);
}

}  // namespace zoffload
