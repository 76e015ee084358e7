// HostComm's collectives between real processes against plain memory copies, in the same run:
// every rank must at least copy its input into the shared segment and its output out of it, so
// the anchor is one memcpy of the input plus one of the output (of the same sizes, in the same
// processes, at the same time). Prints, per world size, GB/s of each rank's input and the speed
// relative to the anchor (1.0: as fast as copying the bytes once in and once out; the
// collective can exceed it, its 1 MiB chunks staying in cache).
//
//   build/default/bench/host_comm_bench [MiB per rank, default 256] [world sizes, default 2 4]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "zero/host_comm.h"

namespace {

using zoffload::internal::zero::HostComm;
using Clock = std::chrono::steady_clock;

template <typename F>
double Best(F&& f) {
  double best = 1e30;
  for (int i = 0; i < 4; ++i) {
    const auto start = Clock::now();
    if (!f()) return -1;
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

// One rank: times reduce-scatter, all-gather and the anchor; rank 0 prints.
int Rank(const std::string& name, int rank, int world, uint64_t bytes) {
  HostComm::Options o;
  o.name = name;
  o.rank = rank;
  o.world = world;
  auto comm = HostComm::Create(o);
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    return 1;
  }
  const uint64_t n = bytes / 4 / static_cast<uint64_t>(world) * static_cast<uint64_t>(world);
  const uint64_t part = n / static_cast<uint64_t>(world);
  std::vector<float> send(n, 1.0f + static_cast<float>(rank)), recv(n, 0.0f), copy(n);
  const double rs =
      Best([&] { return (*comm)->ReduceScatterSum(send.data(), recv.data(), part).ok(); });
  const double ag =
      Best([&] { return (*comm)->AllGather(send.data(), recv.data(), 4 * part).ok(); });
  // The anchor: the input into the segment and the output out of it, once each.
  const double rs_anchor = Best([&] {
    std::memcpy(copy.data(), send.data(), 4 * n);
    std::memcpy(recv.data(), copy.data(), 4 * part);
    return true;
  });
  const double ag_anchor = Best([&] {
    std::memcpy(copy.data(), send.data(), 4 * part);
    std::memcpy(recv.data(), copy.data(), 4 * n);
    return true;
  });
  if (!(*comm)->Barrier().ok() || rs < 0 || ag < 0) return 1;
  if (rank == 0) {
    std::printf(
        "world %d, %llu MiB a rank: reduce-scatter %.2f GB/s, %.2fx the copies' speed; "
        "all-gather %.2f GB/s, %.2fx the copies' speed\n",
        world, static_cast<unsigned long long>(4 * n >> 20), 4.0 * n / rs / 1e9, rs_anchor / rs,
        4.0 * n / ag / 1e9, ag_anchor / ag);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  std::vector<int> worlds;
  for (int i = 2; i < argc; ++i) worlds.push_back(std::atoi(argv[i]));
  if (worlds.empty()) worlds = {2, 4};
  int failed = 0;
  for (int world : worlds) {
    const std::string name =
        "zoffload-bench-" + std::to_string(::getpid()) + "-" + std::to_string(world);
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) ::_exit(Rank(name, r, world, mib << 20));
      pids.push_back(pid);
    }
    for (pid_t pid : pids) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      failed += WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
    }
  }
  return failed == 0 ? 0 : 1;
}
