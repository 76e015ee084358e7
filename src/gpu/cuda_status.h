// CUDA and NCCL return codes as Status, with the failing expression and its location.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "zoffload/status.h"

namespace zoffload::internal {

/// Status for a CUDA runtime error; also reads and clears the thread's last error so a
/// sticky error is reported once, here, not by an unrelated later call.
Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line);

/// Status for an NCCL error, with ncclGetLastError's detail.
Status NcclStatus(ncclResult_t res, const char* expr, const char* file, int line);

}  // namespace zoffload::internal

#define ZO_CUDA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                  \
    const cudaError_t zo_cuda_err_ = (expr);                                            \
    if (zo_cuda_err_ != cudaSuccess) {                                                  \
      return ::zoffload::internal::CudaStatus(zo_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                   \
  } while (false)

#define ZO_NCCL_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                  \
    const ncclResult_t zo_nccl_res_ = (expr);                                           \
    if (zo_nccl_res_ != ncclSuccess) {                                                  \
      return ::zoffload::internal::NcclStatus(zo_nccl_res_, #expr, __FILE__, __LINE__); \
    }                                                                                   \
  } while (false)
