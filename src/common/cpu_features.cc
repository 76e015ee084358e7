#include "common/cpu_features.h"

#include <hwy/highway.h>
#include <hwy/targets.h>

namespace zoffload::internal {

std::vector<SimdTarget> SimdTargets() {
  std::vector<SimdTarget> targets;
  const int64_t supported = hwy::SupportedTargets();
  for (int i = 0; i < 63; ++i) {
    const int64_t bit = int64_t{1} << i;
    if ((HWY_TARGETS & bit) == 0) continue;
    targets.push_back({hwy::TargetName(bit), (supported & bit) != 0});
  }
  return targets;  // Highway's bit order: lower bits are the better targets.
}

std::string BestSimdTarget() {
  for (const SimdTarget& t : SimdTargets()) {
    if (t.supported) return t.name;
  }
  return "none";
}

}  // namespace zoffload::internal
