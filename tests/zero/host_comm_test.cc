// HostComm between real processes (fork): all-reduce, reduce-scatter and all-gather with world
// sizes 1, 2, 3, 4 and 8, in chunks smaller than the data, bit-identical to sums taken in rank
// order; a rank that dies makes the others fail within the timeout, naming it.
#include "zero/host_comm.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/strings.h"
#include "zero/ranks.h"

namespace zoffload::internal::zero {
namespace {

using testing::RunRanks;

float Value(int rank, uint64_t k, uint64_t i) {
  return 0.1f * static_cast<float>(rank + 1) + 1e-3f * static_cast<float>((k * 7 + i) % 97);
}

// The segment's name: made in the parent, before the fork, so that every rank has the same.
HostComm::Options Options(const std::string& name, int rank, int world) {
  HostComm::Options o;
  o.name = name;
  o.rank = rank;
  o.world = world;
  o.region_bytes = 4096;  // smaller than the data: every collective goes in chunks
  o.timeout = std::chrono::milliseconds(20'000);
  return o;
}

// Exit codes: 0 right; 1 setup; 2 all-reduce; 3 reduce-scatter; 4 all-gather; 5 the name left.
int Collectives(const std::string& name, int rank, int world) {
  auto comm = HostComm::Create(Options(name, rank, world));
  if (!comm.ok()) return 1;
  // Once every rank has joined, the name is gone (nothing left in /dev/shm by a killed run).
  if (!(*comm)->Barrier().ok() || ::access(("/dev/shm/" + name).c_str(), F_OK) == 0) return 5;
  const uint64_t n = 3000;
  std::vector<float> data(n);
  for (uint64_t i = 0; i < n; ++i) data[i] = Value(rank, 0, i);
  if (!(*comm)->AllReduceSum(data.data(), n).ok()) return 2;
  for (uint64_t i = 0; i < n; ++i) {
    float want = 0;
    for (int q = 0; q < world; ++q) want += Value(q, 0, i);
    if (std::memcmp(&want, &data[i], 4) != 0) return 2;
  }
  const uint64_t count = 700;
  std::vector<float> send(count * world), recv(count, -1.0f);
  for (int k = 0; k < world; ++k) {
    for (uint64_t i = 0; i < count; ++i) send[k * count + i] = Value(rank, k + 1, i);
  }
  if (!(*comm)->ReduceScatterSum(send.data(), recv.data(), count).ok()) return 3;
  for (uint64_t i = 0; i < count; ++i) {
    float want = 0;
    for (int q = 0; q < world; ++q) want += Value(q, rank + 1, i);
    if (std::memcmp(&want, &recv[i], 4) != 0) return 3;
  }
  const uint64_t bytes = 5000;
  std::vector<unsigned char> mine(bytes), all(bytes * world, 0);
  for (uint64_t i = 0; i < bytes; ++i) mine[i] = static_cast<unsigned char>(rank * 31 + i);
  if (!(*comm)->AllGather(mine.data(), all.data(), bytes).ok()) return 4;
  for (int q = 0; q < world; ++q) {
    for (uint64_t i = 0; i < bytes; ++i) {
      if (all[q * bytes + i] != static_cast<unsigned char>(q * 31 + i)) return 4;
    }
  }
  return (*comm)->Barrier().ok() ? 0 : 1;
}

TEST(HostCommTest, CollectivesMatchRankOrderSums) {
  for (int world : {1, 2, 3, 4, 8}) {
    const std::string name = StrCat("zoffload-test-", ::getpid(), "-world", world);
    const std::vector<int> codes =
        RunRanks(world, [&](int r) { return Collectives(name, r, world); });
    for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "world " << world << " rank " << r;
  }
}

// Rank 2 of 3 leaves after joining: ranks 0 and 1 get an error within the timeout, never hang;
// one names rank 2, the other either does too or says another rank gave up.
TEST(HostCommTest, ADeadRankIsAClearErrorNotAHang) {
  const auto start = std::chrono::steady_clock::now();
  const std::string name = StrCat("zoffload-test-", ::getpid(), "-dead");
  const std::vector<int> codes = RunRanks(3, [&](int r) {
    HostComm::Options o = Options(name, r, 3);
    o.timeout = std::chrono::milliseconds(500);
    auto comm = HostComm::Create(o);
    if (!comm.ok()) return 1;
    if (r == 2) return 0;  // dies before the next barrier
    const Status s = (*comm)->Barrier();
    if (s.ok()) return 2;
    const bool names = s.message().find("rank(s) 2 did not reach barrier") != std::string::npos;
    const bool told = s.code() == StatusCode::kCancelled;
    if (!names && !told) return 3;
    return (*comm)->Barrier().ok() ? 4 : 0;  // and it stays broken
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// Rank 1 calls a reduce-scatter where ranks 0 and 2 all-gather (or gathers another size): every
// rank fails naming both calls, and stays failed; no rank takes another's data as its own.
TEST(HostCommTest, RanksCallingDifferentCollectivesAllFailNamingThem) {
  for (const bool other_size : {false, true}) {
    const std::string name =
        StrCat("zoffload-test-", ::getpid(), "-mismatch", static_cast<int>(other_size));
    const std::vector<int> codes = RunRanks(3, [&](int r) {
      HostComm::Options o = Options(name, r, 3);
      o.timeout = std::chrono::milliseconds(2000);
      auto comm = HostComm::Create(o);
      if (!comm.ok()) return 1;
      std::vector<float> send(3 * 8, 1.0f), recv(3 * 8, -1.0f);
      Status s;
      if (r == 1 && !other_size) {
        s = (*comm)->ReduceScatterSum(send.data(), recv.data(), 8);
      } else {
        s = (*comm)->AllGather(send.data(), recv.data(), r == 1 ? 16 : 32);
      }
      if (s.ok()) return 2;
      const std::string want = other_size ? "an all-gather of 16 bytes per rank"
                                          : "a reduce-scatter of 8 floats per rank";
      if (s.message().find(want) == std::string::npos ||
          s.message().find("same collectives in the same order") == std::string::npos) {
        return 3;
      }
      if (recv[8] != -1.0f) return 4;  // nothing read from the other regions
      return (*comm)->Barrier().ok() ? 5 : 0;
    });
    EXPECT_EQ(codes, (std::vector<int>{0, 0, 0})) << "other size: " << other_size;
  }
}

TEST(HostCommTest, BadOptionsAreAClearError) {
  const std::string name = StrCat("zoffload-test-", ::getpid(), "-bad");
  HostComm::Options o = Options(name, 3, 2);
  auto comm = HostComm::Create(o);
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(comm.status().message().find("needs 0 <= rank < world"), std::string::npos)
      << comm.status();
  o = Options(name, 0, 2);
  o.region_bytes = 6;  // not a multiple of 4
  EXPECT_EQ(HostComm::Create(o).status().code(), StatusCode::kInvalidArgument);
  // A rank without its rank 0 gives up after the timeout, saying what it waited for.
  o = Options(name + "-alone", 1, 2);
  o.timeout = std::chrono::milliseconds(100);
  comm = HostComm::Create(o);
  EXPECT_EQ(comm.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(comm.status().message().find("is rank 0 running"), std::string::npos) << comm.status();
}

// A rank that dies is noticed by its pid within a fraction of a second, not after the timeout
// (here the config's default, 300 s): the survivors' error names its rank and pid.
TEST(HostCommTest, ADeadRanksPidIsNoticedWithinSeconds) {
  const auto start = std::chrono::steady_clock::now();
  const std::string name = StrCat("zoffload-test-", ::getpid(), "-pid");
  const std::vector<int> codes = RunRanks(3, [&](int r) {
    HostComm::Options o = Options(name, r, 3);
    o.timeout = std::chrono::milliseconds(300'000);
    auto comm = HostComm::Create(o);
    if (!comm.ok()) return 1;
    if (r == 1) return 0;  // exits (a zombie until reaped: dead all the same)
    const Status s = (*comm)->Barrier();
    if (s.ok()) return 2;
    const bool named = s.message().find("rank 1 (pid ") != std::string::npos &&
                       s.message().find("has died") != std::string::npos;
    return named || s.code() == StatusCode::kCancelled ? 0 : 3;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

bool SegmentExists(const std::string& name) {
  return ::access(("/dev/shm/" + name).c_str(), F_OK) == 0;
}

// Rank 0 of `name` (world 2), SIGKILLed while it waits for rank 1 to join; reaped.
void KillRankZeroWhileJoining(const std::string& name) {
  const pid_t child = ::fork();
  if (child == 0) {
    HostComm::Options o = Options(name, 0, 2);
    auto comm = HostComm::Create(o);
    ::_exit(comm.ok() ? 0 : 1);
  }
  for (int i = 0; i < 5000 && !SegmentExists(name); ++i) ::usleep(1000);
  ::usleep(20'000);  // past its header's setup
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

// Rank 0 killed before the others joined leaves its segment's name: a rank that comes to join
// removes it and says rank 0 died; with no such rank, the next run's rank 0 removes it.
TEST(HostCommTest, ARankZeroKilledBeforeTheOthersJoinedLeavesNoSegment) {
  const std::string joined = StrCat("zoffload-test-", ::getpid(), "-killed0");
  KillRankZeroWhileJoining(joined);
  ASSERT_TRUE(SegmentExists(joined));
  const auto start = std::chrono::steady_clock::now();
  HostComm::Options o = Options(joined, 1, 2);
  auto comm = HostComm::Create(o);
  // Rank 0 reached the join before it died: rank 1 completes it, and removes the name.
  EXPECT_FALSE(SegmentExists(joined));
  if (!comm.ok()) {
    EXPECT_NE(comm.status().message().find("rank 0"), std::string::npos) << comm.status();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));

  const std::string alone = StrCat("zoffload-test-", ::getpid(), "-killed0-alone");
  KillRankZeroWhileJoining(alone);
  ASSERT_TRUE(SegmentExists(alone));
  auto next = HostComm::Create(Options(StrCat("zoffload-test-", ::getpid(), "-next"), 0, 1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(SegmentExists(alone));
}

}  // namespace
}  // namespace zoffload::internal::zero
