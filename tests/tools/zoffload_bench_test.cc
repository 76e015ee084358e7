// Runs the zoffload-bench binary as a user would, on small files.
#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
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

// The temporary files are gone when the process has exited (with the process gone, no open
// descriptor holds a removed file's blocks, so their space is free): three runs back to back
// leave nothing in the directory. The directory is checked, not the file system's free space,
// which the tests running beside this one change.
TEST(ZoffloadBenchTest, NvmeFreesItsSpaceBeforeExit) {
  testing::TempDir dir;
  for (int run = 0; run < 3; ++run) {
    testing::CommandResult r = RunBench("nvme --path " + dir.path() +
                                        " --size 16MiB --block-size 1M --queue-depth 2"
                                        " --threads 1 --op write");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::vector<std::string> left;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir.path())) {
      left.push_back(entry.path().string());
    }
    EXPECT_TRUE(left.empty()) << "run " << run << " left " << left.size() << " entries, first "
                              << left.front();
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

// Starts zoffload-bench with `args` (output into `log`), waits until it has made its scratch
// in `dir`, then sends `sig`; returns how it ended (the wait status), or -1.
int StopWhileItMeasures(const std::vector<std::string>& args, const std::string& dir,
                        const std::string& log, int sig) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv{const_cast<char*>(ZO_BENCH_BIN)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(ZO_BENCH_BIN, argv.data());
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::filesystem::is_empty(dir) && std::chrono::steady_clock::now() < deadline) {
    ::usleep(20000);
  }
  ::usleep(300000);  // well into its work
  ::kill(pid, sig);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// SIGINT and SIGTERM remove the run's temporary files and end it by that signal; what a
// SIGKILLed run left is removed, and reported, by the next run in that directory.
TEST(ZoffloadBenchTest, StoppedRunsLeaveNoDebris) {
  testing::TempDir dir, out;
  const std::string log = out.File("log");
  const std::vector<std::string> step = {"step", "--path", dir.path(), "--params", "64M"};
  const std::vector<std::string> nvme = {"nvme", "--path", dir.path(), "--size", "1GiB"};
  for (const auto& [args, sig] : {std::pair{step, SIGINT}, std::pair{step, SIGTERM},
                                  std::pair{nvme, SIGTERM}, std::pair{nvme, SIGINT}}) {
    const int status = StopWhileItMeasures(args, dir.path(), log, sig);
    const std::string output = ReadText(log);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << status << "\n" << output;
    EXPECT_NE(output.find(StrCat("stopped by SIG", sig == SIGINT ? "INT" : "TERM")),
              std::string::npos)
        << output;
    EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << args[0] << " " << output;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      std::filesystem::remove_all(entry.path());
    }
  }
  // A SIGKILL leaves the scratch; the next run removes it and says so.
  for (const auto& args : {step, nvme}) {
    const int status = StopWhileItMeasures(args, dir.path(), log, SIGKILL);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
    ASSERT_FALSE(std::filesystem::is_empty(dir.path()));
    const std::string left = std::filesystem::directory_iterator(dir.path())->path().string();
    testing::CommandResult next =
        RunBench("nvme --path " + dir.path() + " --size 4MiB --block-size 1M --queue-depth 2");
    ASSERT_EQ(next.exit_code, 0) << next.output;
    EXPECT_NE(next.output.find("removed " + left), std::string::npos) << next.output;
    EXPECT_NE(next.output.find("left by an earlier run"), std::string::npos) << next.output;
    EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  }
}

// The default run, as the README's main command: at most one screen in a pipe and on a
// terminal (run under script(1)), with progress drawn in place there.
TEST(ZoffloadBenchTest, TheDefaultRunFitsOneScreen) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the full default run takes minutes under the sanitizers";
#else
  testing::TempDir dir;
  const std::string in_dir = "cd " + dir.path() + " && ";
  testing::CommandResult piped = testing::RunCommand(in_dir + ZO_BENCH_BIN + " 2>&1");
  ASSERT_EQ(piped.exit_code, 0) << piped.output;
  const auto lines = [](const std::string& text) {
    return std::count(text.begin(), text.end(), '\n');
  };
  EXPECT_LE(lines(piped.output), 60) << piped.output;
  EXPECT_EQ(piped.output.find('\r'), std::string::npos);  // no redrawing into a pipe
  EXPECT_NE(piped.output.find("recommended aio config: {"), std::string::npos) << piped.output;
  testing::CommandResult tty =
      testing::RunCommand(in_dir + "script -qec " + ZO_BENCH_BIN + " /dev/null 2>&1");
  ASSERT_EQ(tty.exit_code, 0) << tty.output;
  EXPECT_LE(lines(tty.output), 60) << tty.output;
  EXPECT_NE(tty.output.find("\radam ["), std::string::npos) << "no progress bar drawn";
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
#endif
}

// No message a user sees names a source file of zoffload: the error paths of the tools.
TEST(ZoffloadBenchTest, UserMessagesNameNoSourceFiles) {
  testing::TempDir dir;
  const std::string bad = dir.File("bad.json");
  std::ofstream(bad) << R"({"zero_optimization": {"stage": 7}})";
  const std::vector<std::string> commands = {
      StrCat(ZO_BENCH_BIN, " pcie"),
      StrCat(ZO_BENCH_BIN, " kernels"),
      StrCat(ZO_BENCH_BIN, " nvme --path /nonexistent-zoffload --size 1MiB"),
      StrCat(ZO_BENCH_BIN, " engine --config ", bad),
      StrCat(ZO_BENCH_BIN, " step --params 0"),
      StrCat(ZO_REPORT_BIN),
      StrCat(ZO_REPORT_BIN, " --config ", bad),
      StrCat(ZO_REPORT_BIN, " --path /nonexistent-zoffload"),
      StrCat(ZO_EXPORT_BIN, " /nonexistent-zoffload ", dir.File("out.safetensors")),
  };
  // "name.cc:12", ".h:", ".cu:", ".cuh:" followed by a line number.
  const auto has_source_location = [](const std::string& text) {
    for (const char* ext : {".cc:", ".h:", ".cu:", ".cuh:"}) {
      for (size_t at = text.find(ext); at != std::string::npos; at = text.find(ext, at + 1)) {
        const size_t after = at + std::strlen(ext);
        if (at > 0 && std::isalnum(static_cast<unsigned char>(text[at - 1])) != 0 &&
            after < text.size() && std::isdigit(static_cast<unsigned char>(text[after])) != 0) {
          return true;
        }
      }
    }
    return false;
  };
  EXPECT_TRUE(has_source_location("failed at /x/src/gpu/gpu_info.cc:50: no"));  // the check works
  for (const std::string& command : commands) {
    const testing::CommandResult r = testing::RunCommand(command + " 2>&1");
    EXPECT_EQ(r.output.find(ZO_SOURCE_DIR), std::string::npos) << command << "\n" << r.output;
    EXPECT_FALSE(has_source_location(r.output)) << command << "\n" << r.output;
  }
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
  // A share on NVMe with the state in host memory was silently ignored.
  for (const char* ratio : {"0", "1.5", "half"}) {
    testing::CommandResult r = RunBench(std::string("step --nvme-ratio ") + ratio);
    EXPECT_EQ(r.exit_code, 2) << ratio << ": " << r.output;
  }
  testing::CommandResult host = RunBench("step --state-on host --nvme-ratio 0.5");
  EXPECT_EQ(host.exit_code, 2) << host.output;
  EXPECT_NE(host.output.find("needs --state-on nvme"), std::string::npos) << host.output;
}

// Flags that need more host memory than there is are refused before anything is allocated,
// naming the bytes needed and available (they met the OOM killer); a config's NVMe ratio too
// small to hold one tensor is an error, not a crash (a null swap space).
TEST(ZoffloadBenchTest, RunsThatCannotFitAreRefusedUpFront) {
  testing::TempDir dir;
  for (const std::string& args :
       {std::string("adam --params 1T"), std::string("step --params 1T"),
        std::string("step --state-on host --tensors 1000000 --params 64G"),
        std::string("engine --params 1T"),
        "step --state-on nvme --path " + dir.path() + " --buffers 100000"}) {
    testing::CommandResult r = RunBench(args);
    EXPECT_EQ(r.exit_code, 1) << args << ": " << r.output;
    EXPECT_NE(r.output.find("of host memory;"), std::string::npos) << args << ": " << r.output;
    EXPECT_NE(r.output.find("are available here"), std::string::npos) << r.output;
  }
  const std::string config = dir.File("tiny-ratio.json");
  std::ofstream(config) << R"({"zero_optimization": {"stage": 2, "offload_optimizer":
      {"device": "nvme", "nvme_path": ")"
                        << dir.path() << R"(", "ratio": 1e-300}}})";
  testing::CommandResult r = RunBench("step --params 1M --tensors 4 --steps 1 --config " + config);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("holds none of the 4 tensors"), std::string::npos) << r.output;
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
