// zoffload-bench pcie and kernels: the GPU layer against plain CUDA on the same machine, in
// the same process.
//
// pcie: H2D and D2H alone and both at once through the CopyEngine, each against plain
// cudaMemcpyAsync between the same pinned buffers (the link's peak, measured just before);
// pageable memory through staging against CUDA's direct pageable copy.
// kernels: casts, gradient accumulation, the gradient norm and the GPU Adam against a
// device-to-device cudaMemcpyAsync, as bytes moved per second.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal::bench {

struct GpuBenchOptions {
  uint64_t bytes = uint64_t{1} << 30;  ///< per transfer / per kernel input
  int repeats = 5;                     ///< timed runs (median), after one warm-up
};

struct GpuRecord {
  std::string profile;  ///< "pcie" or "kernels"
  std::string test;     ///< "h2d", "both_d2h", "pageable_h2d", "cast_fp32_bf16", ...
  uint64_t bytes = 0;   ///< bytes moved (read + written for kernels)
  double seconds = 0;   ///< median
  double gbps = 0;
  std::string anchor;  ///< what the ratio is against
  double anchor_gbps = 0;
  double ratio = 0;  ///< gbps / anchor_gbps
};

Result<std::vector<GpuRecord>> RunPcieBench(const GpuBenchOptions& options);
Result<std::vector<GpuRecord>> RunKernelBench(const GpuBenchOptions& options);

}  // namespace zoffload::internal::bench
