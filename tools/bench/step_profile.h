// zoffload-bench step: real optimizer steps over state kept in host memory or streamed from
// NVMe, against their bounds measured in the same run: the disk (an I/O-only pass moving the
// same bytes through our pipeline, and the disk alone on the same path: read, write, and both
// at once) and CPU Adam alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tiers/optimizer_state.h"
#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal::bench {

struct StepBenchOptions {
  uint64_t params = uint64_t{128} << 20;  ///< 128M params: 1.5 GiB of fp32 state
  int tensors = 16;                       ///< the params split into this many tensors
  StateHome state_on = StateHome::kNvme;
  /// State on NVMe: the share of it there (OptimizerStateOptions::offload_ratio); whole
  /// tensors make up the rest, in host memory.
  double nvme_ratio = 1.0;
  std::vector<std::string> paths = {"."};
  StatePrecision state = StatePrecision::kFp32;
  DType grad_dtype = DType::kBf16;
  ParamCopy copy = ParamCopy::kBf16;
  AioConfig aio;
  int buffers = 4;
  uint64_t chunk_elements = 0;  ///< PipelineOptions::chunk_elements (0: derived)
  bool checksums = true;        ///< CRC32C per swap block (SwapSpaceOptions::checksums)
  bool durable = false;         ///< flush every commit to the device (SwapSpaceOptions::durable)
  int threads = 0;
  int steps = 3;  ///< timed steps (median), after one warm-up step
  std::string trace_path;
};

struct StepRecord {
  uint64_t params = 0;
  int tensors = 0;
  std::string state_on, state;
  double step_seconds = 0;  ///< median
  uint64_t bytes_read = 0, bytes_written = 0;
  /// The disk alone on the same path, aio settings and durability (writes end with
  /// fdatasync): read, write, and reads and writes at once.
  double read_gbps = 0, write_gbps = 0, mixed_gbps = 0;
  /// (bytes_read + bytes_written) at the disk's reads-and-writes-at-once bandwidth: the I/O
  /// bound, reads and writes overlapped as the disk allows.
  double io_bound_seconds = 0;
  double io_serial_seconds = 0;   ///< bytes_read / read bandwidth + bytes_written / write bandwidth
  double io_pass_seconds = 0;     ///< our pipeline moving the step's bytes with no update
  double adam_bound_seconds = 0;  ///< CPU Adam (norm + update) alone on the same data
  double io_ratio = 0;            ///< step_seconds / io_bound_seconds (target <= 1.15)
  /// The same ratio from the fastest step and the fastest disk pass: less sensitive to a
  /// disk (or a virtual one) that stalls now and then.
  double io_ratio_best = 0;
  double adam_ratio = 0;  ///< step_seconds / adam_bound_seconds
  double nvme_ratio = 1;  ///< the share of the state on NVMe
  /// State on NVMe: max(io_bound_seconds, adam_bound_seconds), the step with CPU Adam and the
  /// disk fully overlapped (with a host share, its Adam under the NVMe share's I/O).
  double bound_seconds = 0;
  double bound_ratio = 0;   ///< step_seconds / bound_seconds
  uint64_t host_bytes = 0;  ///< host memory the state holds (state or pipeline slots)
  uint64_t chunk_elements = 0;
  int buffers = 0;
};

Result<StepRecord> RunStepBench(const StepBenchOptions& options);

}  // namespace zoffload::internal::bench
