#include "common/strings.h"

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(StringsTest, ParseByteSize) {
  uint64_t v = 0;
  EXPECT_TRUE(ParseByteSize("4096", &v));
  EXPECT_EQ(v, 4096u);
  EXPECT_TRUE(ParseByteSize("4GiB", &v));
  EXPECT_EQ(v, 4ull << 30);
  EXPECT_TRUE(ParseByteSize("1M", &v));
  EXPECT_EQ(v, 1u << 20);
  EXPECT_TRUE(ParseByteSize("256k", &v));
  EXPECT_EQ(v, 256u << 10);
  EXPECT_TRUE(ParseByteSize("2TB", &v));
  EXPECT_EQ(v, 2ull << 40);
  EXPECT_FALSE(ParseByteSize("", &v));
  EXPECT_FALSE(ParseByteSize("G", &v));
  EXPECT_FALSE(ParseByteSize("1.5G", &v));
  EXPECT_FALSE(ParseByteSize("4X", &v));
  EXPECT_FALSE(ParseByteSize("-1", &v));
  EXPECT_FALSE(ParseByteSize("99999999999999999999", &v));
  EXPECT_FALSE(ParseByteSize("17179869184G", &v));  // overflows 64 bits
}

TEST(StringsTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(512), "512 bytes");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB (1536 bytes)");
  EXPECT_EQ(HumanBytes(4ull << 30), "4.00 GiB (4294967296 bytes)");
}

TEST(StringsTest, EditDistance) {
  EXPECT_EQ(EditDistance("device", "devcie"), 2u);
  EXPECT_EQ(EditDistance("", "abc"), 3u);
  EXPECT_EQ(EditDistance("stage", "stage"), 0u);
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
}

}  // namespace
}  // namespace zoffload::internal
