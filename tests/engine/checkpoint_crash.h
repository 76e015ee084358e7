// What the crash test and its child process (checkpoint_crash_child) agree on.
#pragma once

#include <cstdint>

#include "engine/engine_test_util.h"

namespace zoffload::internal::testing {

/// The child's model seed and engine: int8 state, half of it on NVMe.
inline constexpr uint32_t kCrashSeed = 21;
inline const Case kCrashCase{1, false, StatePrecision::kInt8, "nvme50"};

/// One report of the child: a phase of step `step` begins ('T' the step, 'S' its save) or
/// ends ('C': the save is committed).
struct CrashMessage {
  char phase;
  int32_t step;
};

}  // namespace zoffload::internal::testing
