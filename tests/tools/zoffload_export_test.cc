// Runs the zoffload-export binary as a user would, on a checkpoint an engine just saved.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"
#include "zoffload/config.h"
#include "zoffload/engine.h"

namespace zoffload::internal {
namespace {

testing::CommandResult RunExport(const std::string& args) {
  return testing::RunCommand(std::string(ZO_EXPORT_BIN) + " " + args + " 2>&1");
}

TEST(ZoffloadExportTest, WritesTheFileOrSaysWhatIsWrong) {
  testing::TempDir dir;
  std::vector<float> w(1000, 0.5f);
  auto config =
      ParseConfig(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(config.ok()) << config.status();
  EngineOptions options;
  options.host_params = true;
  auto engine = OffloadEngine::Create(
      *config, {{"w", w.data(), w.size(), DType::kFp32, nullptr, 0, {10, 100}}}, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::string ckpt = dir.File("ckpt"), out = dir.File("w.safetensors");
  ASSERT_TRUE((*engine)->Save(ckpt).ok());

  testing::CommandResult r = RunExport(ckpt + " " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote " + out), std::string::npos) << r.output;
  EXPECT_GT(std::filesystem::file_size(out), 4000u);
  r = RunExport(ckpt + " " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  EXPECT_EQ(RunExport(ckpt + " " + out + " --overwrite").exit_code, 0);
  r = RunExport(dir.File("absent") + " " + dir.File("x.safetensors"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no manifest.json in " + dir.File("absent")), std::string::npos)
      << r.output;
  EXPECT_EQ(RunExport(ckpt).exit_code, 2);
  EXPECT_EQ(RunExport("--bogus " + ckpt + " " + out).exit_code, 2);
}

}  // namespace
}  // namespace zoffload::internal
