#include "zoffload/tensor_store.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "common/strings.h"
#include "swap/swap_space.h"
#include "tiers/device_copy.h"
#include "tiers/runtime_context.h"
#include "tiers/tensor_store_impl.h"

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

Tier PlacementFor(TensorRole role, const Config& config) {
  const ZeroConfig& zero = config.zero_optimization;
  auto tier = [](OffloadDevice device) {
    switch (device) {
      case OffloadDevice::kNone:
        return Tier::kGpu;
      case OffloadDevice::kCpu:
        return Tier::kHost;
      case OffloadDevice::kNvme:
        break;
    }
    return Tier::kNvme;
  };
  switch (role) {
    case TensorRole::kParameter:
      return tier(zero.offload_param.device);
    case TensorRole::kGradient:
      return zero.offload_optimizer.device == OffloadDevice::kNone ? Tier::kGpu : Tier::kHost;
    case TensorRole::kOptimizerState:
      break;
  }
  return tier(zero.offload_optimizer.device);
}

// ---- Lease ------------------------------------------------------------------------------------

Lease::~Lease() { Release(); }

Lease::Lease(Lease&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      entry_(std::exchange(other.entry_, nullptr)),
      data_(other.data_),
      size_(other.size_),
      dtype_(other.dtype_),
      where_(other.where_),
      access_(other.access_) {}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    entry_ = std::exchange(other.entry_, nullptr);
    data_ = other.data_;
    size_ = other.size_;
    dtype_ = other.dtype_;
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

namespace {

// Takes back the counts of a lease at `at` (mu held); returns whether it could write.
bool EndLease(StoreEntry& e, Tier at, Access access) {
  --(at == Tier::kGpu ? e.gpu_leases : e.host_leases);
  if (access == Access::kRead) return false;
  --e.writers;
  return true;
}

}  // namespace

void TensorStore::Release(Lease& lease) {
  std::lock_guard lock(impl_->mu);
  StoreEntry& e = *lease.entry_;
  if (!EndLease(e, lease.where_, lease.access_)) return;
  if (lease.where_ == Tier::kGpu) {
    if (e.home != Tier::kGpu) e.device_dirty = true;
  } else if (e.home == Tier::kNvme) {
    e.dirty = true;
  }
}

Result<Lease> TensorStore::FinishLease(StoreEntry& e, Tier at, Access access, const Status& moved) {
  Impl& s = *impl_;
  Lease lease;
  lease.store_ = this;
  lease.entry_ = &e;
  lease.size_ = e.bytes;
  lease.dtype_ = e.dtype;
  lease.access_ = access;
  lease.where_ = at;
  lease.data_ = at == Tier::kGpu ? e.device->data() : e.host.data();
  if (moved.ok()) return lease;
  lease.store_ = nullptr;
  const Status loaded = Impl::Await(e, &StoreEntry::load);  // in already: the moves have finished
  {
    // The failed copy is dropped (once, by whoever sees it first); the home stays. The lease
    // keeps the entry registered while this waits for other moves of it.
    std::unique_lock lock(s.mu);
    s.idle.wait(lock, [&e] { return e.busy == 0; });
    EndLease(e, at, access);
    s.DropDevice(lock, e).IgnoreError();  // a GPU copy of this tensor was never filled
    if (!loaded.ok() && e.home == Tier::kNvme && !e.host.empty()) {
      s.host_used -= e.bytes;
      s.cache_used -= e.bytes;
      e.host.Reset();
    }
  }
  return moved.WithContext(
      StrCat("tensor store: ", loaded.ok() ? "uploading '" : "loading '", e.key, "'"));
}

// ---- TensorStore --------------------------------------------------------------------------

TensorStore::TensorStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TensorStore::~TensorStore() {
  for (auto& [key, e] : impl_->entries) {
    Impl::Await(*e, &StoreEntry::load).IgnoreError();
    Impl::Await(*e, &StoreEntry::upload).IgnoreError();
  }
}

Result<std::unique_ptr<TensorStore>> TensorStore::Open(RuntimeContext& context,
                                                       StoreOptions options) {
  return std::unique_ptr<TensorStore>(
      new TensorStore(std::make_unique<Impl>(internal::RuntimeAccess::Of(context), options)));
}

Status TensorStore::Register(const std::string& key, DType dtype, uint64_t elements, Tier home) {
  if (key.empty() || elements == 0) {
    return InvalidArgumentError(
        StrCat("tensor store: tensor '", key, "' needs a key and at least 1 element"));
  }
  const uint64_t bytes = elements * DTypeBytes(dtype);
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  auto registered = [&] {
    return Status(StatusCode::kAlreadyExists, StrCat("tensor store: '", key, "' is registered"));
  };
  if (s.entries.contains(key)) return registered();
  auto e = std::make_unique<StoreEntry>();
  e->key = key;
  e->dtype = dtype;
  e->bytes = bytes;
  e->home = home;
  switch (home) {
    case Tier::kHost: {
      ZO_RETURN_IF_ERROR(s.MakeRoom(lock, bytes, key, false));
      if (s.entries.contains(key)) return registered();  // while room was made
      ZO_ASSIGN_OR_RETURN(e->host, s.AllocateHost(bytes, key));
      std::memset(e->host.data(), 0, bytes);
      s.host_used += bytes;
      break;
    }
    case Tier::kGpu: {
      ZO_RETURN_IF_ERROR(DeviceCopiesAvailable(s.rt).WithContext(
          StrCat("tensor store: '", key, "' cannot live on the GPU")));
      ZO_RETURN_IF_ERROR(s.MakeGpuRoom(lock, bytes, key));
      if (s.entries.contains(key)) return registered();  // while room was made
      ZO_ASSIGN_OR_RETURN(e->device, AllocateDeviceCopy(s.rt, bytes, StrCat("tensor '", key, "'")));
      s.gpu_used += bytes;
      break;
    }
    case Tier::kNvme: {
      if (s.swap == nullptr) {
        auto swap = s.rt.Swap();
        if (!swap.ok()) {
          return swap.status().WithContext(StrCat("tensor store: '", key, "' lives on NVMe"));
        }
        s.swap = *swap;
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
  std::unique_lock lock(s.mu);
  StoreEntry* found = s.FindIdle(lock, key);
  if (found == nullptr) return NotFoundError(StrCat("tensor store: no tensor '", key, "'"));
  StoreEntry& e = *found;
  if (e.host_leases + e.gpu_leases > 0) {
    return FailedPreconditionError(StrCat("tensor store: '", key, "' is leased"));
  }
  s.Unlocked(lock, e, [&e] {
     Impl::Await(e, &StoreEntry::load).IgnoreError();
     Impl::Await(e, &StoreEntry::upload).IgnoreError();
     return Status::Ok();
   }).IgnoreError();
  // Nobody leased it meanwhile (it was busy), and it is not busy now.
  if (!e.host.empty()) s.host_used -= e.bytes;
  if (!e.host.empty() && e.home == Tier::kNvme) s.cache_used -= e.bytes;
  if (e.device != nullptr) s.gpu_used -= e.bytes;
  if (e.home == Tier::kNvme) ZO_RETURN_IF_ERROR(s.swap->Remove(key));
  s.entries.erase(key);
  return Status::Ok();
}

Future<Lease> TensorStore::Acquire(const std::string& key, Access access, std::optional<Tier> at) {
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  StoreEntry* found = s.FindIdle(lock, key);
  if (found == nullptr) {
    return Future<Lease>::Ready(NotFoundError(StrCat("tensor store: no tensor '", key, "'")));
  }
  StoreEntry& e = *found;
  const Tier where = at.value_or(e.home == Tier::kGpu ? Tier::kGpu : Tier::kHost);
  if (where == Tier::kNvme || (e.home == Tier::kGpu && where == Tier::kHost)) {
    return Future<Lease>::Ready(
        InvalidArgumentError(StrCat("tensor store: '", key, "' (home ", ToString(e.home),
                                    ") cannot be leased at ", ToString(where),
                                    ": leases are in GPU memory, or in host memory for host and "
                                    "nvme tensors")));
  }
  const bool on_gpu = where == Tier::kGpu;
  const int elsewhere = on_gpu ? e.host_leases : e.gpu_leases;
  if (elsewhere > 0 && (access != Access::kRead || e.writers > 0)) {
    return Future<Lease>::Ready(FailedPreconditionError(
        StrCat("tensor store: '", key, "' is leased in ", on_gpu ? "host" : "GPU",
               " memory; a lease that writes must be the tensor's only place")));
  }
  s.NoteAccess(key);
  Status st;
  ++e.busy;  // while mu is released below, nobody else moves, evicts or unregisters it
  if (on_gpu && e.home != Tier::kGpu) {
    if (e.home == Tier::kNvme) st = s.Load(lock, e, access != Access::kWrite);
    if (st.ok()) st = s.Upload(lock, e, access != Access::kWrite);
  } else if (!on_gpu) {
    st = s.Download(lock, e);  // the GPU copy's released changes first
    if (st.ok() && e.home == Tier::kNvme) st = s.Load(lock, e, access != Access::kWrite);
    // A host lease that writes makes the GPU copy stale.
    if (st.ok() && access != Access::kRead) st = s.DropDevice(lock, e);
  }
  if (--e.busy == 0) s.idle.notify_all();
  if (!st.ok()) return Future<Lease>::Ready(st);
  e.last_use = s.tick;
  ++(on_gpu ? e.gpu_leases : e.host_leases);
  if (access != Access::kRead) ++e.writers;
  Future<> moves;  // what the lease waits for
  {
    std::lock_guard move_lock(e.move_mu);
    moves = on_gpu && e.has_device() ? e.upload : e.load;
  }
  // Finished by the thread that collects the lease: a failed move's clean-up blocks.
  return internal::DeferredFuture<Lease>(std::move(moves),
                                         [this, &e, where, access](const Status& moved) {
                                           return FinishLease(e, where, access, moved);
                                         });
}

void TensorStore::Prefetch(const std::string& key, std::optional<Tier> at) {
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  auto it = s.entries.find(key);
  // In use or on the move: nothing to move ahead.
  if (it == s.entries.end() || it->second->busy > 0) return;
  StoreEntry& e = *it->second;
  const bool on_gpu = at == Tier::kGpu && e.home != Tier::kGpu;
  if (e.gpu_leases + e.host_leases > 0) return;
  ++e.busy;
  // A hint: no room now means no prefetch.
  if (e.home != Tier::kNvme || s.Load(lock, e, true).ok()) {
    if (on_gpu) s.Upload(lock, e, true).IgnoreError();
  }
  if (--e.busy == 0) s.idle.notify_all();
}

Status TensorStore::Flush() {
  Impl& s = *impl_;
  std::unique_lock lock(s.mu);
  std::vector<std::string> keys;  // the map may change while mu is released below
  for (const auto& [key, e] : s.entries) keys.push_back(key);
  for (const std::string& key : keys) {
    StoreEntry* e = s.FindIdle(lock, key);
    // Released changes only: a GPU lease that writes may be changing its copy now.
    if (e != nullptr && (e->writers == 0 || e->gpu_leases == 0)) {
      ZO_RETURN_IF_ERROR(s.Download(lock, *e));
    }
  }
  if (s.swap == nullptr) return Status::Ok();
  for (const std::string& key : keys) {
    StoreEntry* e = s.FindIdle(lock, key);
    if (e != nullptr && e->home == Tier::kNvme && e->dirty) {
      ZO_RETURN_IF_ERROR(s.WriteBack(lock, *e));
    }
  }
  std::vector<std::string> nvme;  // this store's tensors only: the swap space may be shared
  for (const auto& [key, e] : s.entries) {
    if (e->home == Tier::kNvme) nvme.push_back(key);
  }
  SwapSpace* swap = s.swap;
  lock.unlock();
  return swap->Commit(/*defer_manifest=*/false, nvme);
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
