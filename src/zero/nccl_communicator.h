// NcclCommunicator: ZeRO's collectives (Communicator) over NCCL, one GPU per rank, for ranks
// whose ZeRO buffers live in host memory (the optimizer partition offloaded to host or NVMe).
// Each collective goes through in chunks that fit one device buffer: the host data goes up,
// NCCL runs the collective between the GPUs (over NVLink, PCIe or the network: ranks may be on
// several machines, which HostComm's shared memory cannot span), and the result comes down.
//
// Sums: NCCL's order, deterministic for a fixed world size and algorithm but not rank order
// as in HostComm. At world sizes 1 and 2 that is the same bits (a + b = b + a); above 2,
// results match world size 1 to rounding, not bit for bit.
//
// Failure: each collective waits at most `timeout` (polling NCCL's asynchronous error); then
// the communicator is aborted and this and every later call fail, naming the collective. A
// peer that died is caught by NCCL (an asynchronous error) or by the timeout; nothing hangs.
//
// Thread-safety: one thread at a time (NCCL's rule for a communicator).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>

#include "gpu/device_buffer.h"
#include "gpu/nccl_comm.h"
#include "gpu/stream.h"
#include "zero/communicator.h"
#include "zoffload/status.h"

namespace zoffload::internal::zero {

class NcclCommunicator final : public Communicator {
 public:
  struct Options {
    uint64_t chunk_bytes = uint64_t{64} << 20;   ///< device staging; a multiple of 4 x world
    std::chrono::milliseconds timeout{300'000};  ///< for one collective to finish
  };
  /// Over `comm`, whose GPU is the calling thread's current device (each collective makes it
  /// current again: it may be called from another thread than Create's).
  static Result<std::unique_ptr<NcclCommunicator>> Create(NcclComm comm, const Options& options);

  int rank() const override { return comm_.rank(); }
  int world() const override { return comm_.world_size(); }

  Status Barrier() override;
  Status AllReduceSum(float* data, uint64_t n) override;
  Status ReduceScatterSum(const float* send, float* recv, uint64_t count) override;
  Status AllGather(const void* send, void* recv, uint64_t bytes) override;

 private:
  NcclCommunicator(NcclComm comm, const Options& options)
      : comm_(std::move(comm)), options_(options) {}
  /// Before a collective: the failure that broke the communicator, or the device made current.
  Status Enter();
  Status Copy(void* to, const void* from, uint64_t bytes, cudaMemcpyKind kind);
  /// Waits for the stream's work; a failure or the timeout aborts the communicator.
  Status Wait(std::string_view what);

  NcclComm comm_;
  Options options_;
  int device_ = 0;
  CudaStream stream_;
  DeviceBuffer staging_;  // options_.chunk_bytes
  Status broken_;
};

}  // namespace zoffload::internal::zero
