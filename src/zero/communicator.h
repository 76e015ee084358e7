// Communicator: the collectives the ZeRO stages use, whatever carries them — HostComm (shared
// memory between processes on one machine; host buffers) or NCCL (GPU buffers).
//
// Every rank calls the same collectives in the same order (they are collective). Reductions
// add the ranks' values in rank order (0, 1, ..., N-1), starting from rank 0's value, on every
// rank, so a sum over ranks has the bits of the same values added one after another.
#pragma once

#include <cstdint>

#include "zoffload/status.h"

namespace zoffload::internal::zero {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;

  virtual Status Barrier() = 0;
  /// data[i] = the sum over ranks (in rank order) of their data[i], i < n.
  virtual Status AllReduceSum(float* data, uint64_t n) = 0;
  /// recv[i] = the sum over ranks (in rank order) of their send[rank x count + i], i < count.
  virtual Status ReduceScatterSum(const float* send, float* recv, uint64_t count) = 0;
  /// recv[q x bytes, (q + 1) x bytes) = rank q's send, for every rank q.
  virtual Status AllGather(const void* send, void* recv, uint64_t bytes) = 0;
};

}  // namespace zoffload::internal::zero
