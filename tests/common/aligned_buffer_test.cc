#include "common/aligned_buffer.h"

#include <cstdint>
#include <cstring>

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(AlignedBufferTest, AlignedAndWritable) {
  for (size_t align : {8, 64, 4096}) {
    auto buf = AlignedBuffer::Allocate(10000, align, /*prefault=*/true);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % align, 0u);
    EXPECT_EQ(buf->size(), 10000u);
    std::memset(buf->data(), 0xab, buf->size());
    EXPECT_EQ(buf->data()[9999], std::byte{0xab});
  }
}

TEST(AlignedBufferTest, RejectsBadAlignment) {
  auto buf = AlignedBuffer::Allocate(100, 48);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(buf.status().message().find("48"), std::string::npos);
}

TEST(AlignedBufferTest, ImpossibleSizeIsResourceExhausted) {
  auto buf = AlignedBuffer::Allocate(size_t{1} << 62, 4096);
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(buf.status().message().find("4611686018427387904 bytes"), std::string::npos);
}

TEST(AlignedBufferTest, MoveTransfersOwnership) {
  auto a = AlignedBuffer::Allocate(4096, 4096);
  ASSERT_TRUE(a.ok());
  std::byte* p = a->data();
  AlignedBuffer b = std::move(a).value();
  EXPECT_EQ(b.data(), p);
  AlignedBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_TRUE(AlignedBuffer::Allocate(0, 64)->empty());
}

}  // namespace
}  // namespace zoffload::internal
