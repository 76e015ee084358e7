// docs/config.md must list exactly the keys the parser accepts.
#include <fstream>
#include <regex>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "zoffload/config.h"

namespace zoffload {
namespace {

TEST(ConfigDocTest, DocumentsExactlyTheAcceptedKeys) {
  std::ifstream in(std::string(ZO_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md not found";
  const std::regex row(R"(^\| `([a-z0-9_.]+)` \|)");
  std::set<std::string> documented;
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_search(line, m, row)) {
      EXPECT_TRUE(documented.insert(m[1]).second) << "documented twice: " << m[1];
    }
  }
  const std::vector<std::string> keys = AcceptedConfigKeys();
  const std::set<std::string> accepted(keys.begin(), keys.end());
  for (const std::string& k : accepted) EXPECT_TRUE(documented.count(k)) << "undocumented: " << k;
  for (const std::string& k : documented) EXPECT_TRUE(accepted.count(k)) << "not accepted: " << k;
  EXPECT_EQ(accepted.size(), keys.size()) << "a key is listed twice by the schema";
}

}  // namespace
}  // namespace zoffload
