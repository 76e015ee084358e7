// TensorStore's inside (tensor_store.cc): each tensor's entry and the store's table, moves and
// eviction.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/strings.h"
#include "swap/swap_space.h"
#include "tiers/device_copy.h"
#include "tiers/runtime_context.h"
#include "zoffload/tensor_store.h"

namespace zoffload {

using internal::HostMemory;
using internal::HumanBytes;
using internal::StrCat;
using internal::SwapSpace;

using internal::AllocateDeviceCopy;
using internal::DeviceCopiesAvailable;
using internal::DeviceCopy;

struct StoreEntry {
  std::string key;
  DType dtype = DType::kFp32;
  uint64_t bytes = 0;
  Tier home = Tier::kHost;
  HostMemory host;  // host home; the cache of an nvme tensor; kept while a GPU copy exists
  std::unique_ptr<DeviceCopy> device;  // gpu home, or the GPU copy of a host or nvme tensor
  int host_leases = 0, gpu_leases = 0, writers = 0;
  bool dirty = false;         // nvme: the host copy is newer than the disk's
  bool device_dirty = false;  // the GPU copy of a host or nvme tensor is newer than the host's
  bool on_disk = false;       // the swap tensor holds data
  uint64_t last_use = 0;
  // Threads moving its data with mu released (guarded by mu): while > 0 nobody else leases,
  // evicts, moves or unregisters it (they wait on Impl::idle).
  int busy = 0;
  // The last moves (guarded by move_mu, not the store's mutex; lock order: mu, then move_mu;
  // waits take a copy and release it). A GPU copy filled while the host copy is loading is
  // chained to the load: its upload starts on the I/O thread that finishes the load.
  std::mutex move_mu;
  Future<> load;    // NVMe -> host copy
  Future<> upload;  // host copy -> GPU copy

  bool Loading() const { return !load.Ready(); }  // move_mu held

  bool has_device() const { return home != Tier::kGpu && device != nullptr; }
};

struct TensorStore::Impl {
  Impl(internal::Runtime& runtime, StoreOptions o) : rt(runtime), options(o) {}
  internal::Runtime& rt;  // budgets, swap space, pinned pool, copy engine
  StoreOptions options;
  // Guards the entries and counters. Nobody waits for a move (a D2H copy, an NVMe write, an
  // upload) while holding it: moves run through Unlocked, with the entry marked busy.
  mutable std::mutex mu;
  std::condition_variable idle;  // an entry's busy count fell to 0
  std::unordered_map<std::string, std::unique_ptr<StoreEntry>> entries;
  SwapSpace* swap = nullptr;  // the context's, once the first nvme tensor is registered
  uint64_t host_used = 0, gpu_used = 0, tick = 0;  // this store's share of the budgets
  uint64_t cache_used = 0;                         // of host_used: the host copies of nvme tensors
  Stats stats;
  // Next-use eviction: the acquisition order until a key comes round again, then the cycle.
  std::vector<std::string> history;
  std::unordered_map<std::string, std::vector<size_t>> cycle;  // key -> positions in it
  size_t cycle_length = 0, position = 0;

  Result<HostMemory> AllocateHost(uint64_t bytes, const std::string& key) {
    return rt.AllocateHost(bytes, StrCat("tensor '", key, "'"), rt.options().pin_host);
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

  // The evictable copy (`pred`) needed last, or null.
  template <typename Pred>
  StoreEntry* Victim(Pred pred) const {
    StoreEntry* victim = nullptr;
    uint64_t farthest = 0;
    for (const auto& [key, e] : entries) {
      if (!pred(*e)) continue;
      const uint64_t d = NextUse(*e);
      if (victim == nullptr || d > farthest) {
        victim = e.get();
        farthest = d;
      }
    }
    return victim;
  }

  // Host copy -> NVMe (mu held by `lock`, released meanwhile).
  Status WriteBack(std::unique_lock<std::mutex>& lock, StoreEntry& e) {
    ZO_RETURN_IF_ERROR(Unlocked(lock, e, [this, &e] {
      return swap->Write(e.key, 0, {e.host.data(), e.bytes}).Wait();
    }));
    stats.bytes_written += e.bytes;
    e.dirty = false;
    e.on_disk = true;
    return Status::Ok();
  }

  // Runs `move` with mu (held by `lock`) released and e marked busy meanwhile.
  template <typename Move>
  Status Unlocked(std::unique_lock<std::mutex>& lock, StoreEntry& e, Move&& move) {
    ++e.busy;
    lock.unlock();
    const Status status = move();
    lock.lock();
    if (--e.busy == 0) idle.notify_all();
    return status;
  }

  // The entry of `key` once nobody moves it, or null (mu held by `lock`, released while
  // waiting).
  StoreEntry* FindIdle(std::unique_lock<std::mutex>& lock, const std::string& key) {
    while (true) {
      auto it = entries.find(key);
      if (it == entries.end()) return nullptr;
      if (it->second->busy == 0) return it->second.get();
      idle.wait(lock);
    }
  }

  // Waits for e's last `move` (its load or its upload; mu not held); its status.
  static Status Await(StoreEntry& e, Future<> StoreEntry::*move) {
    Future<> copy;
    {
      std::lock_guard move_lock(e.move_mu);
      copy = e.*move;
    }
    return copy.Wait();
  }

  // The GPU copy's changes are now in the host copy (mu held).
  void Downloaded(StoreEntry& e) {
    stats.bytes_from_gpu += e.bytes;
    e.device_dirty = false;
    if (e.home == Tier::kNvme) e.dirty = true;
  }

  // GPU copy -> host copy when the GPU's is newer (mu held by `lock`, released meanwhile).
  Status Download(std::unique_lock<std::mutex>& lock, StoreEntry& e) {
    if (!e.has_device() || !e.device_dirty) return Status::Ok();
    ZO_RETURN_IF_ERROR(Unlocked(lock, e, [&e] { return e.device->Download(e.host); }));
    Downloaded(e);
    return Status::Ok();
  }

  // Moves a GPU copy's changes down and frees it (mu held by `lock`, released meanwhile; not
  // leased).
  Status DropDevice(std::unique_lock<std::mutex>& lock, StoreEntry& e) {
    if (!e.has_device()) return Status::Ok();
    const bool changed = e.device_dirty;
    ZO_RETURN_IF_ERROR(Unlocked(lock, e, [&e, changed] {
      Await(e, &StoreEntry::upload).IgnoreError();  // being dropped: its data no longer matters
      return changed ? e.device->Download(e.host) : Status::Ok();
    }));
    if (changed) Downloaded(e);
    e.device.reset();
    gpu_used -= e.bytes;
    return Status::Ok();
  }

  // Frees host copies of nvme tensors until `bytes` more fit in the host budget and, for an
  // nvme tensor's copy (`cache`), in options.nvme_cache_bytes (mu held by `lock`, released
  // during write-backs).
  Status MakeRoom(std::unique_lock<std::mutex>& lock, uint64_t bytes, const std::string& for_key,
                  bool cache) {
    auto evictable = [](StoreEntry& e) {
      return e.home == Tier::kNvme && !e.host.empty() && e.host_leases + e.gpu_leases == 0;
    };
    const uint64_t cap = options.nvme_cache_bytes;
    auto over_cap = [&] { return cache && cap > 0 && cache_used + bytes > cap; };
    while (!rt.host_budget().Fits(bytes) || over_cap()) {
      StoreEntry* victim = Victim([&evictable](StoreEntry& e) {
        if (!evictable(e) || e.busy > 0) return false;
        std::lock_guard move_lock(e.move_mu);
        return !e.Loading();
      });
      if (victim == nullptr &&
          Victim([&evictable](StoreEntry& e) { return evictable(e) && e.busy > 0; }) != nullptr) {
        idle.wait(lock);  // another thread is evicting: its room may be enough
        continue;
      }
      // Unleased but loading (a prefetch): its read ends on its own, then it can go. (A failed
      // read leaves nothing to keep: the entry goes, and its next use reads it again.)
      StoreEntry* loading = victim != nullptr ? nullptr : Victim([&evictable](StoreEntry& e) {
        return evictable(e) && e.busy == 0;
      });
      if (loading != nullptr) {
        Unlocked(lock, *loading, [loading] {
          return Await(*loading, &StoreEntry::load);
        }).IgnoreError();
        continue;
      }
      if (victim == nullptr && over_cap()) {
        return ResourceExhaustedError(StrCat("tensor store: the host cache of NVMe tensors (",
                                             HumanBytes(cap), ") cannot hold '", for_key, "' (",
                                             HumanBytes(bytes), "): ", HumanBytes(cache_used),
                                             " of it is leased or loading"));
      }
      if (victim == nullptr) {
        return ResourceExhaustedError(
            StrCat("tensor store: the host budget ", HumanBytes(rt.host_budget().limit()),
                   " cannot hold '", for_key, "' (", HumanBytes(bytes),
                   "): ", HumanBytes(rt.host_budget().used()), " in use, ", HumanBytes(host_used),
                   " of it by this store's host tensors and leased or loading NVMe tensors"));
      }
      ZO_RETURN_IF_ERROR(DropDevice(lock, *victim));
      if (victim->dirty) ZO_RETURN_IF_ERROR(WriteBack(lock, *victim));
      host_used -= victim->bytes;
      cache_used -= victim->bytes;
      victim->host.Reset();
      ++stats.evictions;
    }
    return Status::Ok();
  }

  // Frees GPU copies until `bytes` more fit in the GPU budget (mu held by `lock`, released
  // during downloads).
  Status MakeGpuRoom(std::unique_lock<std::mutex>& lock, uint64_t bytes,
                     const std::string& for_key) {
    while (!rt.gpu_budget().Fits(bytes)) {
      StoreEntry* victim =
          Victim([](StoreEntry& e) { return e.has_device() && e.gpu_leases == 0 && e.busy == 0; });
      if (victim == nullptr &&
          Victim([](StoreEntry& e) { return e.has_device() && e.busy > 0; }) != nullptr) {
        idle.wait(lock);  // another thread is moving a GPU copy: its room may be enough
        continue;
      }
      if (victim == nullptr) {
        return ResourceExhaustedError(
            StrCat("tensor store: the GPU budget ", HumanBytes(rt.gpu_budget().limit()),
                   " cannot hold '", for_key, "' (", HumanBytes(bytes),
                   "): ", HumanBytes(rt.gpu_budget().used()), " in use, ", HumanBytes(gpu_used),
                   " of it by this store's gpu tensors and leased GPU copies"));
      }
      ZO_RETURN_IF_ERROR(DropDevice(lock, *victim));
      ++stats.gpu_evictions;
    }
    return Status::Ok();
  }

  // Makes an nvme tensor's host copy, starting its read unless it is to be overwritten
  // (mu held by `lock`, released while making room).
  Status Load(std::unique_lock<std::mutex>& lock, StoreEntry& e, bool read) {
    if (!e.host.empty()) {
      ++stats.hits;
      return Status::Ok();
    }
    ++stats.misses;
    ZO_RETURN_IF_ERROR(MakeRoom(lock, e.bytes, e.key, true));
    ZO_ASSIGN_OR_RETURN(e.host, AllocateHost(e.bytes, e.key));
    host_used += e.bytes;
    cache_used += e.bytes;
    if (!read) return Status::Ok();
    if (!e.on_disk) {  // never written: zeros
      std::memset(e.host.data(), 0, e.bytes);
      return Status::Ok();
    }
    std::lock_guard move_lock(e.move_mu);
    e.load = swap->Read(e.key, 0, {e.host.data(), e.bytes});
    stats.bytes_read += e.bytes;
    return Status::Ok();
  }

  // Makes the GPU copy of a host or nvme tensor; fills it from the host copy unless it is to
  // be overwritten: now, or once the host copy's load is in (mu held by `lock`, released while
  // making room). Pinned host copies (the default with a GPU) go in one DMA, chained to the
  // load; a pageable one is read into staging once the load is in, with mu released.
  Status Upload(std::unique_lock<std::mutex>& lock, StoreEntry& e, bool fill) {
    ZO_RETURN_IF_ERROR(DeviceCopiesAvailable(rt).WithContext("tensor store"));
    if (e.has_device()) {
      ++stats.gpu_hits;
      return Status::Ok();
    }
    ++stats.gpu_misses;
    ZO_RETURN_IF_ERROR(MakeGpuRoom(lock, e.bytes, e.key));
    ZO_ASSIGN_OR_RETURN(e.device,
                        AllocateDeviceCopy(rt, e.bytes, StrCat("the GPU copy of '", e.key, "'")));
    gpu_used += e.bytes;
    if (!fill) return Status::Ok();
    stats.bytes_to_gpu += e.bytes;
    if (!e.host.pinned()) {
      // Staging blocks until the host copy is read: not under mu, nor on an I/O thread.
      Future<> load, upload;
      {
        std::lock_guard move_lock(e.move_mu);
        load = e.load;
      }
      ZO_RETURN_IF_ERROR(Unlocked(lock, e, [&] {
        const Status loaded = load.Wait();
        upload = loaded.ok() ? e.device->StartUpload(e.host) : Future<>::Ready(loaded);
        return Status::Ok();
      }));
      std::lock_guard move_lock(e.move_mu);
      e.upload = std::move(upload);
      return Status::Ok();
    }
    std::lock_guard move_lock(e.move_mu);
    if (!e.load.valid()) {
      e.upload = e.device->StartUpload(e.host);  // one DMA, enqueued
      return Status::Ok();
    }
    // After the load (at once when it is in); a failed load fails the upload. While the
    // entry is leased or busy nobody drops the GPU copy or the host copy under it.
    e.upload = e.load.Then([&e](const Status& loaded) {
      return loaded.ok() ? e.device->StartUpload(e.host) : Future<>::Ready(loaded);
    });
    return Status::Ok();
  }
};

}  // namespace zoffload
