// RAII CUDA streams and events, and the ordering hook against a caller's stream.
//
// Frameworks run their kernels on their own stream. Work we enqueue on ours is ordered after
// theirs by recording an event on their stream and waiting for it on ours (and back), so
// neither side ever blocks the host or the other's unrelated work.
//
// Thread-safety: the handles are not synchronized; CUDA allows enqueueing on one stream from
// several threads, but a handle's owner must not move or destroy it while others use it.
#pragma once

#include <cuda_runtime_api.h>

#include "zoffload/future.h"
#include "zoffload/status.h"

namespace zoffload::internal {

class CudaEvent {
 public:
  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  /// An event on the current device; `timing` enables cudaEventElapsedTime (and costs a
  /// little on every record, so it is off by default).
  static Result<CudaEvent> Create(bool timing = false);

  cudaEvent_t get() const { return event_; }
  Status Record(cudaStream_t stream);
  /// True once the work before the last Record has finished; errors of that work surface.
  Result<bool> Done() const;
  /// Blocks the calling thread (asleep, not spinning) until the recorded work has finished.
  Status Synchronize() const;
  /// Milliseconds between two timing events, both recorded and finished.
  static Result<float> ElapsedMs(const CudaEvent& start, const CudaEvent& end);

 private:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  cudaEvent_t event_ = nullptr;
};

class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  /// A non-blocking stream (no implicit ordering with the legacy default stream) on the
  /// current device. `priority` as cudaStreamCreateWithPriority (lower = higher priority).
  static Result<CudaStream> Create(int priority = 0);

  cudaStream_t get() const { return stream_; }
  Status Synchronize() const;

 private:
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream_ = nullptr;
};

/// Makes work enqueued on `waiter` after this call start only after the work enqueued on
/// `producer` so far, using `event` (recorded on producer, waited on waiter). Host never waits.
Status OrderAfter(cudaStream_t waiter, cudaStream_t producer, CudaEvent& event);

/// A future that finishes once the work enqueued on `stream` so far has (an event recorded
/// now); a failure to record it is the future's error.
Future<> FutureAfterWork(cudaStream_t stream);

}  // namespace zoffload::internal
