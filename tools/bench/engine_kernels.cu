// The gradient stand-in of zoffload-bench engine: a kernel writing plausible bf16 gradients,
// then one block spinning on the GPU clock so that producing them takes a set time.
#include "bench/engine_kernels.h"

#include <cuda_runtime_api.h>

#include "gpu/cuda_status.h"

namespace zoffload::internal::bench {
namespace {

__global__ void FillKernel(uint16_t* grads, uint64_t n, uint32_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // bf16 with an exponent around 2^-10 and a random sign and mantissa.
    grads[i] = static_cast<uint16_t>(0x3A00u | (h & 0x807Fu) | ((h >> 8) & 0x0080u));
  }
}

__global__ void SpinKernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

Status ProduceGradients(void* grads, uint64_t n, uint32_t seed, uint64_t spin_ns, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + 255) / 256, 4096));
  FillKernel<<<blocks, 256, 0, s>>>(static_cast<uint16_t*>(grads), n, seed);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (spin_ns > 0) {
    SpinKernel<<<1, 1, 0, s>>>(spin_ns);
    ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::bench
