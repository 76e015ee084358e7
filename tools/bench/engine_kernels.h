// The gradient stand-in of zoffload-bench engine (CUDA builds only).
#pragma once

#include <cstdint>

#include "zoffload/status.h"

namespace zoffload::internal::bench {

/// Writes `n` bf16 gradients into device memory `grads` on `stream` (a cudaStream_t), then
/// keeps the stream busy until `spin_ns` nanoseconds have passed on the GPU.
Status ProduceGradients(void* grads, uint64_t n, uint32_t seed, uint64_t spin_ns, void* stream);

}  // namespace zoffload::internal::bench
