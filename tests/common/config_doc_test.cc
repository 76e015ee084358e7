// docs/config.md must list exactly the keys the parser accepts.
#include <fstream>
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

}  // namespace
}  // namespace zoffload::internal
