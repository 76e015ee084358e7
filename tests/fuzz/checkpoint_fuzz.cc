// libFuzzer: any bytes as a checkpoint's manifest.json. ParseCheckpointManifest must return a
// manifest whose fields are in range, or a Status naming the problem; never crash or throw.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string_view>

#include "engine/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto meta = zoffload::internal::ParseCheckpointManifest(text, "fuzz/manifest.json");
  if (!meta.ok()) return 0;
  // What it accepts, readers may trust: unique names, groups that exist, contiguous entries.
  std::set<std::string> names;
  uint64_t end = 0;
  for (const auto& e : meta->entries) {
    if (!names.insert(e.name).second || e.group < 0 ||
        e.group >= static_cast<int>(meta->groups.size()) || e.offset != end) {
      std::abort();
    }
    end += e.bytes();
  }
  return 0;
}
