// What the CUDA driver, runtime and NCCL report about this machine's GPUs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal {

struct GpuDeviceInfo {
  int index = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  uint64_t total_bytes = 0, free_bytes = 0;
  std::string pci_bus_id;  ///< "0000:3b:00.0"
  std::string pcie_link;   ///< "32.0 GT/s PCIe x16" from sysfs, or "unknown"
};

struct GpuReport {
  int driver_version = 0;  ///< e.g. 13000 for 13.0; 0 when no driver
  int runtime_version = 0;
  std::string nccl_version;  ///< "2.28.3"
  std::vector<GpuDeviceInfo> devices;
};

/// The number of usable GPUs; an error saying why when there are none ("no usable GPU: ...": no
/// driver, no device).
Result<int> UsableGpuCount();

/// Asks the driver for every GPU. Without a usable driver or device the error says why
/// (FAILED_PRECONDITION: "no usable GPU: ...").
Result<GpuReport> ProbeGpus();

/// The PCI bus id of CUDA device `device`, lower case ("0000:3b:00.0"), as hwloc and sysfs
/// spell it.
Result<std::string> PciBusIdOf(int device);

/// NCCL's version ("2.28.3"), from ncclGetVersion.
Result<std::string> NcclVersion();

/// CUDA runtime version this library was built against (e.g. 13000).
int CudaRuntimeVersion();

}  // namespace zoffload::internal
