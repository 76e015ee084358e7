// docs/config.md must list exactly the keys the parser accepts.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "zoffload/config.h"

namespace zoffload::internal {
namespace {

TEST(ConfigDocTest, DocumentsExactlyTheAcceptedKeys) {
  std::ifstream in(std::string(ZO_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md not found";
  // Table rows that document a key start with "| `key` |".
  std::set<std::string> documented;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find("` |", 3);
    if (end == std::string::npos) continue;
    const std::string key = line.substr(3, end - 3);
    EXPECT_TRUE(documented.insert(key).second) << "documented twice: " << key;
  }
  const std::vector<std::string> keys = AcceptedConfigKeys();
  const std::set<std::string> accepted(keys.begin(), keys.end());
  for (const std::string& k : accepted) EXPECT_TRUE(documented.count(k)) << "undocumented: " << k;
  for (const std::string& k : documented) EXPECT_TRUE(accepted.count(k)) << "not accepted: " << k;
  EXPECT_EQ(accepted.size(), keys.size()) << "a key is listed twice by the schema";
}

// The keys zoffload reads nowhere are marked "**Unused**" in the docs (and only those), a
// config that sets one is told so, and a key whose name appears in no member access outside
// the parser (`.key` or `->key` in src/, include/, python/src/) must be in that list.
TEST(ConfigDocTest, UnusedKeysAreMarkedWarnedAndComplete) {
  const std::vector<std::string> list = UnusedConfigKeys();
  const std::set<std::string> unused(list.begin(), list.end());
  std::ifstream in(std::string(ZO_SOURCE_DIR) + "/docs/config.md");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    const std::string key = line.substr(3, line.find("` |", 3) - 3);
    const bool marked = line.find("**Unused**") != std::string::npos;
    EXPECT_EQ(marked, unused.count(key) == 1) << key;
  }
  std::vector<std::string> reported;
  ParseOptions options;
  options.unused_keys = &reported;
  ASSERT_TRUE(ParseConfig(R"({"wall_clock_breakdown": true,
      "zero_optimization": {"stage": 3, "offload_param": {"buffer_count": 5}, "reduce_bucket_size": 9}})",
                          options)
                  .ok());
  EXPECT_EQ(reported, (std::vector<std::string>{"wall_clock_breakdown",
                                                "zero_optimization.offload_param.buffer_count"}));
  // Every accepted key is read somewhere (C++, or zoffload.torch's Python), or listed.
  std::string sources;
  for (const char* dir : {"/src", "/include", "/python"}) {
    for (const auto& entry :
         std::filesystem::recursive_directory_iterator(std::string(ZO_SOURCE_DIR) + dir)) {
      const std::string path = entry.path().string();
      if (!entry.is_regular_file() || path.ends_with("common/config.cc")) continue;
      if (!path.ends_with(".cc") && !path.ends_with(".h") && !path.ends_with(".cu") &&
          !path.ends_with(".py")) {
        continue;
      }
      std::ifstream file(path);
      sources.append(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    }
  }
  for (const std::string& key : AcceptedConfigKeys()) {
    const std::string leaf = key.substr(key.rfind('.') + 1);
    const bool read = sources.find("." + leaf) != std::string::npos ||
                      sources.find("->" + leaf) != std::string::npos ||
                      sources.find("[\"" + leaf + "\"]") != std::string::npos;
    // The batch sizes are read by the parser itself: they resolve gradient_accumulation_steps.
    const bool resolves = key == "train_batch_size" || key == "train_micro_batch_size_per_gpu";
    EXPECT_TRUE(read || resolves || unused.count(key))
        << key << " is read by nothing and not listed unused";
  }
}

}  // namespace
}  // namespace zoffload::internal
