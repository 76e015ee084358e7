#include "tiers/device_copy.h"

#include "build_info.h"
#if ZO_HAVE_CUDA
#include "gpu/copy_engine.h"
#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal {

#if ZO_HAVE_CUDA
namespace {

class CudaDeviceCopy final : public DeviceCopy {
 public:
  CudaDeviceCopy(DeviceMemory memory, CopyEngine& copies)
      : memory_(std::move(memory)), copies_(copies) {}
  std::byte* data() const override { return memory_.as<std::byte>(); }

  Future<> StartUpload(const HostMemory& host) override {
    if (host.pinned()) return copies_.HostToDevice(data(), host.data(), host.size());
    return copies_.HostToDeviceStaged(data(), host.data(), host.size());
  }

  Status Download(const HostMemory& host) override {
    if (!host.pinned()) return copies_.DeviceToHostStaged(host.data(), data(), host.size());
    return copies_.DeviceToHost(host.data(), data(), host.size()).Wait();
  }

 private:
  DeviceMemory memory_;
  CopyEngine& copies_;
};

}  // namespace

Status DeviceCopiesAvailable(Runtime& rt) {
  if (rt.has_gpu()) return Status::Ok();
  return UsableGpuCount().status();
}

Result<std::unique_ptr<DeviceCopy>> AllocateDeviceCopy(Runtime& rt, uint64_t bytes,
                                                       std::string_view what) {
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt.Copies());
  ZO_ASSIGN_OR_RETURN(DeviceMemory memory, rt.AllocateDevice(bytes, what));
  return std::unique_ptr<DeviceCopy>(new CudaDeviceCopy(std::move(memory), *copies));
}

#else

Status DeviceCopiesAvailable(Runtime&) {
  return FailedPreconditionError("GPU residency needs a GPU, and this build has no CUDA");
}

Result<std::unique_ptr<DeviceCopy>> AllocateDeviceCopy(Runtime& rt, uint64_t, std::string_view) {
  return DeviceCopiesAvailable(rt);
}

#endif

}  // namespace zoffload::internal
