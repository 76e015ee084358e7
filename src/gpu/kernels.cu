#include "gpu/kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/strings.h"
#include "cpu_adam/adam_math.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxNormBlocks = 1024;
constexpr int kNormTensorsPerLaunch = 512;
constexpr int kAdamTensorsPerLaunch = 256;

// Blocks for `items` thread iterations: enough to fill the device, then grid-stride loops.
Result<int> GridFor(size_t items, int max_blocks) {
  int device = 0, sms = 0;
  ZO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  ZO_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t wanted = std::max<size_t>(1, (items + kThreads - 1) / kThreads);
  return static_cast<int>(
      std::min<size_t>({wanted, static_cast<size_t>(sms) * 8, static_cast<size_t>(max_blocks)}));
}

bool Aligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// ---- element access ---------------------------------------------------------------------

__device__ __forceinline__ float Bf16BitsToFloat(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
__device__ __forceinline__ float Fp16BitsToFloat(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

template <DType kT>
__device__ __forceinline__ float LoadOne(const void* p, size_t i) {
  if constexpr (kT == DType::kFp32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (kT == DType::kBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  } else {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
}

template <DType kT>
__device__ __forceinline__ uint32_t ToBits16(float x) {
  if constexpr (kT == DType::kBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

template <DType kT>
__device__ __forceinline__ void StoreOne(void* p, size_t i, float x) {
  if constexpr (kT == DType::kFp32) {
    static_cast<float*>(p)[i] = x;
  } else {
    static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(ToBits16<kT>(x));
  }
}

template <DType kT>
__device__ __forceinline__ float FromBits16(uint32_t bits) {
  if constexpr (kT == DType::kBf16) {
    return Bf16BitsToFloat(bits);
  } else {
    return Fp16BitsToFloat(bits);
  }
}

// Elements [i, i + 8) with 16-byte accesses; the pointer is 16-byte aligned, i % 8 == 0.
template <DType kT>
__device__ __forceinline__ void Load8(const void* p, size_t i, float x[8]) {
  if constexpr (kT == DType::kFp32) {
    const float4 a = static_cast<const float4*>(p)[i / 4];
    const float4 b = static_cast<const float4*>(p)[i / 4 + 1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 u = static_cast<const uint4*>(p)[i / 8];
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = FromBits16<kT>(w[k] & 0xFFFFu);
      x[2 * k + 1] = FromBits16<kT>(w[k] >> 16);
    }
  }
}

template <DType kT>
__device__ __forceinline__ void Store8(void* p, size_t i, const float x[8]) {
  if constexpr (kT == DType::kFp32) {
    static_cast<float4*>(p)[i / 4] = make_float4(x[0], x[1], x[2], x[3]);
    static_cast<float4*>(p)[i / 4 + 1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = ToBits16<kT>(x[2 * k]) | (ToBits16<kT>(x[2 * k + 1]) << 16);
    static_cast<uint4*>(p)[i / 8] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Elements [i, i + 4): one 16-byte (fp32) or 8-byte (16-bit) access; i % 4 == 0.
template <DType kT>
__device__ __forceinline__ void Load4(const void* p, size_t i, float x[4]) {
  if constexpr (kT == DType::kFp32) {
    const float4 a = static_cast<const float4*>(p)[i / 4];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
  } else {
    const uint2 u = static_cast<const uint2*>(p)[i / 4];
    x[0] = FromBits16<kT>(u.x & 0xFFFFu), x[1] = FromBits16<kT>(u.x >> 16);
    x[2] = FromBits16<kT>(u.y & 0xFFFFu), x[3] = FromBits16<kT>(u.y >> 16);
  }
}

// ---- casts and accumulation -------------------------------------------------------------

// Narrowing casts move 8 elements per access (16-byte fp32 loads, 16-byte stores); widening
// ones 4 (8-byte loads, 16-byte stores), so that a warp's stores stay contiguous.
template <DType kS, DType kD>
__global__ void CastKernel(const void* src, void* dst, size_t n, bool vector) {
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  constexpr size_t kWidth = kD == DType::kFp32 ? 4 : 8;
  const size_t vector_end = vector ? n / kWidth * kWidth : 0;
  for (size_t i = tid * kWidth; i < vector_end; i += stride * kWidth) {
    if constexpr (kWidth == 4) {
      float x[4];
      Load4<kS>(src, i, x);
      static_cast<float4*>(dst)[i / 4] = make_float4(x[0], x[1], x[2], x[3]);
    } else {
      float x[8];
      Load8<kS>(src, i, x);
      Store8<kD>(dst, i, x);
    }
  }
  for (size_t i = vector_end + tid; i < n; i += stride) StoreOne<kD>(dst, i, LoadOne<kS>(src, i));
}

template <DType kG>
__global__ void AccumulateKernel(float* acc, const void* grad, size_t n, bool vector) {
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t vector_end = vector ? n / 4 * 4 : 0;
  for (size_t i = tid * 4; i < vector_end; i += stride * 4) {
    float4 a = reinterpret_cast<const float4*>(acc)[i / 4];
    float g[4];
    Load4<kG>(grad, i, g);
    a.x += g[0], a.y += g[1], a.z += g[2], a.w += g[3];
    reinterpret_cast<float4*>(acc)[i / 4] = a;
  }
  for (size_t i = vector_end + tid; i < n; i += stride) acc[i] += LoadOne<kG>(grad, i);
}

template <typename Kernel>
Status Launch(Kernel kernel, size_t n, cudaStream_t stream, auto... args) {
  if (n == 0) return Status::Ok();
  ZO_ASSIGN_OR_RETURN(const int grid, GridFor((n + 3) / 4, 1 << 20));
  kernel<<<grid, kThreads, 0, stream>>>(args...);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

// ---- reductions -------------------------------------------------------------------------

// The sum over the block, in thread 0; fixed order, so deterministic.
template <typename T>
__device__ T BlockSum(T v) {
  __shared__ T warp_sums[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : T{};
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  }
  return v;
}

struct NormLaunch {
  const void* data[kNormTensorsPerLaunch];
  size_t n[kNormTensorsPerLaunch];
  int count;
  bool accumulate;       // add to the result of the previous launch
  DeviceGradNorm* copy;  // the result goes here too (null: nowhere)
};

// Workspace layout: the result, the finished-block counter, then per-block partials.
struct NormScratch {
  DeviceGradNorm result;
  unsigned int blocks_done;
  unsigned int pad[3];
  double partial_sum[kMaxNormBlocks];
  unsigned int partial_bad[kMaxNormBlocks];
};

template <DType kT>
__device__ __forceinline__ void AddSquare(float x, double& sum, unsigned int& bad) {
  if (isfinite(x)) {
    sum = fma(static_cast<double>(x), static_cast<double>(x), sum);
  } else {
    ++bad;
  }
}

template <DType kT>
__global__ void __launch_bounds__(kThreads) NormKernel(const NormLaunch launch, NormScratch* s) {
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  double sum = 0;
  unsigned int bad = 0;
  for (int t = 0; t < launch.count; ++t) {
    const void* p = launch.data[t];
    const size_t n = launch.n[t];
    const size_t vector_end = reinterpret_cast<uintptr_t>(p) % 16 == 0 ? n / 8 * 8 : 0;
    for (size_t i = tid * 8; i < vector_end; i += stride * 8) {
      float x[8];
      Load8<kT>(p, i, x);
#pragma unroll
      for (int k = 0; k < 8; ++k) AddSquare<kT>(x[k], sum, bad);
    }
    for (size_t i = vector_end + tid; i < n; i += stride)
      AddSquare<kT>(LoadOne<kT>(p, i), sum, bad);
  }
  sum = BlockSum(sum);
  bad = BlockSum(bad);
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    s->partial_sum[blockIdx.x] = sum;
    s->partial_bad[blockIdx.x] = bad;
    __threadfence();  // partials visible before the counter says so
    last_block = atomicAdd(&s->blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  double total = 0;
  unsigned int total_bad = 0;
  for (unsigned int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    total += static_cast<volatile double*>(s->partial_sum)[b];
    total_bad += static_cast<volatile unsigned int*>(s->partial_bad)[b];
  }
  total = BlockSum(total);
  total_bad = BlockSum(total_bad);
  if (threadIdx.x == 0) {
    if (launch.accumulate) {
      s->result.sum_squares += total;
      s->result.nonfinite += total_bad;
    } else {
      s->result.sum_squares = total;
      s->result.nonfinite = total_bad;
    }
    if (launch.copy != nullptr) *launch.copy = s->result;
    s->blocks_done = 0;  // ready for the next launch
  }
}

// ---- Adam -------------------------------------------------------------------------------

struct AdamLaunch {
  GpuAdamTensor tensors[kAdamTensorsPerLaunch];
  int count;
  AdamCoefficients c;
  float loss_scale;
  float max_grad_norm;
  const DeviceGradNorm* norm;
};

// The CPU kernel's operations (src/cpu_adam/adam_kernels.cc, Update), each IEEE-rounded and
// never contracted differently: the same inputs give the same bits.
__device__ __forceinline__ void AdamOne(const AdamCoefficients& c, float gs, float g, float& m,
                                        float& v, float& p) {
  g = __fmul_rn(g, gs);
  g = __fmaf_rn(c.l2, p, g);
  m = __fmaf_rn(m, c.beta1, __fmul_rn(g, c.one_minus_beta1));
  v = __fmaf_rn(v, c.beta2, __fmul_rn(__fmul_rn(g, g), c.one_minus_beta2));
  const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
  p = __fmaf_rn(-c.step_size, __fdiv_rn(m, denom), __fmul_rn(p, c.decay));
}

template <ParamCopy kC>
constexpr DType kCopyType = kC == ParamCopy::kFp16 ? DType::kFp16 : DType::kBf16;

template <DType kG, ParamCopy kC>
__global__ void __launch_bounds__(kThreads) AdamKernel(const AdamLaunch launch) {
  double raw_norm = 0;
  if (launch.norm != nullptr) {
    if (launch.norm->nonfinite != 0) return;  // overflow: the step is skipped
    raw_norm = sqrt(launch.norm->sum_squares);
  }
  double grad_norm;
  float clip_coef;
  const float gs =
      ClipAndUnscale(raw_norm, launch.loss_scale,
                     launch.norm != nullptr ? launch.max_grad_norm : 0.0f, &grad_norm, &clip_coef);
  const AdamCoefficients c = launch.c;
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (int t = 0; t < launch.count; ++t) {
    const GpuAdamTensor& T = launch.tensors[t];
    const bool vector =
        reinterpret_cast<uintptr_t>(T.params) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(T.m) % 16 == 0 && reinterpret_cast<uintptr_t>(T.v) % 16 == 0 &&
        reinterpret_cast<uintptr_t>(T.grads) % (kG == DType::kFp32 ? 16 : 8) == 0 &&
        (kC == ParamCopy::kNone || reinterpret_cast<uintptr_t>(T.param_copy) % 8 == 0);
    const size_t vector_end = vector ? T.n / 4 * 4 : 0;
    for (size_t i = tid * 4; i < vector_end; i += stride * 4) {
      float4 p4 = reinterpret_cast<const float4*>(T.params)[i / 4];
      float4 m4 = reinterpret_cast<const float4*>(T.m)[i / 4];
      float4 v4 = reinterpret_cast<const float4*>(T.v)[i / 4];
      float g[4];
      Load4<kG>(T.grads, i, g);
      AdamOne(c, gs, g[0], m4.x, v4.x, p4.x);
      AdamOne(c, gs, g[1], m4.y, v4.y, p4.y);
      AdamOne(c, gs, g[2], m4.z, v4.z, p4.z);
      AdamOne(c, gs, g[3], m4.w, v4.w, p4.w);
      reinterpret_cast<float4*>(T.params)[i / 4] = p4;
      reinterpret_cast<float4*>(T.m)[i / 4] = m4;
      reinterpret_cast<float4*>(T.v)[i / 4] = v4;
      if constexpr (kC != ParamCopy::kNone) {
        constexpr DType kD = kCopyType<kC>;
        reinterpret_cast<uint2*>(T.param_copy)[i / 4] =
            make_uint2(ToBits16<kD>(p4.x) | (ToBits16<kD>(p4.y) << 16),
                       ToBits16<kD>(p4.z) | (ToBits16<kD>(p4.w) << 16));
      }
    }
    for (size_t i = vector_end + tid; i < T.n; i += stride) {
      float p = T.params[i], m = T.m[i], v = T.v[i];
      AdamOne(c, gs, LoadOne<kG>(T.grads, i), m, v, p);
      T.params[i] = p;
      T.m[i] = m;
      T.v[i] = v;
      if constexpr (kC != ParamCopy::kNone) StoreOne<kCopyType<kC>>(T.param_copy, i, p);
    }
  }
}

template <DType kG>
auto AdamKernelFor(ParamCopy copy) {
  switch (copy) {
    case ParamCopy::kBf16:
      return &AdamKernel<kG, ParamCopy::kBf16>;
    case ParamCopy::kFp16:
      return &AdamKernel<kG, ParamCopy::kFp16>;
    case ParamCopy::kNone:
      break;
  }
  return &AdamKernel<kG, ParamCopy::kNone>;
}

}  // namespace

Status Cast(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
            cudaStream_t stream) {
  const bool vector = Aligned(src, 16) && Aligned(dst, 16);
  if (src_type == DType::kFp32 && dst_type == DType::kBf16) {
    return Launch(CastKernel<DType::kFp32, DType::kBf16>, n, stream, src, dst, n, vector);
  }
  if (src_type == DType::kFp32 && dst_type == DType::kFp16) {
    return Launch(CastKernel<DType::kFp32, DType::kFp16>, n, stream, src, dst, n, vector);
  }
  if (src_type == DType::kBf16 && dst_type == DType::kFp32) {
    return Launch(CastKernel<DType::kBf16, DType::kFp32>, n, stream, src, dst, n, vector);
  }
  if (src_type == DType::kFp16 && dst_type == DType::kFp32) {
    return Launch(CastKernel<DType::kFp16, DType::kFp32>, n, stream, src, dst, n, vector);
  }
  return InvalidArgumentError(StrCat("gpu::Cast: no cast from ", ToString(src_type), " to ",
                                     ToString(dst_type), " (one side must be fp32)"));
}

Status AccumulateGrad(float* acc, const void* grad, DType grad_type, size_t n,
                      cudaStream_t stream) {
  const bool vector = Aligned(acc, 16) && Aligned(grad, 16);
  switch (grad_type) {
    case DType::kFp32:
      return Launch(AccumulateKernel<DType::kFp32>, n, stream, acc, grad, n, vector);
    case DType::kBf16:
      return Launch(AccumulateKernel<DType::kBf16>, n, stream, acc, grad, n, vector);
    case DType::kFp16:
      return Launch(AccumulateKernel<DType::kFp16>, n, stream, acc, grad, n, vector);
  }
  return InvalidArgumentError("gpu::AccumulateGrad: unknown dtype");
}

Result<GradNormWorkspace> GradNormWorkspace::Create() {
  ZO_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(sizeof(NormScratch)));
  ZO_CUDA_RETURN_IF_ERROR(cudaMemset(buffer.data(), 0, sizeof(NormScratch)));
  return GradNormWorkspace(std::move(buffer));
}

Result<GradNorm> GradNormWorkspace::Read(cudaStream_t stream) const {
  DeviceGradNorm host{};
  ZO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&host, result(), sizeof(host), cudaMemcpyDeviceToHost, stream));
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  GradNorm norm;
  norm.l2 = std::sqrt(host.sum_squares);
  norm.finite = host.nonfinite == 0;
  return norm;
}

Status MultiTensorGradNorm(std::span<const DeviceSpan> tensors, DType dtype,
                           GradNormWorkspace& workspace, cudaStream_t stream, bool accumulate,
                           DeviceGradNorm* copy) {
  auto* scratch = static_cast<NormScratch*>(workspace.buffer_.data());
  size_t first = 0;
  do {  // at least one launch, so an empty list gives a zero norm
    NormLaunch launch{};
    launch.accumulate = accumulate || first > 0;
    size_t items = 0;
    while (first < tensors.size() && launch.count < kNormTensorsPerLaunch) {
      launch.data[launch.count] = tensors[first].data;
      launch.n[launch.count] = tensors[first].n;
      items = std::max(items, (tensors[first].n + 7) / 8);
      ++launch.count;
      ++first;
    }
    if (first == tensors.size()) launch.copy = copy;
    ZO_ASSIGN_OR_RETURN(const int grid, GridFor(items, kMaxNormBlocks));
    switch (dtype) {
      case DType::kFp32:
        NormKernel<DType::kFp32><<<grid, kThreads, 0, stream>>>(launch, scratch);
        break;
      case DType::kBf16:
        NormKernel<DType::kBf16><<<grid, kThreads, 0, stream>>>(launch, scratch);
        break;
      case DType::kFp16:
        NormKernel<DType::kFp16><<<grid, kThreads, 0, stream>>>(launch, scratch);
        break;
    }
    ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  } while (first < tensors.size());
  return Status::Ok();
}

Status GpuAdam(std::span<const GpuAdamTensor> tensors, const GpuAdamStep& step,
               cudaStream_t stream) {
  if (step.hyper.rule != UpdateRule::kAdam) {
    return InvalidArgumentError(
        StrCat("GpuAdam: the GPU runs Adam/AdamW only, not ", ToString(step.hyper.rule)));
  }
  if (step.hyper.step < 1) {
    return InvalidArgumentError(StrCat("GpuAdam: step must be >= 1, got ", step.hyper.step));
  }
  if (!(step.loss_scale > 0)) {
    return InvalidArgumentError(StrCat("GpuAdam: loss_scale must be > 0, got ", step.loss_scale));
  }
  for (const GpuAdamTensor& t : tensors) {
    if (t.n > 0 && (t.params == nullptr || t.m == nullptr || t.v == nullptr || t.grads == nullptr ||
                    (step.copy != ParamCopy::kNone && t.param_copy == nullptr))) {
      return InvalidArgumentError("GpuAdam: params, m, v, grads (and param_copy) must be set");
    }
  }
  auto kernel = step.grad_dtype == DType::kBf16   ? AdamKernelFor<DType::kBf16>(step.copy)
                : step.grad_dtype == DType::kFp16 ? AdamKernelFor<DType::kFp16>(step.copy)
                                                  : AdamKernelFor<DType::kFp32>(step.copy);
  for (size_t first = 0; first < tensors.size();) {
    AdamLaunch launch{};
    launch.c = MakeAdamCoefficients(step.hyper);
    launch.loss_scale = step.loss_scale;
    launch.max_grad_norm = step.max_grad_norm;
    launch.norm = step.norm;
    size_t items = 0;
    while (first < tensors.size() && launch.count < kAdamTensorsPerLaunch) {
      launch.tensors[launch.count++] = tensors[first];
      items = std::max(items, (tensors[first].n + 3) / 4);
      ++first;
    }
    ZO_ASSIGN_OR_RETURN(const int grid, GridFor(items, 1 << 20));
    kernel<<<grid, kThreads, 0, stream>>>(launch);
    ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::gpu
