// HostComm: the collectives ZeRO needs (Communicator: all-reduce, reduce-scatter, all-gather of
// fp32 and raw bytes, barrier) between real processes on one machine, through a POSIX shared-memory
// segment — the CPU backend next to NCCL (as gloo is for torch), so the partition, bucketing and
// overlap logic runs with world sizes 2-8 on a machine without GPUs.
//
// The segment (/dev/shm/<name>, created by rank 0; every rank removes the name as soon as all
// have joined; the name must be unique among the runs going on) holds a header and one region of
// `region_bytes` per rank. A collective goes through in chunks that fit the regions: each rank
// writes its chunk into its own region, all meet at a barrier, each reads what it needs from every
// region, all meet again. Reductions add the ranks' values in rank order (0, 1, ..., N-1), from
// rank 0's value, on every rank, so every rank gets the same bits, run after run.
//
// Failure: each rank's pid (and pid namespace) is in the header; a rank waiting at a barrier
// checks every 100 ms that the ranks it waits for are alive (those of its own pid namespace:
// another's pids mean other processes), and at most `timeout` in all. A dead rank, or the
// timeout, makes it mark the communicator aborted (the others see it at once) and return an
// error naming the ranks (and pids) that never arrived; after that every call fails, nothing
// hangs. Ranks that call different collectives (kind or size) all fail with an error naming
// both calls, instead of mixing each other's data. A segment whose rank 0 died before every
// rank joined is removed by a joining rank that sees it, or else by the next run's rank 0
// (the pid in its header is gone): none is left in /dev/shm for good.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "zero/communicator.h"
#include "zoffload/status.h"

namespace zoffload::internal::zero {

/// Whether `run` may name a run (and its shared-memory segment): letters, digits, '.', '_',
/// '-'; 1 to 200 of them.
bool GoodRunName(const std::string& run);

class HostComm final : public Communicator {
 public:
  struct Options {
    std::string name;                 ///< the segment's name, unique per run ("zoffload-<id>")
    int rank = 0, world = 1;          ///< 0 <= rank < world
    uint64_t region_bytes = 1 << 20;  ///< per rank; a multiple of 4, at least 4 x world
    std::chrono::milliseconds timeout{60'000};  ///< for the others to arrive at a barrier
  };
  static Result<std::unique_ptr<HostComm>> Create(const Options& options);
  ~HostComm() override;
  HostComm(const HostComm&) = delete;
  HostComm& operator=(const HostComm&) = delete;

  int rank() const override { return options_.rank; }
  int world() const override { return options_.world; }

  Status Barrier() override;
  Status AllReduceSum(float* data, uint64_t n) override;
  Status ReduceScatterSum(const float* send, float* recv, uint64_t count) override;
  Status AllGather(const void* send, void* recv, uint64_t bytes) override;

  struct Header;  // the segment's first page (host_comm.cc)

 private:
  explicit HostComm(const Options& options) : options_(options) {}
  std::byte* region(int rank) const;
  void AddInRankOrder(uint64_t at, uint64_t n, float* out) const;
  Status Broken() const;
  /// A collective's first barrier: stores this rank's call word (the collective's kind and
  /// size), meets the others, and fails naming both calls if another rank's word differs.
  Status Begin(uint64_t kind, uint64_t size);

  Options options_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  Header* header_ = nullptr;
  uint64_t barriers_ = 0;  // this rank's barriers so far
  bool named_ = true;      // the segment's name may still exist (before every rank joined)
  Status broken_;
};

}  // namespace zoffload::internal::zero
