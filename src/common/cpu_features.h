// SIMD targets: which Highway targets this binary was compiled for, and which of them the
// running CPU supports (what dynamic dispatch will choose from).
#pragma once

#include <string>
#include <vector>

namespace zoffload::internal {

struct SimdTarget {
  std::string name;  ///< Highway's name ("AVX3", "AVX2", "EMU128", ...)
  bool supported;    ///< the CPU can run it
};

/// Targets compiled into this binary, best first, with CPU support of each.
std::vector<SimdTarget> SimdTargets();

/// The best target both compiled and supported: what HWY_DYNAMIC_DISPATCH picks.
std::string BestSimdTarget();

}  // namespace zoffload::internal
