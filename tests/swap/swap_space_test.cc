#include "swap/swap_space.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "swap/crc32c.h"
#include "swap/fault_backend.h"
#include "test_util.h"

namespace zoffload::internal {
namespace {

using testing::FaultPlan;
using testing::FaultRule;
using testing::FillRandom;
using testing::InjectFaults;
using testing::TempDir;

constexpr int64_t kBlock = 64 << 10;

// The backend under test: every SwapSpace test runs once per backend (set by the fixture).
IoBackendKind g_backend = IoBackendKind::kUring;

class SwapSpaceTest : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override { g_backend = GetParam(); }
};

SwapSpaceOptions Options(std::vector<std::string> paths, int64_t block = kBlock) {
  SwapSpaceOptions o;
  o.backend = g_backend;
  o.paths = std::move(paths);
  o.aio.block_size = block;
  o.aio.queue_depth = 8;
  o.aio.intra_op_parallelism = 2;
  return o;
}

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::vector<std::byte> v(n);
  FillRandom(v.data(), n, seed);
  return v;
}

// Reads a whole tensor into a poisoned buffer.
Result<std::vector<std::byte>> ReadAll(SwapSpace& swap, const std::string& key) {
  ZO_ASSIGN_OR_RETURN(const uint64_t size, swap.Size(key));
  std::vector<std::byte> out(size, std::byte{0xEE});
  ZO_RETURN_IF_ERROR(swap.Read(key, 0, out).Wait());
  return out;
}

Status WriteAll(SwapSpace& swap, const std::string& key, const std::vector<std::byte>& data) {
  ZO_RETURN_IF_ERROR(swap.Allocate(key, data.size()));
  return swap.Write(key, 0, data).Wait();
}

// Runs `body` in a child process and returns its exit code (-1 if it died).
template <typename F>
int InChild(F body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A small tmpfs mounted over directory `dir` (needs root), never left mounted: the kernel may
// still hold the files of a closed io_uring ring for a moment (their release is deferred), so
// a busy unmount is retried and then detached.
class SmallTmpfs {
 public:
  SmallTmpfs(std::string dir, const char* size) : dir_(std::move(dir)) {
    mounted_ = ::mount("tmpfs", dir_.c_str(), "tmpfs", 0, size) == 0;
  }
  ~SmallTmpfs() { Unmount(); }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  bool mounted() const { return mounted_; }
  // True when `dir` is no longer a mount point.
  bool Unmount() {
    for (int tries = 0; mounted_ && tries < 200; ++tries) {
      if (::umount(dir_.c_str()) == 0) mounted_ = false;
      if (mounted_ && errno != EBUSY) break;
      if (mounted_) ::usleep(10000);
    }
    if (mounted_ && ::umount2(dir_.c_str(), MNT_DETACH) == 0) mounted_ = false;
    struct stat here {
    }, parent{};
    return !mounted_ && ::stat(dir_.c_str(), &here) == 0 &&
           ::stat((dir_ + "/..").c_str(), &parent) == 0 && here.st_dev == parent.st_dev;
  }

 private:
  std::string dir_;
  bool mounted_ = false;
};

void RoundTripAwkwardSizes(const std::vector<std::string>& paths) {
  auto swap = SwapSpace::Open(Options(paths));
  ASSERT_TRUE(swap.ok()) << swap.status();
  uint64_t seed = 100;
  for (uint64_t size : {uint64_t{1}, uint64_t{kBlock - 1}, uint64_t{kBlock}, uint64_t{kBlock + 1},
                        uint64_t{3 * kBlock + 4097}}) {
    const std::string key = std::to_string(size);
    const auto data = RandomBytes(size, seed++);
    ASSERT_TRUE(WriteAll(**swap, key, data).ok());
    auto back = ReadAll(**swap, key);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, data) << key;
  }
  ASSERT_TRUE((*swap)->Commit().ok());
  for (const std::string& key : (*swap)->Keys()) ASSERT_TRUE((*swap)->Remove(key).ok());
}

TEST_P(SwapSpaceTest, RoundTripsAwkwardSizesOnOnePath) {
  TempDir a;
  RoundTripAwkwardSizes({a.path()});
}

TEST_P(SwapSpaceTest, RoundTripsAwkwardSizesOverTwoPaths) {
  TempDir a, b;
  RoundTripAwkwardSizes({a.path(), b.path()});
}

TEST_P(SwapSpaceTest, StripesBlocksOverPathsAndReadsRanges) {
  TempDir a, b;
  auto swap = SwapSpace::Open(Options({a.path(), b.path()}));
  ASSERT_TRUE(swap.ok());
  const auto data = RandomBytes(5 * kBlock + 10, 9);
  ASSERT_TRUE(WriteAll(**swap, "layers/0.m", data).ok());
  // Blocks 0, 2, 4 in the first directory, 1, 3, 5 in the second.
  size_t files_a = 0, files_b = 0;
  for (const auto& e : std::filesystem::directory_iterator(a.path())) {
    files_a += e.path().extension() == ".zoswap";
  }
  for (const auto& e : std::filesystem::directory_iterator(b.path())) {
    files_b += e.path().extension() == ".zoswap";
  }
  EXPECT_EQ(files_a, 1u);
  EXPECT_EQ(files_b, 1u);
  std::vector<std::byte> mid(2 * kBlock);
  ASSERT_TRUE((*swap)->Read("layers/0.m", kBlock, mid).Wait().ok());
  EXPECT_EQ(std::memcmp(mid.data(), data.data() + kBlock, mid.size()), 0);
  std::vector<std::byte> tail(kBlock + 10);
  ASSERT_TRUE((*swap)->Read("layers/0.m", 4 * kBlock, tail).Wait().ok());
  EXPECT_EQ(std::memcmp(tail.data(), data.data() + 4 * kBlock, tail.size()), 0);
  // Ranges must start on a block and end on one or at the tensor's end.
  std::vector<std::byte> odd(100);
  EXPECT_EQ((*swap)->Read("layers/0.m", 10, odd).Wait().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*swap)->Read("layers/0.m", 0, odd).Wait().code(), StatusCode::kInvalidArgument);
}

TEST_P(SwapSpaceTest, SeveralGiBOverTwoPaths) {
  TempDir a, b;
  auto swap = SwapSpace::Open(Options({a.path(), b.path()}, 1 << 20));
  ASSERT_TRUE(swap.ok());
  const uint64_t size = (uint64_t{2} << 30) + 12345;  // 2 GiB and an odd tail
  auto buffer = AlignedBuffer::Allocate(size, 4096);
  ASSERT_TRUE(buffer.ok());
  FillRandom(buffer->data(), size, 77);
  const uint32_t expected = Crc32c(buffer->data(), size);
  ASSERT_TRUE((*swap)->Allocate("big", size).ok());
  ASSERT_TRUE((*swap)->Write("big", 0, buffer->span()).Wait().ok());
  ASSERT_TRUE((*swap)->Commit().ok());
  std::memset(buffer->data(), 0, size);
  ASSERT_TRUE((*swap)->Read("big", 0, buffer->span()).Wait().ok());
  EXPECT_EQ(Crc32c(buffer->data(), size), expected);
}

TEST_P(SwapSpaceTest, FlippedByteIsDetectedWithKeyAndOffset) {
  TempDir dir;
  auto swap = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(swap.ok());
  const auto data = RandomBytes(4 * kBlock, 5);
  ASSERT_TRUE(WriteAll(**swap, "layer1.v", data).ok());
  ASSERT_TRUE((*swap)->Commit().ok());
  std::string file;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().extension() == ".zoswap") file = e.path().string();
  }
  ASSERT_FALSE(file.empty());
  const int fd = ::open(file.c_str(), O_RDWR);
  unsigned char byte;
  const off_t where = 2 * kBlock + 777;
  ASSERT_EQ(::pread(fd, &byte, 1, where), 1);
  byte ^= 1;
  ASSERT_EQ(::pwrite(fd, &byte, 1, where), 1);
  ::fsync(fd);
  ::close(fd);
  auto back = ReadAll(**swap, "layer1.v");
  ASSERT_EQ(back.status().code(), StatusCode::kDataLoss) << back.status();
  EXPECT_NE(back.status().message().find("tensor 'layer1.v' at byte offset 131072"),
            std::string::npos)
      << back.status();
}

// ChecksumBy::kCaller: the caller computes block checksums before writing and verifies after
// reading; the I/O threads do neither, and the result is the same protection.
TEST_P(SwapSpaceTest, CallerChecksumsProtectTheSameWay) {
  TempDir dir;
  auto swap = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(swap.ok());
  const auto data = RandomBytes(3 * kBlock + 5, 9);
  ASSERT_TRUE((*swap)->Allocate("c", data.size(), SwapSpace::ChecksumBy::kCaller).ok());
  ASSERT_TRUE((*swap)->Checksum("c", 0, data, 2).ok());
  ASSERT_TRUE((*swap)->Write("c", 0, data).Wait().ok());
  ASSERT_TRUE((*swap)->Commit().ok());
  std::vector<std::byte> back(data.size());
  ASSERT_TRUE((*swap)->Read("c", 0, back).Wait().ok());
  EXPECT_TRUE((*swap)->Verify("c", 0, back, 2).ok());
  EXPECT_EQ(back, data);
  back[2 * kBlock + 1] ^= std::byte{4};  // as if the disk returned a changed block
  const Status bad = (*swap)->Verify("c", 0, back, 2);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad;
  EXPECT_NE(bad.message().find("tensor 'c' at byte offset 131072"), std::string::npos) << bad;
  // A middle range, and ranges the block rules forbid.
  EXPECT_TRUE((*swap)->Verify("c", kBlock, std::span(data).subspan(kBlock, kBlock), 1).ok());
  EXPECT_EQ((*swap)->Checksum("c", 5, std::span(data).subspan(0, kBlock)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*swap)->Verify("nope", 0, back).code(), StatusCode::kNotFound);
}

// A deferred commit leaves the manifest on disk saying "writing" (so a kill is reported) and
// lets the next BeginWrite skip its manifest write; closing writes the clean state.
TEST_P(SwapSpaceTest, DeferredCommitStaysConservativeUntilClose) {
  TempDir dir;
  const auto data = RandomBytes(2 * kBlock, 10);
  auto manifest = [&] {
    std::ifstream in(dir.File("zoffload-swap.json"));
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  {
    auto swap = SwapSpace::Open(Options({dir.path()}));
    ASSERT_TRUE(swap.ok());
    ASSERT_TRUE((*swap)->Allocate("d", data.size()).ok());
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE((*swap)->BeginWrite({"d"}).ok());
      ASSERT_TRUE((*swap)->Write("d", 0, data).Wait().ok());
      ASSERT_TRUE((*swap)->Commit(/*defer_manifest=*/true).ok());
      EXPECT_NE(manifest().find("\"writing\""), std::string::npos) << step;
      EXPECT_EQ(*ReadAll(**swap, "d"), data);  // clean in memory: readable
    }
  }
  EXPECT_EQ(manifest().find("\"writing\""), std::string::npos);
  auto reopened = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ(*ReadAll(**reopened, "d"), data);
}

TEST_P(SwapSpaceTest, ChecksumsCanBeSwitchedOff) {
  TempDir dir;
  SwapSpaceOptions o = Options({dir.path()});
  o.checksums = false;
  const auto data = RandomBytes(kBlock + 3, 8);
  {
    auto swap = SwapSpace::Open(o);
    ASSERT_TRUE(swap.ok());
    ASSERT_TRUE(WriteAll(**swap, "x", data).ok());
    EXPECT_EQ(*ReadAll(**swap, "x"), data);
    ASSERT_TRUE((*swap)->Commit().ok());
  }
  // Reopened with checksums on, a space written without them is refused (it once reported a
  // false checksum mismatch against the zeros it stored); with them off it reads.
  auto checked = SwapSpace::Open(Options({dir.path()}));
  ASSERT_FALSE(checked.ok());
  EXPECT_EQ(checked.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(checked.status().message().find("without checksums"), std::string::npos)
      << checked.status();
  auto unchecked = SwapSpace::Open(o);
  ASSERT_TRUE(unchecked.ok()) << unchecked.status();
  EXPECT_EQ(*ReadAll(**unchecked, "x"), data);
}

// A deleted manifest once made the next open start a fresh space over the old swap files,
// truncating them: now it is an error naming the file, and the data stays.
TEST_P(SwapSpaceTest, SwapFilesWithoutTheirManifestAreAnErrorAndStayIntact) {
  TempDir dir;
  const auto data = RandomBytes(3 * kBlock, 9);
  {
    auto swap = SwapSpace::Open(Options({dir.path()}));
    ASSERT_TRUE(swap.ok());
    ASSERT_TRUE(WriteAll(**swap, "kept", data).ok());
    ASSERT_TRUE((*swap)->Commit().ok());
  }
  const std::string manifest = dir.File("zoffload-swap.json");
  const std::string saved = manifest + ".saved";
  ASSERT_EQ(::rename(manifest.c_str(), saved.c_str()), 0);
  auto swap = SwapSpace::Open(Options({dir.path()}));
  ASSERT_FALSE(swap.ok());
  EXPECT_EQ(swap.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(swap.status().message().find(".zoswap"), std::string::npos) << swap.status();
  EXPECT_NE(swap.status().message().find("missing"), std::string::npos) << swap.status();
  ASSERT_EQ(::rename(saved.c_str(), manifest.c_str()), 0);
  auto restored = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(*ReadAll(**restored, "kept"), data);
}

TEST_P(SwapSpaceTest, ReopensAfterRestart) {
  TempDir a, b;
  const auto d1 = RandomBytes(3 * kBlock + 5, 1);
  const auto d2 = RandomBytes(17, 2);
  {
    auto swap = SwapSpace::Open(Options({a.path(), b.path()}));
    ASSERT_TRUE(swap.ok());
    ASSERT_TRUE(WriteAll(**swap, "model.layers.0.self_attn.q_proj.weight/m", d1).ok());
    ASSERT_TRUE(WriteAll(**swap, "a_b", d2).ok());
    ASSERT_TRUE((*swap)->Allocate("never_written", 100).ok());
    ASSERT_TRUE((*swap)->Commit().ok());
  }
  auto swap = SwapSpace::Open(Options({a.path(), b.path()}));
  ASSERT_TRUE(swap.ok()) << swap.status();
  EXPECT_EQ((*swap)->Keys().size(), 3u);
  EXPECT_EQ(*ReadAll(**swap, "model.layers.0.self_attn.q_proj.weight/m"), d1);
  EXPECT_EQ(*ReadAll(**swap, "a_b"), d2);
  EXPECT_EQ(ReadAll(**swap, "never_written").status().code(), StatusCode::kFailedPrecondition);
  // Reopening with other directories or another block size is refused.
  swap->reset();
  EXPECT_EQ(SwapSpace::Open(Options({a.path()})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SwapSpace::Open(Options({a.path(), b.path()}, 2 * kBlock)).status().code(),
            StatusCode::kInvalidArgument);
}

// A manifest edited into wrong types (each case once aborted the process through an uncaught
// JSON exception) is an error naming the field, and the data files are left as they were.
TEST_P(SwapSpaceTest, ManifestFieldsOfTheWrongTypeAreErrorsNamingThem) {
  TempDir dir;
  const auto data = RandomBytes(2 * kBlock, 3);
  {
    auto swap = SwapSpace::Open(Options({dir.path()}));
    ASSERT_TRUE(swap.ok());
    ASSERT_TRUE(WriteAll(**swap, "t", data).ok());
    ASSERT_TRUE((*swap)->Commit().ok());
  }
  const std::string manifest = dir.File("zoffload-swap.json");
  std::string original;
  {
    std::ifstream in(manifest);
    original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const auto good = nlohmann::json::parse(original);
  struct Mutation {
    std::function<void(nlohmann::json&)> apply;
    std::string field;
  };
  const std::vector<Mutation> mutations = {
      {[](nlohmann::json& j) { j["block_size"] = "4096"; }, "'block_size'"},
      {[](nlohmann::json& j) { j["version"] = "1"; }, "'version'"},
      {[](nlohmann::json& j) { j["tensors"] = 5; }, "'tensors'"},
      {[](nlohmann::json& j) { j.erase("tensors"); }, "'tensors' is missing"},
      {[](nlohmann::json& j) { j["tensors"]["t"]["crc32c"][0] = "x"; }, "'tensors.t.crc32c'"},
      {[](nlohmann::json& j) { j["paths"] = "/a"; }, "'paths'"},
      {[](nlohmann::json& j) { j["tensors"]["t"]["bytes"] = -1; }, "'tensors.t.bytes'"},
      {[](nlohmann::json& j) { j["tensors"]["t"] = nullptr; }, "'tensors.t'"},
      {[](nlohmann::json& j) { j["checksums"] = 1; }, "'checksums'"},
  };
  for (const Mutation& m : mutations) {
    nlohmann::json j = good;
    m.apply(j);
    SCOPED_TRACE(j.dump());
    {
      std::ofstream out(manifest, std::ios::trunc);
      out << j.dump();
    }
    auto swap = SwapSpace::Open(Options({dir.path()}));
    ASSERT_FALSE(swap.ok());
    EXPECT_EQ(swap.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(swap.status().message().find(m.field), std::string::npos) << swap.status();
  }
  {
    std::ofstream out(manifest, std::ios::trunc);
    out << original;
  }
  auto swap = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(swap.ok()) << swap.status();
  EXPECT_EQ(*ReadAll(**swap, "t"), data);  // nothing was truncated or rewritten
}

TEST_P(SwapSpaceTest, CrashMidWriteLeavesTheTensorInterruptedOnReopen) {
  TempDir dir;
  const auto v1 = RandomBytes(8 * kBlock, 1);
  {
    auto swap = SwapSpace::Open(Options({dir.path()}));
    ASSERT_TRUE(swap.ok());
    for (int commit = 0; commit < 3; ++commit) {  // generation 3
      ASSERT_TRUE(WriteAll(**swap, "w", v1).ok());
      ASSERT_TRUE(WriteAll(**swap, "other", v1).ok());
      ASSERT_TRUE((*swap)->Commit().ok());
    }
  }
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Every write piece is slowed down, so the child is killed while its write is in flight.
    SwapSpaceOptions o = Options({dir.path()});
    o.wrap_backend = InjectFaults(std::make_shared<FaultPlan>(
        std::vector<FaultRule>{{IoOp::kWrite, FaultRule::Action::kDelay, 0, -1, 0, 0, 200}}));
    auto swap = SwapSpace::Open(o);
    if (!swap.ok()) ::_exit(2);
    const auto v2 = RandomBytes(8 * kBlock, 2);
    Future<> f = (*swap)->Write("w", 0, v2);
    const char c = 'x';
    if (::write(ready[1], &c, 1) != 1) ::_exit(3);
    ::pause();
    ::_exit(4);
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::kill(child, SIGKILL);
  int status;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  // The torn tensor comes back interrupted and unreadable; the other one is intact.
  {
    auto swap = SwapSpace::Open(Options({dir.path()}));
    ASSERT_TRUE(swap.ok()) << swap.status();
    EXPECT_EQ((*swap)->Info("w")->state, SwapSpace::TensorInfo::State::kInterrupted);
    EXPECT_EQ((*swap)->Info("other")->state, SwapSpace::TensorInfo::State::kClean);
    auto torn = ReadAll(**swap, "w");
    ASSERT_EQ(torn.status().code(), StatusCode::kDataLoss) << torn.status();
    EXPECT_NE(torn.status().message().find("'w' was interrupted while writing"), std::string::npos)
        << torn.status();
    // The generation named is the tensor's own last commit.
    EXPECT_NE(torn.status().message().find("last committed at generation 3)"), std::string::npos)
        << torn.status();
    auto other = ReadAll(**swap, "other");
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(*other, v1);
    // A partial rewrite does not make it readable: the blocks not rewritten fail their
    // checksums.
    ASSERT_TRUE((*swap)->Write("w", 0, std::span(v1).subspan(0, kBlock)).Wait().ok());
    ASSERT_TRUE((*swap)->Commit().ok());
    EXPECT_EQ(ReadAll(**swap, "w").status().code(), StatusCode::kDataLoss);
    // Written in full and committed, it is clean again.
    ASSERT_TRUE(WriteAll(**swap, "w", v1).ok());
    ASSERT_TRUE((*swap)->Commit().ok());
    auto back = ReadAll(**swap, "w");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, v1);
  }
  ASSERT_TRUE(SwapSpace::Destroy({dir.path()}).ok());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  auto fresh = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE((*fresh)->Keys().empty());
}

TEST_P(SwapSpaceTest, ASpaceInUseIsRefusedNamingItsOwner) {
  TempDir dir;
  const auto data = RandomBytes(3 * kBlock, 8);
  auto owner = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(owner.ok()) << owner.status();
  ASSERT_TRUE(WriteAll(**owner, "t", data).ok());
  ASSERT_TRUE((*owner)->Commit().ok());
  const std::string in_use =
      "swap space at " + dir.path() + " is in use by pid " + std::to_string(::getpid());
  // A second open, in this process or another, and a Destroy are refused; nothing changes.
  auto second = SwapSpace::Open(Options({dir.path()}));
  ASSERT_EQ(second.status().code(), StatusCode::kFailedPrecondition) << second.status();
  EXPECT_NE(second.status().message().find(in_use), std::string::npos) << second.status();
  const int code = InChild([&] {
    auto other = SwapSpace::Open(Options({dir.path()}));
    return !other.ok() && other.status().message().find(in_use) != std::string::npos ? 0 : 1;
  });
  EXPECT_EQ(code, 0);
  Status destroyed = SwapSpace::Destroy({dir.path()});
  EXPECT_EQ(destroyed.code(), StatusCode::kFailedPrecondition) << destroyed;
  EXPECT_EQ(*ReadAll(**owner, "t"), data);
  // Closed, it opens again with its data.
  owner->reset();
  auto reopened = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ(*ReadAll(**reopened, "t"), data);
}

TEST_P(SwapSpaceTest, TheLockOfAKilledOwnerIsTakenOverNamingIt) {
  TempDir dir;
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto swap = SwapSpace::Open(Options({dir.path()}));
    const char c = swap.ok() ? 'x' : 'e';
    if (::write(ready[1], &c, 1) != 1) ::_exit(3);
    ::pause();
    ::_exit(4);
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'x');
  ::kill(child, SIGKILL);
  int status;
  ::waitpid(child, &status, 0);
  ::testing::internal::CaptureStderr();
  auto swap = SwapSpace::Open(Options({dir.path()}));
  const std::string warning = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(swap.ok()) << swap.status();
  EXPECT_NE(
      warning.find("its last owner, pid " + std::to_string(child) + ", stopped without closing it"),
      std::string::npos)
      << warning;
  // A clean close leaves nothing to report.
  swap->reset();
  ::testing::internal::CaptureStderr();
  swap = SwapSpace::Open(Options({dir.path()}));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ASSERT_TRUE(swap.ok()) << swap.status();
}

TEST_P(SwapSpaceTest, FailedWriteLeavesTensorUnreadableAndUncommittable) {
  TempDir dir;
  SwapSpaceOptions o = Options({dir.path()});
  o.wrap_backend = InjectFaults(std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kWrite, FaultRule::Action::kFail, 2, 1, EIO}}));
  auto swap = SwapSpace::Open(o);
  ASSERT_TRUE(swap.ok());
  const auto data = RandomBytes(4 * kBlock, 3);
  ASSERT_TRUE((*swap)->Allocate("t", data.size()).ok());
  Status s = (*swap)->Write("t", 0, data).Wait();
  ASSERT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find("tensor 't'"), std::string::npos);
  EXPECT_EQ(ReadAll(**swap, "t").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ((*swap)->Commit().code(), StatusCode::kDataLoss);
  // Writing it again in full heals it.
  ASSERT_TRUE((*swap)->Write("t", 0, data).Wait().ok());
  EXPECT_EQ(*ReadAll(**swap, "t"), data);
  EXPECT_TRUE((*swap)->Commit().ok());
}

TEST_P(SwapSpaceTest, InjectedShortReadsAndEio) {
  TempDir dir;
  auto plan = std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kRead, FaultRule::Action::kTruncate, 0, 4, EIO, 4096},
                             {IoOp::kRead, FaultRule::Action::kFail, 6, 1, EIO}});
  SwapSpaceOptions o = Options({dir.path()});
  o.wrap_backend = InjectFaults(plan);
  auto swap = SwapSpace::Open(o);
  ASSERT_TRUE(swap.ok());
  const auto data = RandomBytes(4 * kBlock, 4);
  ASSERT_TRUE(WriteAll(**swap, "t", data).ok());
  EXPECT_EQ(*ReadAll(**swap, "t"), data);  // 4 short reads, resubmitted
  auto failed = ReadAll(**swap, "t");      // the 7th read piece fails with EIO
  ASSERT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("read of tensor 't'"), std::string::npos);
  EXPECT_EQ(*ReadAll(**swap, "t"), data);  // and the data is still intact
}

TEST_P(SwapSpaceTest, OutOfSpaceIsReportedBeforeWritingAndKeepsEarlierData) {
  TempDir dir;
  const std::string mnt = dir.File("small");
  std::filesystem::create_directory(mnt);
  SmallTmpfs tmpfs(mnt, "size=8m");
  const auto data = RandomBytes(2 << 20, 6);
  if (tmpfs.mounted()) {
    {
      auto swap = SwapSpace::Open(Options({mnt}));
      ASSERT_TRUE(swap.ok()) << swap.status();
      ASSERT_TRUE(WriteAll(**swap, "kept", data).ok());
      ASSERT_TRUE((*swap)->Commit().ok());
      Status s = (*swap)->Allocate("too_big", 16 << 20);
      EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("disk full at " + mnt + ": needed 16777216 bytes, "),
                std::string::npos)
          << s;
      EXPECT_FALSE((*swap)->Contains("too_big"));
      EXPECT_EQ(*ReadAll(**swap, "kept"), data);
    }
    auto reopened = SwapSpace::Open(Options({mnt}));
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    EXPECT_EQ(*ReadAll(**reopened, "kept"), data);
    reopened->reset();
    EXPECT_TRUE(tmpfs.Unmount()) << mnt << " is still mounted";
  } else {
    // No mount permission: a file-size limit makes fallocate fail the same way.
    const int code = InChild([&] {
      ::signal(SIGXFSZ, SIG_IGN);
      auto swap = SwapSpace::Open(Options({mnt}));
      if (!swap.ok() || !WriteAll(**swap, "kept", data).ok() || !(*swap)->Commit().ok()) return 2;
      rlimit lim{4 << 20, 4 << 20};
      ::setrlimit(RLIMIT_FSIZE, &lim);
      Status s = (*swap)->Allocate("too_big", 16 << 20);
      if (s.ok() || s.message().find("16777216") == std::string::npos) return 3;
      auto back = ReadAll(**swap, "kept");
      return back.ok() && *back == data ? 0 : 4;
    });
    EXPECT_EQ(code, 0);
  }
}

TEST_P(SwapSpaceTest, MissingAndReadOnlyDirectories) {
  auto missing = SwapSpace::Open(Options({"/nonexistent-zoffload/swap"}));
  ASSERT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent-zoffload/swap"), std::string::npos);
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0555), 0);
  const int code = InChild([&] {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 10;
    auto swap = SwapSpace::Open(Options({dir.path()}));
    if (swap.ok()) return 11;
    if (swap.status().code() != StatusCode::kPermissionDenied) return 12;
    return swap.status().message().find(dir.path()) == std::string::npos ? 13 : 0;
  });
  EXPECT_EQ(code, 0);
}

TEST_P(SwapSpaceTest, AllocateRules) {
  TempDir dir;
  auto swap = SwapSpace::Open(Options({dir.path()}));
  ASSERT_TRUE(swap.ok());
  ASSERT_TRUE((*swap)->Allocate("k", 1000).ok());
  EXPECT_TRUE((*swap)->Allocate("k", 1000).ok());
  EXPECT_EQ((*swap)->Allocate("k", 2000).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((*swap)->Allocate("empty", 0).ok());
  EXPECT_GE((*swap)->reserved_bytes(), 1000u);
  EXPECT_EQ((*swap)->Remove("nope").code(), StatusCode::kNotFound);
  EXPECT_EQ((*swap)->Read("nope", 0, {}).Wait().code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapSpaceTest,
                         ::testing::Values(IoBackendKind::kUring, IoBackendKind::kPosix),
                         [](const ::testing::TestParamInfo<IoBackendKind>& param_info) {
                           return param_info.param == IoBackendKind::kUring ? "uring" : "posix";
                         });

}  // namespace
}  // namespace zoffload::internal
