// Runs the zoffload-report binary as a user would.
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace zoffload::internal {
namespace {

// Runs the report; stderr joins stdout unless `stdout_only` (for parsing JSON).
testing::CommandResult RunReport(const std::string& args, bool stdout_only = false) {
  return testing::RunCommand(std::string(ZO_REPORT_BIN) + " " + args +
                             (stdout_only ? " 2>/dev/null" : " 2>&1"));
}

TEST(ZoffloadReportTest, JsonReportHasEveryCheckedSection) {
  testing::TempDir dir;
  testing::CommandResult r = RunReport("--json --path " + dir.path(), /*stdout_only=*/true);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto report = nlohmann::json::parse(r.output);
  for (const char* section :
       {"build", "simd", "openmp", "topology", "io_uring", "memlock", "paths", "cuda"}) {
    EXPECT_TRUE(report.contains(section)) << section;
  }
  EXPECT_FALSE(report["simd"]["compiled_targets"].empty());
  EXPECT_NE(report["simd"]["dispatch_target"], "none");
  EXPECT_GE(report["openmp"]["max_threads"].get<int>(), 1);
  EXPECT_TRUE(report["topology"]["ok"].get<bool>());
  EXPECT_TRUE(report["io_uring"].contains("usable"));
  ASSERT_EQ(report["paths"].size(), 1u);
  EXPECT_EQ(report["paths"][0]["path"], dir.path());
  EXPECT_TRUE(report["paths"][0].contains("o_direct"));
  // Without a GPU (CI), the CUDA section says why instead of failing.
  if (report["cuda"]["gpus"].empty()) {
    EXPECT_TRUE(report["cuda"].contains("error"));
  }
}

// Verdicts first, then the table; the memlock verdict follows the limit the tool runs under.
TEST(ZoffloadReportTest, VerdictsLeadTheTable) {
  testing::CommandResult r = RunReport("");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("zoffload on this machine:\n  ", 0), 0u) << r.output;
  for (const char* component : {"CPU Adam: ", "NVMe offload at .: ", "pinned memory: ", "GPU: "}) {
    const size_t at = r.output.find(component);
    EXPECT_NE(at, std::string::npos) << component;
    EXPECT_LT(at, r.output.find("details")) << component;
  }
  EXPECT_EQ(r.output.find("\x1b["), std::string::npos);  // no colour into a pipe
  EXPECT_NE(r.output.find("io_uring.usable"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("simd.dispatch_target"), std::string::npos) << r.output;
  const testing::CommandResult small =
      testing::RunCommand(std::string("ulimit -l 64 && ") + ZO_REPORT_BIN + " 2>&1");
  EXPECT_NE(small.output.find("limited  pinned memory: memlock limit 64.00 KiB"), std::string::npos)
      << small.output;
  // Raising the limit needs privilege (root here; elsewhere the raise fails and is skipped).
  const testing::CommandResult big = testing::RunCommand(
      std::string("ulimit -l unlimited 2>/dev/null && ") + ZO_REPORT_BIN + " 2>&1");
  if (big.exit_code == 0) {
    EXPECT_NE(big.output.find("ready    pinned memory: memlock limit unlimited"), std::string::npos)
        << big.output;
  }
  const testing::CommandResult json = RunReport("--json", /*stdout_only=*/true);
  const auto report = nlohmann::ordered_json::parse(json.output);
  ASSERT_TRUE(report.contains("verdicts"));
  EXPECT_EQ(report.begin().key(), "verdicts");
  for (const auto& v : report["verdicts"]) {
    for (const char* key : {"component", "status", "detail", "action"}) {
      EXPECT_TRUE(v.contains(key)) << key;
    }
  }
}

TEST(ZoffloadReportTest, ConfigLinter) {
  testing::TempDir dir;
  const std::string good = dir.File("good.json"), bad = dir.File("bad.json");
  std::ofstream(good)
      << R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})";
  std::ofstream(bad)
      << R"({"zero_optimization": {"stage": 5, "offload_optimizer": {"devcie": "cpu"}},
                           "bf16": {"enabled": true}, "fp16": {"enabled": true}})";
  testing::CommandResult ok = RunReport("--config " + good);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("valid"), std::string::npos);
  testing::CommandResult err = RunReport("--config " + bad);
  EXPECT_EQ(err.exit_code, 1) << err.output;
  EXPECT_NE(err.output.find(bad + ": zero_optimization.offload_optimizer.devcie: unknown key; did "
                                  "you mean 'device'?"),
            std::string::npos)
      << err.output;
  EXPECT_NE(err.output.find(bad + ": zero_optimization.stage: must be 0, 1, 2 or 3, got 5"),
            std::string::npos)
      << err.output;
  EXPECT_NE(err.output.find("fp16 and bf16 cannot both be enabled"), std::string::npos);
  testing::CommandResult missing = RunReport("--config " + dir.File("none.json"));
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("none.json"), std::string::npos);
  testing::CommandResult batch = RunReport("--world-size 3 --config " + good);
  EXPECT_EQ(batch.exit_code, 0) << batch.output;
}

TEST(ZoffloadReportTest, BadArgumentsExit2) {
  EXPECT_EQ(RunReport("--bogus").exit_code, 2);
  EXPECT_EQ(RunReport("--path").exit_code, 2);
  EXPECT_EQ(RunReport("--world-size zero --config x").exit_code, 2);
}

}  // namespace
}  // namespace zoffload::internal
