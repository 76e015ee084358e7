// zoffload-bench adam: CPU Adam throughput against a bandwidth kernel moving the same bytes
// per parameter, in the same process, over the same buffers.
#pragma once

#include <cstdint>
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
};

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
  std::string target;
};

Result<std::vector<AdamRecord>> RunAdamBench(const AdamBenchOptions& options);

}  // namespace zoffload::internal::bench
