// CopyEngine: host <-> device copies at the PCIe link's limit, both directions at once.
//
// 1. Each direction has its own stream, so an upload and a download run concurrently on the
//    GPU's two copy engines. Copies between device memory and pinned (or registered) host
//    memory are one cudaMemcpyAsync each; they return a device Future at once (an enqueue
//    failure is the future's error).
// 2. Pageable caller memory never takes CUDA's slow pageable path: it moves through pinned
//    staging buffers (chunk_bytes each, staging_buffers per direction). Host threads copy
//    chunk i+1 into one buffer while the DMA engine moves chunk i from another.
// 3. Ordering with a caller's stream: a copy given `after` starts only after the work
//    enqueued on that stream so far; Future::OrderBefore makes a caller's stream wait for the
//    copy. Neither blocks the host.
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
#include "zoffload/future.h"
#include "zoffload/status.h"

namespace zoffload::internal {

struct CopyEngineOptions {
  size_t chunk_bytes = size_t{8} << 20;  ///< staging buffer size, bytes
  int staging_buffers = 3;               ///< per direction (2 = double buffering)
  int staging_threads = 8;               ///< host threads copying to/from staging
};

class CopyEngine {
 public:
  enum class Direction { kHostToDevice, kDeviceToHost };

  /// Streams and staging buffers (from `pool`) on the current device.
  static Result<std::unique_ptr<CopyEngine>> Create(PinnedPool& pool,
                                                    const CopyEngineOptions& options = {});

  /// Device <- pinned/registered host memory.
  Future<> HostToDevice(void* device_dst, const void* host_src, size_t bytes,
                        cudaStream_t after = nullptr);
  /// Pinned/registered host memory <- device.
  Future<> DeviceToHost(void* host_dst, const void* device_src, size_t bytes,
                        cudaStream_t after = nullptr);

  /// Device <- pageable host memory, through staging. Returns once `host_src` has been read
  /// (the caller may reuse it); the future covers the last DMA still in flight.
  Future<> HostToDeviceStaged(void* device_dst, const void* host_src, size_t bytes,
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
  Future<> Enqueue(Lane& lane, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                   cudaStream_t after);
  static Status EnqueueCopy(Lane& lane, void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t after);
  static Status StartAfter(Lane& lane, cudaStream_t after);
  Status StageToDevice(void* device_dst, const void* host_src, size_t bytes, cudaStream_t after);
  void ParallelCopy(void* dst, const void* src, size_t bytes) const;

  CopyEngineOptions options_;
  Lane h2d_, d2h_;
};

}  // namespace zoffload::internal
