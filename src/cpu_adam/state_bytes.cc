// The byte layout of the optimizer state's precisions: apart from the kernels, so that readers
// of checkpoints (and their fuzz target) need no SIMD code.
#include "zoffload/cpu_adam.h"

namespace zoffload {

size_t AdamMomentBytes(StatePrecision precision, size_t n) {
  switch (precision) {
    case StatePrecision::kFp32:
      return 4 * n;
    case StatePrecision::kBf16:
      return 2 * n;
    case StatePrecision::kInt8:
      return ((n + 3) & ~size_t{3}) + 4 * ((n + kInt8StateBlock - 1) / kInt8StateBlock);
  }
  return 0;
}

}  // namespace zoffload
