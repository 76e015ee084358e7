#include "common/topology.h"

#include <hwloc.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>

#include "common/errno_status.h"
#include "common/json_file.h"
#include "common/strings.h"

namespace zoffload::internal {

struct Topology::Impl {
  hwloc_topology_t topology = nullptr;
  ~Impl() {
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
};

Topology::Topology(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Topology::Topology(Topology&&) noexcept = default;
Topology& Topology::operator=(Topology&&) noexcept = default;
Topology::~Topology() = default;

Result<Topology> Topology::Load() {
  auto impl = std::make_unique<Impl>();
  if (hwloc_topology_init(&impl->topology) != 0) {
    return StatusFromErrno(errno, "hwloc_topology_init");
  }
  // Keep PCI and OS devices (GPUs, disks) so their locality can be asked for.
  hwloc_topology_set_io_types_filter(impl->topology, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(impl->topology) != 0) {
    return StatusFromErrno(errno, "hwloc_topology_load");
  }
  return Topology(std::move(impl));
}

int Topology::Packages() const {
  return hwloc_get_nbobjs_by_type(impl_->topology, HWLOC_OBJ_PACKAGE);
}
int Topology::PhysicalCores() const {
  return hwloc_get_nbobjs_by_type(impl_->topology, HWLOC_OBJ_CORE);
}
int Topology::HardwareThreads() const {
  return hwloc_get_nbobjs_by_type(impl_->topology, HWLOC_OBJ_PU);
}
int Topology::NumaNodes() const {
  return hwloc_get_nbobjs_by_type(impl_->topology, HWLOC_OBJ_NUMANODE);
}

namespace {

// The NUMA node of the first non-I/O ancestor of an I/O object.
Result<int> NumaNodeOfIoObject(hwloc_topology_t topology, hwloc_obj_t io, const std::string& what) {
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topology, io);
  if (ancestor == nullptr || ancestor->nodeset == nullptr) {
    return NotFoundError(StrCat(what, ": hwloc knows no locality for it"));
  }
  const int first = hwloc_bitmap_first(ancestor->nodeset);
  const int last = hwloc_bitmap_last(ancestor->nodeset);
  if (first < 0) return NotFoundError(StrCat(what, ": empty NUMA node set"));
  if (first != last && hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE) > 1) {
    return NotFoundError(StrCat(what, ": attached above several NUMA nodes"));
  }
  hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topology, static_cast<unsigned>(first));
  return node != nullptr ? static_cast<int>(node->logical_index) : first;
}

}  // namespace

Result<int> Topology::NumaNodeOfPciDevice(const std::string& bus_id) const {
  hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(impl_->topology, bus_id.c_str());
  if (pci == nullptr) return NotFoundError(StrCat("PCI device ", bus_id, " not in hwloc topology"));
  return NumaNodeOfIoObject(impl_->topology, pci, StrCat("PCI device ", bus_id));
}

Result<std::string> Topology::BlockDeviceOfPath(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return StatusFromErrno(errno, StrCat("stat ", path));
  const std::string sys = StrCat("/sys/dev/block/", major(st.st_dev), ":", minor(st.st_dev));
  std::error_code ec;
  std::filesystem::path dev = std::filesystem::canonical(sys, ec);
  if (ec) {
    return NotFoundError(StrCat(path, " is on device ", major(st.st_dev), ":", minor(st.st_dev),
                                ", which is not a block device (tmpfs, overlay or network fs?)"));
  }
  // A partition's sysfs directory sits inside its disk's.
  if (std::filesystem::exists(dev / "partition")) dev = dev.parent_path();
  return dev.filename().string();
}

Result<int> Topology::NumaNodeOfPath(const std::string& path) const {
  ZO_ASSIGN_OR_RETURN(const std::string block, BlockDeviceOfPath(path));
  for (hwloc_obj_t os = hwloc_get_next_osdev(impl_->topology, nullptr); os != nullptr;
       os = hwloc_get_next_osdev(impl_->topology, os)) {
    if (os->name != nullptr && block == os->name) {
      return NumaNodeOfIoObject(impl_->topology, os, StrCat("block device ", block));
    }
  }
  if (NumaNodes() == 1) return 0;  // One node: every device is local to it.
  return NotFoundError(StrCat("block device ", block, " of ", path, " not in hwloc topology"));
}

Status Topology::BindThisThreadToNumaNode(int node) const {
  hwloc_obj_t obj =
      hwloc_get_obj_by_type(impl_->topology, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
  if (obj == nullptr) return InvalidArgumentError(StrCat("no NUMA node ", node));
  if (hwloc_set_cpubind(impl_->topology, obj->cpuset, HWLOC_CPUBIND_THREAD) != 0) {
    return StatusFromErrno(errno, StrCat("bind thread to NUMA node ", node));
  }
  return Status::Ok();
}

Status Topology::BindThisThreadToCore(int core) const {
  hwloc_const_cpuset_t set = hwloc_topology_get_allowed_cpuset(impl_->topology);
  if (core >= 0) {
    const int cores = PhysicalCores();
    if (cores <= 0) return FailedPreconditionError("hwloc found no cores");
    hwloc_obj_t obj =
        hwloc_get_obj_by_type(impl_->topology, HWLOC_OBJ_CORE, static_cast<unsigned>(core % cores));
    if (obj == nullptr) return InvalidArgumentError(StrCat("no core ", core % cores));
    set = obj->cpuset;
  }
  if (hwloc_set_cpubind(impl_->topology, set, HWLOC_CPUBIND_THREAD) != 0) {
    return StatusFromErrno(
        errno, core >= 0 ? StrCat("bind thread to core ", core) : std::string("unbind thread"));
  }
  return Status::Ok();
}

Status Topology::BindThisThreadMemoryToNumaNode(int node) const {
  if (node < 0) {
    hwloc_bitmap_t all = hwloc_bitmap_dup(hwloc_topology_get_topology_nodeset(impl_->topology));
    const int rc = hwloc_set_membind(impl_->topology, all, HWLOC_MEMBIND_DEFAULT,
                                     HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET);
    hwloc_bitmap_free(all);
    if (rc != 0) return StatusFromErrno(errno, "reset thread memory policy");
    return Status::Ok();
  }
  hwloc_obj_t obj =
      hwloc_get_obj_by_type(impl_->topology, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
  if (obj == nullptr) return InvalidArgumentError(StrCat("no NUMA node ", node));
  if (hwloc_set_membind(impl_->topology, obj->nodeset, HWLOC_MEMBIND_BIND,
                        HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET) != 0) {
    return StatusFromErrno(errno, StrCat("bind thread memory to NUMA node ", node));
  }
  return Status::Ok();
}

uint64_t AvailableHostMemory() {
  uint64_t available = std::numeric_limits<uint64_t>::max();
  if (auto meminfo = ReadBoundedFile("/proc/meminfo", 1 << 20, "meminfo"); meminfo.ok()) {
    const size_t at = meminfo->find("MemAvailable:");
    if (at != std::string::npos) {
      available = std::strtoull(meminfo->c_str() + at + 13, nullptr, 10) * 1024;  // kB
    }
  }
  // A container's limit (cgroup v2): what its memory.max leaves above memory.current.
  auto cgroup_value = [](const char* file) -> std::optional<uint64_t> {
    auto text = ReadBoundedFile(StrCat("/sys/fs/cgroup/", file), 4096, "cgroup file");
    if (!text.ok() || text->empty() || !std::isdigit(static_cast<unsigned char>((*text)[0]))) {
      return std::nullopt;  // absent, or "max"
    }
    return std::strtoull(text->c_str(), nullptr, 10);
  };
  const auto max = cgroup_value("memory.max"), current = cgroup_value("memory.current");
  if (max && current) available = std::min(available, *max > *current ? *max - *current : 0);
  return available;
}

}  // namespace zoffload::internal
