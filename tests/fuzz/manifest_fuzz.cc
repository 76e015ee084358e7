// libFuzzer: any bytes as a swap manifest (zoffload-swap.json). ParseSwapManifest must return
// a manifest or a Status naming the problem, never crash or throw.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "swap/swap_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto manifest = zoffload::internal::ParseSwapManifest(text, "fuzz.json");
  (void)manifest;
  return 0;
}
