// Element types of the tensors zoffload moves and updates: gradients, parameter copies and
// the tensors of the TensorStore.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "zoffload/export.h"

ZO_API_BEGIN
namespace zoffload {

enum class DType : uint8_t { kFp32, kBf16, kFp16 };

/// "fp32", "bf16" or "fp16".
constexpr std::string_view ToString(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return "fp32";
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      break;
  }
  return "fp16";
}

/// Bytes per element of `dtype`.
constexpr size_t DTypeBytes(DType dtype) { return dtype == DType::kFp32 ? 4 : 2; }

}  // namespace zoffload
ZO_API_END
