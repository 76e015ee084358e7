// The swap space's manifest (zoffload-swap.json) read strictly: every field of the type it
// must have, or an error naming the field; no exception escapes (the JSON library's are
// turned into DATA_LOSS). The swap space checks what the values mean (versions, paths,
// block size, checksum counts); the fuzz target tests/fuzz/manifest_fuzz.cc feeds it anything.
//
// Thread-safety: a function of its arguments.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal {

inline constexpr int kSwapManifestVersion = 1;

struct SwapManifest {
  int64_t version = 0;
  uint64_t block_size = 0;
  std::vector<std::string> paths;
  bool checksums = true;
  uint64_t generation = 0;
  struct Tensor {
    std::string key;
    uint64_t bytes = 0;
    std::string state;  // "empty", "writing", "interrupted" or "clean"
    uint64_t generation = 0;
    std::vector<uint32_t> crc;
  };
  std::vector<Tensor> tensors;
};

/// Parses manifest `text` (read from `path`, which errors name).
Result<SwapManifest> ParseSwapManifest(std::string_view text, std::string_view path);

}  // namespace zoffload::internal
