// NcclComm: an RAII NCCL communicator with Status-returning collectives.
//
// Bootstrap: rank 0 creates an NcclUniqueId and hands its hex form to the other ranks (a
// file, an environment variable, the launcher); every rank then calls NcclComm::Init with it.
// One GPU (world size 1) works the same way, or through NcclComm::InitSingle.
//
// Errors: every NCCL call is checked; CheckAsyncError reports a communicator's asynchronous
// failure (a peer gone), after which the communicator is aborted, not destroyed, on release.
//
// Thread-safety: one thread at a time per communicator (NCCL's rule); distinct communicators
// may be used concurrently.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <string_view>

#include "zoffload/cpu_adam.h"
#include "zoffload/status.h"

namespace zoffload::internal {

class NcclUniqueId {
 public:
  static Result<NcclUniqueId> Create();
  /// The id as 256 hex digits, and back (INVALID_ARGUMENT naming what is wrong).
  std::string ToHex() const;
  static Result<NcclUniqueId> FromHex(std::string_view hex);
  const ncclUniqueId& get() const { return id_; }

 private:
  ncclUniqueId id_{};
};

enum class ReduceOp { kSum, kAvg, kMax, kMin };

class NcclComm {
 public:
  NcclComm() = default;
  ~NcclComm();
  NcclComm(NcclComm&& other) noexcept;
  NcclComm& operator=(NcclComm&& other) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  /// This process's rank of `world_size`, on the current CUDA device.
  static Result<NcclComm> Init(int world_size, int rank, const NcclUniqueId& id);
  /// A communicator of one rank on GPU `device`.
  static Result<NcclComm> InitSingle(int device);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  ncclComm_t get() const { return comm_; }

  /// recv[i] = op over ranks of send[i], i < count (in place when send == recv).
  Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                   cudaStream_t stream);
  /// recv (recv_count) = this rank's slice of the reduction of send (recv_count * world_size).
  Status ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype, ReduceOp op,
                       cudaStream_t stream);
  /// recv (send_count * world_size) = every rank's send, in rank order.
  Status AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                   cudaStream_t stream);
  /// recv (bytes * world_size) = every rank's `bytes` of send, in rank order.
  Status AllGatherBytes(const void* send, void* recv, size_t bytes, cudaStream_t stream);
  Status Broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                   cudaStream_t stream);

  /// An asynchronous error of the communicator (e.g. a failed peer), or OK.
  Status CheckAsyncError();
  /// Aborts the communicator now (its collectives in flight end); every later call fails.
  void Abort();

 private:
  NcclComm(ncclComm_t comm, int world_size, int rank)
      : comm_(comm), world_size_(world_size), rank_(rank) {}
  ncclComm_t comm_ = nullptr;
  int world_size_ = 0;
  int rank_ = 0;
  bool failed_ = false;
};

}  // namespace zoffload::internal
