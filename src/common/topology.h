// Machine topology through hwloc: cores, NUMA nodes, and the NUMA node nearest a PCI device
// (a GPU) or the block device under a path (an NVMe disk). I/O and Adam threads are pinned
// with it.
//
// Thread-safety: a loaded Topology is read-only and may be queried from any thread;
// BindThisThreadToNumaNode affects only the calling thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "zoffload/status.h"

namespace zoffload::internal {

class Topology {
 public:
  /// Discovers the machine, PCI and block devices included.
  static Result<Topology> Load();

  Topology(Topology&&) noexcept;
  Topology& operator=(Topology&&) noexcept;
  ~Topology();

  int Packages() const;
  int PhysicalCores() const;
  int HardwareThreads() const;
  int NumaNodes() const;

  /// NUMA node (logical index) nearest the PCI device "DDDD:BB:DD.F"; NOT_FOUND with the
  /// reason when hwloc does not know the device or its locality.
  Result<int> NumaNodeOfPciDevice(const std::string& bus_id) const;

  /// Name of the whole-disk block device holding `path` ("nvme0n1", "vda"), from sysfs.
  static Result<std::string> BlockDeviceOfPath(const std::string& path);

  /// NUMA node nearest the block device holding `path`.
  Result<int> NumaNodeOfPath(const std::string& path) const;

  /// Binds the calling thread to the cores of NUMA node `node`.
  Status BindThisThreadToNumaNode(int node) const;

  /// Binds the calling thread to the hardware threads of physical core `core` modulo the
  /// number of cores; -1 lets it run anywhere the process may.
  Status BindThisThreadToCore(int core) const;

  /// Makes the calling thread's new pages come from NUMA node `node` (-1: the default
  /// policy again). Pinned buffers for a GPU are allocated under this policy.
  Status BindThisThreadMemoryToNumaNode(int node) const;

 private:
  struct Impl;
  explicit Topology(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Host memory a process can take now: MemAvailable of /proc/meminfo, lowered to what the
/// cgroup's memory.max leaves (bytes); UINT64_MAX when neither can be read.
uint64_t AvailableHostMemory();

}  // namespace zoffload::internal
