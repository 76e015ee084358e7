#include "gpu/cuda_status.h"

#include "common/strings.h"

namespace zoffload::internal {

Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  cudaGetLastError();  // Clear the (non-sticky) error so it is reported only once.
  StatusCode code = StatusCode::kInternal;
  switch (err) {
    case cudaErrorMemoryAllocation:
      code = StatusCode::kResourceExhausted;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      code = StatusCode::kFailedPrecondition;
      break;
    case cudaErrorInvalidValue:
      code = StatusCode::kInvalidArgument;
      break;
    case cudaErrorNotSupported:
      code = StatusCode::kUnimplemented;
      break;
    default:
      break;
  }
  return Status(code, StrCat(expr, " failed at ", file, ":", line, ": ", cudaGetErrorName(err),
                             ": ", cudaGetErrorString(err)));
}

Status NcclStatus(ncclResult_t res, const char* expr, const char* file, int line) {
  const char* detail = ncclGetLastError(nullptr);
  return Status(res == ncclInvalidArgument || res == ncclInvalidUsage ? StatusCode::kInvalidArgument
                                                                      : StatusCode::kInternal,
                StrCat(expr, " failed at ", file, ":", line, ": ", ncclGetErrorString(res),
                       detail != nullptr && detail[0] != '\0' ? StrCat(" (", detail, ")") : ""));
}

}  // namespace zoffload::internal
