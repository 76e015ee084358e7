// GPU kernels of the offload step: casts, gradient accumulation, the multi-tensor gradient
// norm with inf/NaN check, and a multi-tensor Adam/AdamW that computes exactly the float
// operations of the CPU Adam (src/cpu_adam), so state can move between the two.
//
// Every kernel reads and writes 16 bytes per access where the pointers allow (any pointer
// works; unaligned ones take a scalar path), is enqueued on the caller's stream and never
// synchronizes the host. Conversions to bf16/fp16 round to nearest even.
//
// Thread-safety: the functions are reentrant; a GradNormWorkspace serves one stream at a time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>

#include "gpu/device_buffer.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/status.h"

namespace zoffload::internal::gpu {

/// dst[i] = src[i] for i < n: fp32 to bf16/fp16 or bf16/fp16 to fp32.
Status Cast(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
            cudaStream_t stream);

/// acc[i] += grad[i] in fp32 (micro-batch gradient accumulation).
Status AccumulateGrad(float* acc, const void* grad, DType grad_type, size_t n, cudaStream_t stream);

/// One tensor of a multi-tensor launch (device memory).
struct DeviceSpan {
  const void* data = nullptr;
  size_t n = 0;  ///< elements
};

/// The gradient norm as it lands in device memory.
struct DeviceGradNorm {
  double sum_squares;      ///< of the raw gradients, float64
  unsigned int nonfinite;  ///< number of inf/NaN elements
  unsigned int reserved;
};

/// Device scratch and result of MultiTensorGradNorm; one per stream using it.
class GradNormWorkspace {
 public:
  static Result<GradNormWorkspace> Create();
  /// Device pointer to the result; valid once the stream has run the norm.
  const DeviceGradNorm* result() const { return buffer_.as<const DeviceGradNorm>(); }
  /// Copies the result to the host (synchronizes `stream`).
  Result<GradNorm> Read(cudaStream_t stream) const;

 private:
  friend Status MultiTensorGradNorm(std::span<const DeviceSpan>, DType, GradNormWorkspace&,
                                    cudaStream_t, bool, DeviceGradNorm*);
  explicit GradNormWorkspace(DeviceBuffer buffer) : buffer_(std::move(buffer)) {}
  DeviceBuffer buffer_;
};

/// Sum of squares (float64) and inf/NaN count over every element of `tensors` (all of
/// `dtype`), into workspace.result(), or, with `accumulate`, added to what the workspace's
/// launches before this one (on the same stream, or ordered before it) left there; with
/// `copy` (device memory) the result is also written there. One launch per 512 tensors;
/// deterministic (fixed grid, fixed reduction order).
Status MultiTensorGradNorm(std::span<const DeviceSpan> tensors, DType dtype,
                           GradNormWorkspace& workspace, cudaStream_t stream,
                           bool accumulate = false, DeviceGradNorm* copy = nullptr);

/// One parameter tensor of the GPU Adam: fp32 master, fp32 m and v, gradients of the step's
/// grad dtype, optional low-precision copy of the updated parameters (device memory).
struct GpuAdamTensor {
  float* params = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grads = nullptr;
  void* param_copy = nullptr;  ///< when the step's copy is not kNone
  size_t n = 0;
};

struct GpuAdamStep {
  AdamHyper hyper;
  DType grad_dtype = DType::kFp32;
  ParamCopy copy = ParamCopy::kNone;
  float loss_scale = 1.0f;
  float max_grad_norm = 0.0f;  ///< 0: no clipping
  /// When set, the kernel reads the norm on the device: an inf/NaN count skips the step
  /// (nothing written) and clipping uses it, all without a host round trip. When null the
  /// gradients must be finite and are only unscaled.
  const DeviceGradNorm* norm = nullptr;
};

/// Adam/AdamW over many tensors, one launch per 256 tensors.
Status GpuAdam(std::span<const GpuAdamTensor> tensors, const GpuAdamStep& step,
               cudaStream_t stream);

}  // namespace zoffload::internal::gpu
