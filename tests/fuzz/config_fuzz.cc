// libFuzzer: any bytes through the config parser. It must return a config or a Status, never
// crash, hang, leak or trip a sanitizer; a config it accepts must serialize and parse again to
// the same config.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "zoffload/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = zoffload::ParseConfig(text);
  if (config.ok()) {
    auto again = zoffload::ParseConfig(zoffload::SerializeConfig(*config));
    if (!again.ok() || !(*again == *config)) std::abort();
  }
  return 0;
}
