#include "gpu/cuda_status.h"

#include "common/log.h"
#include "common/strings.h"

namespace zoffload::internal {

namespace {

// The function a failed call expression calls ("cudaMemcpyAsync(dst, ...)" -> "cudaMemcpyAsync"):
// what the user is told; the expression and the source location go to the debug log.
std::string CallName(const char* expr) {
  const std::string_view e(expr);
  return std::string(e.substr(0, e.find('(')));
}

}  // namespace

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
  Log(LogLevel::kDebug, StrCat(expr, " failed at ", file, ":", line, ": ", cudaGetErrorName(err)));
  return Status(code, StrCat(CallName(expr), " failed: ", cudaGetErrorName(err), ": ",
                             cudaGetErrorString(err)));
}

Status NcclStatus(ncclResult_t res, const char* expr, const char* file, int line) {
  const char* detail = ncclGetLastError(nullptr);
  Log(LogLevel::kDebug,
      StrCat(expr, " failed at ", file, ":", line, ": ", ncclGetErrorString(res)));
  return Status(res == ncclInvalidArgument || res == ncclInvalidUsage ? StatusCode::kInvalidArgument
                                                                      : StatusCode::kInternal,
                StrCat(CallName(expr), " failed: ", ncclGetErrorString(res),
                       detail != nullptr && detail[0] != '\0' ? StrCat(" (", detail, ")") : ""));
}

}  // namespace zoffload::internal
