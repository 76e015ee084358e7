#include "gpu/gpu_info.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cctype>
#include <fstream>

#include "common/strings.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal {
namespace {

std::string ReadSysfsLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return in ? line : "";
}

}  // namespace

Result<std::string> PciBusIdOf(int device) {
  char bus_id[32] = {};
  ZO_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device));
  std::string id = bus_id;
  std::transform(id.begin(), id.end(), id.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return id;
}

int CudaRuntimeVersion() {
  int version = 0;
  return cudaRuntimeGetVersion(&version) == cudaSuccess ? version : 0;
}

Result<std::string> NcclVersion() {
  int code = 0;
  ZO_NCCL_RETURN_IF_ERROR(ncclGetVersion(&code));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
  return StrCat(code / 10000, ".", (code % 10000) / 100, ".", code % 100);
}

Result<int> UsableGpuCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    const Status s = CudaStatus(err, "cudaGetDeviceCount(&count)", __FILE__, __LINE__);
    const int runtime = CudaRuntimeVersion();
    std::string what;
    switch (err) {
      case cudaErrorInsufficientDriver:
        what = StrCat("the NVIDIA driver is missing or older than this build's CUDA runtime ",
                      runtime / 1000, ".", runtime % 1000 / 10,
                      ": install a driver for it, or train in host mode");
        break;
      case cudaErrorNoDevice:
        what = "no NVIDIA GPU was found (check nvidia-smi and CUDA_VISIBLE_DEVICES)";
        break;
      default:
        what = s.message();
    }
    return Status(StatusCode::kFailedPrecondition, StrCat("no usable GPU: ", what));
  }
  if (count == 0) return FailedPreconditionError("no usable GPU: the driver reports 0 devices");
  return count;
}

Result<GpuReport> ProbeGpus() {
  GpuReport report;
  report.runtime_version = CudaRuntimeVersion();
  if (cudaDriverGetVersion(&report.driver_version) != cudaSuccess) report.driver_version = 0;
  auto nccl = NcclVersion();
  report.nccl_version = nccl.ok() ? *nccl : nccl.status().message();
  ZO_ASSIGN_OR_RETURN(const int count, UsableGpuCount());
  for (int i = 0; i < count; ++i) {
    GpuDeviceInfo info;
    info.index = i;
    cudaDeviceProp prop{};
    ZO_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i));
    info.name = prop.name;
    info.compute_major = prop.major;
    info.compute_minor = prop.minor;
    ZO_ASSIGN_OR_RETURN(info.pci_bus_id, PciBusIdOf(i));
    ZO_CUDA_RETURN_IF_ERROR(cudaSetDevice(i));
    size_t free_bytes = 0, total_bytes = 0;
    ZO_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    info.free_bytes = free_bytes;
    info.total_bytes = total_bytes;
    const std::string sys = StrCat("/sys/bus/pci/devices/", info.pci_bus_id, "/");
    const std::string speed = ReadSysfsLine(sys + "current_link_speed");
    const std::string width = ReadSysfsLine(sys + "current_link_width");
    info.pcie_link = speed.empty() ? "unknown" : StrCat(speed, " x", width);
    report.devices.push_back(std::move(info));
  }
  return report;
}

}  // namespace zoffload::internal
