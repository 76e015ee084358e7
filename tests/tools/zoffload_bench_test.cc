// Runs the zoffload-bench binary as a user would, on small files.
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "test_util.h"
#include "zoffload/config.h"

namespace zoffload::internal {
namespace {

testing::CommandResult RunBench(const std::string& args) {
  return testing::RunCommand(std::string(ZO_BENCH_BIN) + " " + args + " 2>&1");
}

TEST(ZoffloadBenchTest, NvmeSweepWritesRecordsAndAParsableAioBlock) {
  testing::TempDir dir, out;
  const std::string json = out.File("records.json"), aio = out.File("aio.json");
  testing::CommandResult r =
      RunBench("nvme --path " + dir.path() +
               " --size 8MiB --block-size 256K,1M --queue-depth 2,4 --threads 1,2"
               " --op write,read --json " +
               json + " --write-aio-config " + aio);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("best read"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("best write"), std::string::npos) << r.output;
  std::ifstream in(json);
  const auto records = nlohmann::json::parse(in);
  ASSERT_EQ(records.size(), 16u);  // 2 block sizes x 2 depths x 2 thread counts x 2 ops
  for (const auto& rec : records) {
    for (const char* key : {"op", "block_size", "queue_depth", "threads", "bytes", "seconds",
                            "GBps", "direct", "backend"}) {
      EXPECT_TRUE(rec.contains(key)) << key;
    }
    EXPECT_EQ(rec["bytes"], 8u << 20);
    EXPECT_GT(rec["GBps"].get<double>(), 0.0);
  }
  auto config = LoadConfigFile(aio);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->aio.block_size == 256 << 10 || config->aio.block_size == 1 << 20);
  EXPECT_TRUE(config->aio.queue_depth == 2 || config->aio.queue_depth == 4);
  // The temporary file is gone.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// On tmpfs (O_DIRECT is accepted there by recent kernels) the figures are RAM's: said on the
// console and in the JSON.
TEST(ZoffloadBenchTest, NvmeOnTmpfsSaysItIsMemorySpeed) {
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    GTEST_SKIP() << "/dev/shm is not tmpfs here";
  }
  testing::TempDir out;
  const std::string dir = "/dev/shm/zoffload-bench-test-" + std::to_string(::getpid());
  std::filesystem::create_directory(dir);
  const std::string json = out.File("records.json");
  testing::CommandResult r = RunBench("nvme --path " + dir +
                                      " --size 4MiB --block-size 1M --queue-depth 2 --threads 1"
                                      " --op write --json " +
                                      json);
  const bool emptied = std::filesystem::is_empty(dir);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("memory speed"), std::string::npos) << r.output;
  std::ifstream in(json);
  const auto records = nlohmann::json::parse(in);
  ASSERT_FALSE(records.empty());
  EXPECT_TRUE(records[0]["in_ram"].get<bool>());
  EXPECT_TRUE(emptied);
}

// The temporary files' space is free when the process has exited (truncated, synced and
// unlinked before exit): back-to-back runs that each need most of the free space all pass.
TEST(ZoffloadBenchTest, NvmeFreesItsSpaceBeforeExit) {
  testing::TempDir dir;
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir.path().c_str(), &vfs), 0);
  const uint64_t before = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  for (int run = 0; run < 3; ++run) {
    testing::CommandResult r = RunBench("nvme --path " + dir.path() +
                                        " --size 16MiB --block-size 1M --queue-depth 2"
                                        " --threads 1 --op write");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_EQ(::statvfs(dir.path().c_str(), &vfs), 0);
    const uint64_t after = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    EXPECT_GE(after + (4u << 20), before) << "run " << run << ": space not yet freed";
  }
}

TEST(ZoffloadBenchTest, NvmeTakesSettingsFromAConfig) {
  testing::TempDir dir, out;
  const std::string config = out.File("ds.json"), json = out.File("r.json");
  std::ofstream(config) << R"({"zero_optimization": {"stage": 2, "offload_optimizer":
      {"device": "nvme", "nvme_path": ")"
                        << dir.path() << R"("}},
      "aio": {"block_size": 524288, "queue_depth": 3, "thread_count": 2}})";
  testing::CommandResult r = RunBench("nvme --size 4MiB --config " + config + " --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(json);
  const auto records = nlohmann::json::parse(in);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0]["block_size"], 524288);
  EXPECT_EQ(records[0]["queue_depth"], 3);
  EXPECT_EQ(records[0]["threads"], 2);
}

// The engine profile runs whole engine steps (host mode here, without a GPU) with NVMe state in
// a temporary directory it removes, and writes its record.
TEST(ZoffloadBenchTest, EngineStepsWriteARecord) {
  testing::TempDir dir, out;
  const std::string json = out.File("engine.json");
  testing::CommandResult r = RunBench(
      "engine --host --params 4M --tensors 9 --steps 1 --threads 1"
      " --state-on nvme --path " +
      dir.path() + " --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step_seconds"), std::string::npos) << r.output;
  std::ifstream in(json);
  const auto records = nlohmann::json::parse(in);
  ASSERT_EQ(records.size(), 1u);
  const auto& rec = records[0];
  EXPECT_EQ(rec["mode"], "host");
  EXPECT_EQ(rec["state_on"], "nvme");
  EXPECT_EQ(rec["params"], 4u << 20);
  for (const char* key :
       {"step_seconds", "bound_seconds", "ratio", "adam_alone_seconds", "grad_alone_seconds"}) {
    EXPECT_GT(rec[key].get<double>(), 0.0) << key;
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  testing::CommandResult bad = RunBench("engine --tensors 0");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  // The overlap modes: their bound is max(gradients, CPU Adam), and the record says which.
  for (const char* mode : {"backward", "delayed"}) {
    const std::string overlapped = out.File(StrCat(mode, ".json"));
    testing::CommandResult o =
        RunBench(StrCat("engine --host --params 2M --tensors 5 --steps 2 ",
                        "--threads 1 --grad-ms 20 --overlap ", mode, " --json ", overlapped));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    std::ifstream oin(overlapped);
    const auto orec = nlohmann::json::parse(oin)[0];
    EXPECT_EQ(orec["overlap"], mode);
    EXPECT_DOUBLE_EQ(orec["bound_seconds"].get<double>(),
                     std::max(orec["grad_alone_seconds"].get<double>(),
                              orec["adam_alone_seconds"].get<double>()) +
                         orec["chunk_upload_seconds"].get<double>());
  }
  EXPECT_EQ(RunBench("engine --overlap sideways").exit_code, 2);
}

TEST(ZoffloadBenchTest, ClearErrors) {
  testing::CommandResult missing = RunBench("nvme --path /nonexistent-zoffload --size 1MiB");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("/nonexistent-zoffload"), std::string::npos) << missing.output;
  EXPECT_EQ(RunBench("nvme --block-size 1000").exit_code, 2);
  EXPECT_EQ(RunBench("nvme --queue-depth 0").exit_code, 2);
  EXPECT_EQ(RunBench("nvme --op erase").exit_code, 2);
  EXPECT_EQ(RunBench("nvme --bogus").exit_code, 2);
  // "--bogus needs a value" was the message; and a near miss gets the name it missed.
  testing::CommandResult bogus = RunBench("nvme --bogus");
  EXPECT_NE(bogus.output.find("unknown option '--bogus'"), std::string::npos) << bogus.output;
  testing::CommandResult typo = RunBench("nvme --queue-dept 8");
  EXPECT_NE(typo.output.find("did you mean '--queue-depth'?"), std::string::npos) << typo.output;
  EXPECT_EQ(RunBench("warp").exit_code, 2);
  EXPECT_EQ(RunBench("--help").exit_code, 0);
  // --path D --path D/ opened one file twice and reported "2 file(s)".
  testing::TempDir twice;
  testing::CommandResult again =
      RunBench("nvme --size 1MiB --path " + twice.path() + " --path " + twice.path() + "/");
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_NE(again.output.find("give each directory once"), std::string::npos) << again.output;
  // 100000 threads died with SIGSEGV inside libgomp.
  for (const char* profile : {"step", "engine"}) {
    testing::CommandResult r = RunBench(std::string(profile) + " --threads 100000");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--threads"), std::string::npos) << r.output;
  }
}

// nvme --file EXISTING wrote over a user's file without a word: data loss.
TEST(ZoffloadBenchTest, NvmeFileRefusesAnExistingFileWithoutOverwrite) {
  testing::TempDir dir;
  const std::string precious = dir.File("precious.dat");
  std::ofstream(precious) << "the user's data";
  testing::CommandResult r =
      RunBench("nvme --path " + dir.path() + " --file precious.dat --size 1MiB --block-size 1M");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  std::ifstream in(precious);
  std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "the user's data");
  testing::CommandResult ok = RunBench("nvme --path " + dir.path() +
                                       " --file precious.dat --overwrite --size 1MiB "
                                       "--block-size 1M --queue-depth 4 --threads 1");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// An unwritable --json or --trace failed only after the whole run, and without the errno.
TEST(ZoffloadBenchTest, OutputPathsAreCheckedBeforeTheRun) {
  testing::TempDir dir;
  const std::vector<std::string> cases = {
      "adam --json /nonexistent-zoffload/a.json", "engine --trace /nonexistent-zoffload/t.json",
      "nvme --write-aio-config /nonexistent-zoffload/aio.json", "adam --json " + dir.path()};
  for (const std::string& args : cases) {
    SCOPED_TRACE(args);
    const auto start = std::chrono::steady_clock::now();
    testing::CommandResult r = RunBench(args);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "ran first";
    EXPECT_TRUE(r.output.find("No such file or directory") != std::string::npos ||
                r.output.find("is a directory") != std::string::npos)
        << r.output;
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the check left a file behind";
}

}  // namespace
}  // namespace zoffload::internal
