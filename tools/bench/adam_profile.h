// zoffload-bench adam: CPU Adam throughput against a bandwidth kernel moving the same bytes
// per parameter, in the same process, over the same buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "zoffload/cpu_adam.h"
#include "zoffload/status.h"

namespace zoffload::internal::bench {

struct AdamBenchOptions {
  uint64_t params = uint64_t{256} << 20;
  int threads = 0;  ///< 0: physical cores
  std::vector<DType> grad_dtypes = {DType::kFp32};
  std::vector<StatePrecision> states = {StatePrecision::kFp32};
  std::vector<ParamCopy> copies = {ParamCopy::kNone};
  std::vector<UpdateRule> rules = {UpdateRule::kAdam};  ///< int8 state: Adam only (others skip)
  int steps = 5;  ///< timed steps per setting (after one warm-up)
  /// Test hook: runs inside the timed region of every bandwidth-ceiling pass of attempt
  /// `attempt` (a test disturbs the ceiling with it).
  std::function<void(int attempt)> inside_ceiling;
};

/// A figure is re-measured (up to kAdamAttempts times in all) when its ratio to the ceiling is
/// implausible (Adam cannot move its bytes faster than the kernel that only moves them) or
/// when its repeats spread too much; still so, it is marked noisy.
inline constexpr double kMaxPlausibleRatio = 1.10;
inline constexpr double kMaxSpread = 0.10;  ///< of the middle repeats, relative to the median
inline constexpr int kAdamAttempts = 3;

struct AdamRecord {
  uint64_t params = 0;
  int threads = 0;
  DType grad_dtype = DType::kFp32;
  StatePrecision state = StatePrecision::kFp32;
  ParamCopy copy = ParamCopy::kNone;
  UpdateRule rule = UpdateRule::kAdam;
  double bytes_per_param = 0;
  double seconds_per_step = 0;  ///< median
  double gparams_per_s = 0;
  double gbps = 0;
  double ceiling_seconds = 0;  ///< median of the bandwidth kernel on the same buffers
  double bandwidth_ratio = 0;  ///< ceiling_seconds / seconds_per_step
  double spread = 0;           ///< the larger of Adam's and the ceiling's (see kMaxSpread)
  int attempts = 1;            ///< measurements made (more than one: re-measured)
  bool noisy = false;          ///< still implausible or spread after kAdamAttempts
  std::string target;
};

Result<std::vector<AdamRecord>> RunAdamBench(const AdamBenchOptions& options);

}  // namespace zoffload::internal::bench
