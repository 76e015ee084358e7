// ZeroOptimizer (include/zoffload/zero.h) is the trainer core (engine_core.h) with the ZeRO
// partition (zero_partition.h): one rank's ZeRO stage 1, 2 or 3 over a Communicator. The public
// Create makes the rank's HostComm or NCCL communicator; ZeroAccess makes one over any
// communicator (the tests' in-process worlds).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "zero/communicator.h"
#include "zoffload/config.h"
#include "zoffload/engine.h"
#include "zoffload/status.h"
#include "zoffload/zero.h"

namespace zoffload {

struct ZeroOptimizer::Access {
  /// A ZeroOptimizer over `comm` (which must outlive it). `align`: each rank's slice of a
  /// bucket is a multiple of this many elements (16: 64 bytes of fp32).
  static Result<std::unique_ptr<ZeroOptimizer>> Create(const Config& config,
                                                       std::vector<ParameterSpec> params,
                                                       internal::zero::Communicator& comm,
                                                       ZeroOptions options = {},
                                                       uint64_t align = 16);
};

namespace internal::zero {
using ZeroAccess = ZeroOptimizer::Access;
}  // namespace internal::zero

}  // namespace zoffload
