#include "zoffload/status.h"

#include <memory>

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ErrorCarriesCodeMessageErrnoRetryable) {
  Status s(StatusCode::kUnavailable, "ring busy", 11, true);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "ring busy");
  EXPECT_EQ(s.sys_errno(), 11);
  EXPECT_TRUE(s.retryable());
  EXPECT_EQ(s.ToString(), "UNAVAILABLE: ring busy");
}

TEST(StatusTest, WithContextPrefixesAndKeepsCode) {
  Status s = DataLossError("crc mismatch").WithContext("tensor layer.0.m");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "tensor layer.0.m: crc mismatch");
  EXPECT_TRUE(Status().WithContext("x").ok());
}

TEST(StatusTest, EveryCodeHasAName) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kCancelled); ++c) {
    EXPECT_NE(StatusCodeName(static_cast<StatusCode>(c)), "UNKNOWN") << c;
  }
}

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  ZO_ASSIGN_OR_RETURN(const int half, Half(x));
  ZO_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

Status CheckEven(int x) {
  ZO_RETURN_IF_ERROR(Half(x).status());
  return Status::Ok();
}

TEST(ResultTest, ValueAndError) {
  Result<int> r = Half(8);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 4);
  EXPECT_TRUE(r.status().ok());
  Result<int> e = Half(3);
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.value_or(-1), -1);
}

TEST(ResultTest, MacrosPropagate) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().message(), "odd");  // 6 -> 3 -> odd
  EXPECT_EQ(Quarter(5).status().message(), "odd");
  EXPECT_TRUE(CheckEven(2).ok());
  EXPECT_FALSE(CheckEven(1).ok());
}

TEST(ResultTest, HoldsMoveOnlyTypes) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(7);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

}  // namespace
}  // namespace zoffload::internal
