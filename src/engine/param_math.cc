#include "engine/param_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>

#include "common/strings.h"

namespace zoffload::internal {
namespace {

// dst[i] = src[i] (add: +=) for i < n, `Widen` turning one source value into a float. One loop per
// dtype and mode, with nothing to decide inside it, so that the compiler vectorizes it (a
// switch per element ran at a third of the speed).
template <typename T, typename WidenFn>
void AccumulateAs(float* dst, const void* src, uint64_t n, bool add, WidenFn widen) {
  const T* in = static_cast<const T*>(src);
  const auto count = static_cast<int64_t>(n);
  if (add) {
#pragma omp parallel for schedule(static) if (n >= (uint64_t{1} << 20))
    for (int64_t i = 0; i < count; ++i) dst[i] += widen(in[i]);
  } else {
#pragma omp parallel for schedule(static) if (n >= (uint64_t{1} << 20))
    for (int64_t i = 0; i < count; ++i) dst[i] = widen(in[i]);
  }
}

}  // namespace

void Accumulate(float* dst, const void* src, DType dtype, uint64_t n, bool add) {
  switch (dtype) {
    case DType::kFp32:
      AccumulateAs<float>(dst, src, n, add, [](float x) { return x; });
      return;
    case DType::kBf16:
      AccumulateAs<uint16_t>(dst, src, n, add, [](uint16_t b) {
        const uint32_t bits = static_cast<uint32_t>(b) << 16;
        float x;
        std::memcpy(&x, &bits, 4);
        return x;
      });
      return;
    case DType::kFp16:
      AccumulateAs<_Float16>(dst, src, n, add, [](_Float16 h) { return static_cast<float>(h); });
      return;
  }
}

void AddInDtype(void* dst, const void* src, DType dtype, uint64_t n) {
  if (dtype == DType::kFp32) {
    Accumulate(static_cast<float*>(dst), src, dtype, n, /*add=*/true);
    return;
  }
  // Through fp32 in blocks: widen the sums, add the new values, round back.
  constexpr uint64_t kBlock = 4096;
  float sums[kBlock];
  const size_t width = DTypeBytes(dtype);
  for (uint64_t first = 0; first < n; first += kBlock) {
    const uint64_t len = std::min(kBlock, n - first);
    std::byte* out = static_cast<std::byte*>(dst) + first * width;
    Accumulate(sums, out, dtype, len, /*add=*/false);
    Accumulate(sums, static_cast<const std::byte*>(src) + first * width, dtype, len, /*add=*/true);
    CastFromFloat(sums, out, dtype, len);
  }
}

void CastFromFloat(const float* in, void* out, DType dtype, uint64_t n) {
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(out, in, 4 * n);
      return;
    case DType::kBf16:
      for (uint64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, in + i, 4);
        static_cast<uint16_t*>(out)[i] =
            std::isnan(in[i]) ? uint16_t{0x7fc0}
                              : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
      }
      return;
    case DType::kFp16:
      for (uint64_t i = 0; i < n; ++i)
        static_cast<_Float16*>(out)[i] = static_cast<_Float16>(in[i]);
      return;
  }
}

ParamCopy CopyFor(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return ParamCopy::kBf16;
    case DType::kFp16:
      return ParamCopy::kFp16;
    case DType::kFp32:
      break;
  }
  return ParamCopy::kNone;
}

Status CheckGroup(const ParamGroup& g, std::string_view where) {
  const std::vector<std::string> problems = HyperparameterProblems(g);
  if (problems.empty()) return Status::Ok();
  std::string message(where);
  for (const std::string& problem : problems)
    message += StrCat(problems.size() > 1 ? "\n  " : ": ", problem);
  return InvalidArgumentError(std::move(message));
}

Result<std::vector<ParamGroup>> StartingGroups(const std::vector<ParamGroup>& given,
                                               const OptimizerConfig& optimizer,
                                               std::string_view who) {
  std::vector<ParamGroup> groups =
      given.empty() ? std::vector<ParamGroup>{ParamGroup::FromConfig(optimizer)} : given;
  for (size_t g = 0; g < groups.size(); ++g) {
    ZO_RETURN_IF_ERROR(CheckGroup(groups[g], StrCat(who, ": parameter group ", g)));
  }
  return groups;
}

Status CheckSpecs(const std::vector<ParameterSpec>& specs, size_t groups, std::string_view who) {
  if (specs.empty()) return InvalidArgumentError(StrCat(who, ": no parameters given"));
  std::set<std::string_view> names;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParameterSpec& s = specs[i];
    if (s.name.empty())
      return InvalidArgumentError(StrCat(who, ": parameter #", i, " has no name"));
    if (s.elements == 0 || s.data == nullptr) {
      return InvalidArgumentError(StrCat(who, ": parameter '", s.name,
                                         "' needs memory and at least 1 element (got ", s.elements,
                                         " elements at ", s.data, ")"));
    }
    if (s.group < 0 || static_cast<size_t>(s.group) >= groups) {
      return InvalidArgumentError(StrCat(who, ": parameter '", s.name, "' is in group ", s.group,
                                         "; there are ", groups, " groups"));
    }
    uint64_t shape_elements = 1;
    std::string shape;
    for (uint64_t d : s.shape) {
      shape_elements *= d;
      shape += StrCat(shape.empty() ? "" : ", ", d);
    }
    if (!s.shape.empty() && shape_elements != s.elements) {
      return InvalidArgumentError(StrCat(who, ": parameter '", s.name, "' has shape [", shape,
                                         "] (", shape_elements, " elements) but ", s.elements,
                                         " elements"));
    }
    if (!names.insert(s.name).second) {
      return InvalidArgumentError(StrCat(who, ": parameter '", s.name, "' is given twice"));
    }
  }
  return Status::Ok();
}

std::vector<AdamHyper> GroupHypers(const std::vector<ParamGroup>& groups, const AdamHyper& base) {
  std::vector<AdamHyper> hypers;
  for (const ParamGroup& g : groups) {
    AdamHyper h = base;
    h.lr = static_cast<float>(g.lr);
    h.beta1 = static_cast<float>(g.beta1);
    h.beta2 = static_cast<float>(g.beta2);
    h.eps = static_cast<float>(g.eps);
    h.weight_decay = static_cast<float>(g.weight_decay);
    hypers.push_back(h);
  }
  return hypers;
}

}  // namespace zoffload::internal
