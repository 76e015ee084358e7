// What the OffloadEngine and the ZeRO optimizer (src/zero) both do to parameters, gradients
// and parameter groups on the host.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "zoffload/cpu_adam.h"
#include "zoffload/dtype.h"
#include "zoffload/engine.h"
#include "zoffload/status.h"

namespace zoffload::internal {

/// dst[i] = src[i] (add: dst[i] += src[i]) in fp32, for i < n; src holds `dtype` values.
void Accumulate(float* dst, const void* src, DType dtype, uint64_t n, bool add);
/// dst[i] += src[i] in `dtype` itself, for i < n: each sum computed in fp32 and rounded to
/// `dtype` (to nearest even), as torch adds a gradient into a parameter's .grad.
void AddInDtype(void* dst, const void* src, DType dtype, uint64_t n);
/// fp32 -> `dtype` (round to nearest even), n values.
void CastFromFloat(const float* in, void* out, DType dtype, uint64_t n);
/// The low-precision copy CPU Adam writes for parameters of `dtype` (none for fp32).
ParamCopy CopyFor(DType dtype);
/// INVALID_ARGUMENT (prefixed by `where`) unless the group's hyperparameters are usable.
Status CheckGroup(const ParamGroup& g, std::string_view where);
/// The groups a trainer starts with: `given`, or one from the config's optimizer.params; each
/// checked (errors prefixed by `who`).
Result<std::vector<ParamGroup>> StartingGroups(const std::vector<ParamGroup>& given,
                                               const OptimizerConfig& optimizer,
                                               std::string_view who);
/// INVALID_ARGUMENT (prefixed by `who`) naming the first spec without a name, memory or
/// elements, in no group of `groups`, whose shape has other elements, or whose name repeats.
Status CheckSpecs(const std::vector<ParameterSpec>& specs, size_t groups, std::string_view who);
/// Each group's hyperparameters on top of `base` (the rule and the step).
std::vector<AdamHyper> GroupHypers(const std::vector<ParamGroup>& groups, const AdamHyper& base);

}  // namespace zoffload::internal
