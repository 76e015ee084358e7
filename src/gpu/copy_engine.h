// CopyEngine: host <-> device copies at the PCIe link's limit, both directions at once.
//
// 1. Each direction has its own stream, so an upload and a download run concurrently on the
//    GPU's two copy engines. Copies between device memory and pinned (or registered) host
//    memory are one cudaMemcpyAsync each; they return a CopyToken at once.
// 2. Pageable caller memory never takes CUDA's slow pageable path: it moves through pinned
//    staging buffers (chunk_bytes each, staging_buffers per direction). Host threads copy
//    chunk i+1 into one buffer while the DMA engine moves chunk i from another.
// 3. Ordering with a caller's stream: a copy given `after` starts only after the work
//    enqueued on that stream so far; CopyToken::OrderBefore makes a caller's stream wait for
//    the copy. Neither blocks the host.
//
// Thread-safety: every member may be called from any thread. Staged copies of one direction
// run one at a time (they share that direction's staging buffers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "gpu/pinned_pool.h"
#include "gpu/stream.h"
#include "zoffload/status.h"

namespace zoffload {

struct CopyEngineOptions {
  size_t chunk_bytes = size_t{8} << 20;  ///< staging buffer size, bytes
  int staging_buffers = 3;               ///< per direction (2 = double buffering)
  int staging_threads = 8;               ///< host threads copying to/from staging
};

/// Completion of an enqueued copy.
class [[nodiscard]] CopyToken {
 public:
  CopyToken() = default;
  /// True once the copy has finished (errors of the copy surface here).
  Result<bool> Done() const;
  /// Blocks the calling thread until the copy has finished.
  Status Wait() const;
  /// Work enqueued on `consumer` after this call starts after the copy. Host never waits.
  Status OrderBefore(cudaStream_t consumer) const;

 private:
  friend class CopyEngine;
  explicit CopyToken(std::shared_ptr<CudaEvent> event) : event_(std::move(event)) {}
  std::shared_ptr<CudaEvent> event_;  // null: nothing was copied
};

class CopyEngine {
 public:
  enum class Direction { kHostToDevice, kDeviceToHost };

  /// Streams and staging buffers (from `pool`) on the current device.
  static Result<std::unique_ptr<CopyEngine>> Create(PinnedPool& pool,
                                                    const CopyEngineOptions& options = {});

  /// Device <- pinned/registered host memory.
  Result<CopyToken> HostToDevice(void* device_dst, const void* host_src, size_t bytes,
                                 cudaStream_t after = nullptr);
  /// Pinned/registered host memory <- device.
  Result<CopyToken> DeviceToHost(void* host_dst, const void* device_src, size_t bytes,
                                 cudaStream_t after = nullptr);

  /// Device <- pageable host memory, through staging. Returns once `host_src` has been read
  /// (the caller may reuse it); the token covers the last DMA still in flight.
  Result<CopyToken> HostToDeviceStaged(void* device_dst, const void* host_src, size_t bytes,
                                       cudaStream_t after = nullptr);
  /// Pageable host memory <- device, through staging. Returns once `host_dst` holds the data.
  Status DeviceToHostStaged(void* host_dst, const void* device_src, size_t bytes,
                            cudaStream_t after = nullptr);

  cudaStream_t stream(Direction direction) const { return lane(direction).stream.get(); }

 private:
  struct Slot {
    PinnedBuffer buffer;
    CudaEvent dma_done;  // the slot's last DMA has finished
  };
  struct Lane {
    CudaStream stream;
    std::mutex staging;  // one staged copy at a time
    std::vector<Slot> slots;
  };
  CopyEngine() = default;
  Lane& lane(Direction d) { return d == Direction::kHostToDevice ? h2d_ : d2h_; }
  const Lane& lane(Direction d) const { return d == Direction::kHostToDevice ? h2d_ : d2h_; }
  Result<CopyToken> Enqueue(Lane& lane, void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t after);
  static Status StartAfter(Lane& lane, cudaStream_t after);
  static Result<CopyToken> TokenAfterLastWork(Lane& lane);
  void ParallelCopy(void* dst, const void* src, size_t bytes) const;

  CopyEngineOptions options_;
  Lane h2d_, d2h_;
};

}  // namespace zoffload
