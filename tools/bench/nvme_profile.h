// zoffload-bench nvme: sequential O_DIRECT throughput of the NVMe engine over a sweep of
// aio settings, on files in the given directories (striped over them as the swap space does).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal::bench {

struct NvmeBenchOptions {
  std::vector<std::string> paths = {"."};
  uint64_t size = uint64_t{4} << 30;  ///< bytes per pass (all paths together)
  std::vector<uint64_t> block_sizes = {1 << 20, 4 << 20};
  std::vector<int> queue_depths = {8, 32};
  std::vector<int> threads = {1, 2};
  std::vector<std::string> ops = {"write", "read"};
  bool single_submit = false;
  bool overlap_events = true;
  /// Use this file (one path only) and keep it, instead of a temporary file per path.
  std::string file;
  /// `file` may be an existing file: the benchmark writes over it (without this, refused).
  bool overwrite = false;
};

struct NvmeRecord {
  std::string op;
  uint64_t block_size = 0;
  int queue_depth = 0;
  int threads = 0;
  bool single_submit = false;
  bool overlap_events = true;
  uint64_t bytes = 0;
  double seconds = 0;
  double gbps = 0;      ///< 1e9 bytes per second
  bool direct = false;  ///< O_DIRECT was in use (else the page cache was: not a disk speed)
  bool in_ram = false;  ///< a file is on tmpfs/ramfs: memory speed, not a disk's
  std::string backend;
  bool registered = false;  ///< registered buffers and files
};

/// Runs the sweep (the product of block sizes, queue depths, threads and ops), printing
/// progress to stderr. Temporary files are removed on return, also on error.
Result<std::vector<NvmeRecord>> RunNvmeBench(const NvmeBenchOptions& options);

/// The aio settings that suit these disks: the best harmonic mean of read and write speed
/// among settings measured for both (else the best of the one op measured).
AioConfig RecommendAio(const std::vector<NvmeRecord>& records);

/// `{"aio": {...}}` with exactly the keys the config parser reads.
std::string AioConfigJson(const AioConfig& aio);

}  // namespace zoffload::internal::bench
