// zoffload-bench engine: whole OffloadEngine steps — gradients produced on the GPU by a kernel
// spread over a set time (standing in for backward) and handed over as they appear, then
// Step — against bounds measured in the same run: gradient production alone, CPU Adam alone
// on the same data (every tensor, the same layout and chunks) and one chunk's upload at the
// measured pinned H2D rate. Host
// RSS and GPU memory are reported next to what the state needs. Without a GPU the engine runs
// in host mode (gradients written by a host loop).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tiers/optimizer_state.h"
#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal::bench {

struct EngineBenchOptions {
  uint64_t params = uint64_t{256} << 20;
  int tensors = 64;
  double grad_ms = 0;  ///< gradient production spread over this long; 0: as fast as it goes
  Overlap overlap = Overlap::kNone;  ///< zoffload.overlap of the engine
  StatePrecision state = StatePrecision::kFp32;
  StateHome state_on = StateHome::kHost;
  std::vector<std::string> paths = {"."};  ///< NVMe state: temporary directories are made here
  AioConfig aio;
  int threads = 0;               ///< CPU Adam threads; 0: physical cores
  uint64_t bucket_elements = 0;  ///< reduce_bucket_size; 0: the config's default
  int steps = 3;                 ///< timed steps (median), after one warm-up step
  bool host_mode = false;        ///< force host mode even with a GPU
  std::string trace_path;
};

struct EngineRecord {
  uint64_t params = 0;
  int tensors = 0;
  std::string mode, state, state_on, overlap;
  int threads = 0;
  double step_seconds = 0;        ///< median: first gradient produced -> parameters on the GPU
  double grads_seconds = 0;       ///< median: until every gradient is in host memory
  double grad_alone_seconds = 0;  ///< gradient production alone (no engine)
  double d2h_overhead = 0;        ///< grads_seconds / grad_alone_seconds - 1 (target <= 0.05)
  double update_seconds = 0;      ///< median: Step's update (norm, CPU Adam, uploads)
  /// CPU Adam alone on the same sizes and layout (norm + chunked update with its bf16 copy)
  double adam_alone_seconds = 0;
  double adam_alone_gparams = 0;
  double h2d_gbps = 0;  ///< pinned host -> device, measured here
  double chunk_upload_seconds = 0;
  /// none: grad_alone + adam_alone + chunk_upload; backward: max(grad_alone, adam_alone) +
  /// chunk_upload; delayed: max(grad_alone, adam_alone)
  double bound_seconds = 0;
  double ratio = 0;                ///< step_seconds / bound_seconds (target <= 1.10)
  uint64_t host_rss_bytes = 0;     ///< the process's RSS growth from creating the engine on
  uint64_t engine_host_bytes = 0;  ///< what the engine holds by its own count
  uint64_t state_bytes = 0;        ///< 12 B/param fp32 state (or its precision) + gradient bytes
  double host_ratio = 0;           ///< host_rss_bytes / state_bytes
  double create_seconds = 0;       ///< OffloadEngine::Create: state allocated and initialized
  uint64_t gpu_bytes = 0;          ///< device memory taken by creating the engine
  uint64_t bucket_bytes = 0;       ///< two buckets: what the GPU memory may be
  uint64_t bytes_to_host = 0, bytes_to_gpu = 0;
  uint64_t chunk_elements = 0;
};

Result<EngineRecord> RunEngineBench(const EngineBenchOptions& options);

}  // namespace zoffload::internal::bench
