#include "engine/param_math.h"

#include <cmath>
#include <cstring>

#include "common/strings.h"

namespace zoffload::internal {
namespace {

float Widen(const void* src, DType dtype, uint64_t i) {
  switch (dtype) {
    case DType::kFp32:
      return static_cast<const float*>(src)[i];
    case DType::kBf16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(src)[i]) << 16;
      float x;
      std::memcpy(&x, &bits, 4);
      return x;
    }
    case DType::kFp16:
      break;
  }
  return static_cast<float>(static_cast<const _Float16*>(src)[i]);
}

}  // namespace

void Accumulate(float* dst, const void* src, DType dtype, uint64_t n, bool add) {
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static) if (n >= (uint64_t{1} << 20))
  for (int64_t i = 0; i < count; ++i) {
    const float g = Widen(src, dtype, static_cast<uint64_t>(i));
    dst[i] = add ? dst[i] + g : g;
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
  if (g.lr >= 0 && g.beta1 >= 0 && g.beta1 < 1 && g.beta2 >= 0 && g.beta2 < 1 && g.eps > 0 &&
      g.weight_decay >= 0) {
    return Status::Ok();
  }
  return InvalidArgumentError(
      StrCat(where, ": lr ", g.lr, ", betas (", g.beta1, ", ", g.beta2, "), eps ", g.eps,
             ", weight_decay ", g.weight_decay,
             ": need lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0"));
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
