// ZeroRank::FromEnvironment: what a launcher sets (RANK, WORLD_SIZE, ZOFFLOAD_RUN_ID, or
// torchrun's TORCHELASTIC_RUN_ID and MASTER_PORT), and clear errors naming the variable.
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/strings.h"
#include "zoffload/zero.h"

namespace zoffload {
namespace {

void Set(const char* name, const char* value) {
  if (value == nullptr) {
    ::unsetenv(name);
  } else {
    ::setenv(name, value, 1);
  }
}

Result<ZeroRank> With(const char* rank, const char* world, const char* run,
                      const char* elastic = nullptr, const char* port = nullptr) {
  Set("RANK", rank);
  Set("WORLD_SIZE", world);
  Set("ZOFFLOAD_RUN_ID", run);
  Set("TORCHELASTIC_RUN_ID", elastic);
  Set("MASTER_PORT", port);
  return ZeroRank::FromEnvironment();
}

TEST(ZeroRankTest, FromEnvironment) {
  auto r = With(nullptr, nullptr, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 0);
  EXPECT_EQ(r->world, 1);
  EXPECT_EQ(r->run, internal::StrCat("single-", ::getpid()));
  r = With("2", "4", "job-7.a");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, 2);
  EXPECT_EQ(r->world, 4);
  EXPECT_EQ(r->run, "job-7.a");
  r = With("1", "2", nullptr, "abc", "29500");  // torchrun's
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->run, "abc-29500");
}

TEST(ZeroRankTest, BadEnvironmentIsAClearError) {
  struct Bad {
    const char *rank, *world, *run, *names;
  };
  for (const Bad& b :
       {Bad{"4", "4", "x", "RANK is '4'"}, Bad{"-1", "4", "x", "RANK is '-1'"},
        Bad{"0", "many", "x", "WORLD_SIZE is 'many'"}, Bad{"0", "0", "x", "WORLD_SIZE is '0'"},
        Bad{"1", "2", nullptr, "set ZOFFLOAD_RUN_ID"},
        Bad{"0", "2", "a/b", "from ZOFFLOAD_RUN_ID is 'a/b'"}}) {
    auto r = With(b.rank, b.world, b.run);
    ASSERT_FALSE(r.ok()) << b.names;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(b.names), std::string::npos) << r.status();
  }
  ZeroRank bad;
  bad.run = "has space";
  auto config = ParseConfig(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(config.ok());
  float w[4] = {};
  auto z = ZeroOptimizer::Create(*config, {{"w", w, 4, DType::kFp32}}, bad);
  EXPECT_EQ(z.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(z.status().message().find("'has space'"), std::string::npos) << z.status();
}

}  // namespace
}  // namespace zoffload
