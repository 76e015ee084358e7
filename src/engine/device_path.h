// DevicePath: the OffloadEngine's CUDA side (compiled only with CUDA) — gradient buckets
// going down, parameter chunks going up.
//
// Down (during backward), through a ring of device memory two buckets long:
// 1. Add copies a gradient (device memory) into the ring at its head with a device-to-device
//    copy enqueued on the caller's stream, so it runs after the kernel that produced the
//    gradient and before anything the caller later enqueues there (the caller may free or
//    reuse the gradient at once).
// 2. At once the piece goes on to its pinned host destination on the copy engine's D2H
//    stream, after an event on the caller's stream: the D2H stream works through the
//    gradients while backward runs, and after the last one only its own copy is left.
// 3. Before the ring's head writes over a piece still being copied down, the caller's stream
//    waits for that copy (on the GPU; the host never waits). Pieces are at most half the ring.
// 4. When a Landed callback is set, Add calls it with each piece (unless told not to) at once (on
// the caller's
//    thread), and the one consumer of the pieces calls AwaitPiece before using each, in the
//    same order: it blocks until that piece is on the host. No host function goes on the D2H
//    stream, so a busy host (the CPU update under backward) cannot hold the copies up, nor
//    through the ring the caller's stream behind them.
// 5. Asked to (`squares`), Add also makes the gradient's float64 sum of squares and inf/NaN
//    count on the GPU, on the caller's stream after each piece's copy into the ring, and sends
//    them down into an entry of a pinned array on the D2H stream just before the last piece:
//    once that piece has landed, Squares reads them. The host spends no time on the norm (the CPU
//    update under backward has the cores), and reads the gradient only in the update.
// Up (during Step): a ring of pinned staging slots; AcquireSlot waits (host) for the slot's
// previous upload; Upload sends it on the H2D stream. UploadFrom sends pinned memory of the
// caller's instead (a parameter's new values written where its gradient landed, which the
// next gradient may overwrite only after the upload: Add takes that upload to wait for).
// WaitParameters orders a caller's stream after the last upload.
//
// Thread-safety: the way down (Add, WaitLanded) and the way up (AcquireSlot, Upload,
// UploadFrom, WaitParameters) may each be used by one thread, at the same time (overlap
// "backward" updates and uploads on the engine's worker while backward sends gradients).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/kernels.h"
#include "tiers/runtime_context.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/dtype.h"
#include "zoffload/future.h"
#include "zoffload/status.h"

namespace zoffload::internal {

class DevicePath {
 public:
  /// A piece of a gradient and where it lands on the host.
  struct Piece {
    std::byte* host = nullptr;
    uint64_t bytes = 0;
    uint32_t tag = 0;  ///< the caller's (a parameter index)
  };
  using Landed = std::function<void(Piece)>;

  /// Where Add sends a gradient's squares: `entry` of Create's `squares` entries.
  struct SquaresTo {
    DType dtype;  ///< the gradient's
    size_t entry;
  };

  /// A ring of two buckets of `bucket_bytes` (device), `slots` staging slots of `slot_bytes`
  /// (pinned; 0: none, every upload is UploadFrom), and `squares` entries for gradients'
  /// squares (pinned).
  static Result<std::unique_ptr<DevicePath>> Create(Runtime& rt, uint64_t bucket_bytes, int slots,
                                                    uint64_t slot_bytes, Landed landed,
                                                    size_t squares = 0);
  ~DevicePath();

  /// Sends `bytes` of device memory at `grad` (produced on `stream`, a cudaStream_t; null:
  /// the legacy default stream) to pinned `host`, after `upload` (when given) has read it.
  /// With `squares` its sum of squares and inf/NaN count go down too (item 5). With
  /// `to_consumer` false its pieces do not go to the Landed callback.
  Status Add(const void* grad, uint64_t bytes, std::byte* host, uint32_t tag, void* stream,
             const Future<>* upload = nullptr, const SquaresTo* squares = nullptr,
             bool to_consumer = true);
  /// Blocks until every piece is in host memory.
  Status WaitLanded();
  /// With a Landed callback, from its consumer (one thread): blocks until the oldest piece
  /// not yet awaited is in host memory, and returns its D2H's status.
  Status AwaitPiece();
  /// The squares of the gradient last sent to `entry`, once its last piece has landed
  /// (AwaitPiece, WaitLanded); deterministic for the same gradient. Not finite (inf/NaN in the
  /// gradient, or its copy failed) until then.
  GradSquares Squares(size_t entry) const;

  /// The next staging slot (slot_bytes of pinned memory), once its last upload is done.
  Result<std::byte*> AcquireSlot();
  /// Uploads the first `bytes` of the slot last acquired to `device_dst`.
  Status Upload(void* device_dst, uint64_t bytes);
  /// Uploads `bytes` of pinned `host` to `device_dst` after the work enqueued on `stream`.
  Result<Future<>> UploadFrom(void* device_dst, const std::byte* host, uint64_t bytes,
                              void* stream);
  /// The same, after the earlier uploads only.
  Result<Future<>> UploadFrom(void* device_dst, const std::byte* host, uint64_t bytes);
  Status WaitParameters(void* stream);
  /// device -> host, synchronously (pageable memory is fine).
  Status CopyToHost(void* host, const void* device, uint64_t bytes);

  /// Pieces sent so far.
  uint64_t pieces() const { return pieces_; }
  uint64_t bytes_to_host() const { return bytes_to_host_; }
  uint64_t bytes_to_gpu() const { return bytes_to_gpu_; }
  double upload_wait_seconds() const { return upload_wait_seconds_; }
  uint64_t gpu_bytes() const;
  uint64_t host_bytes() const;

 private:
  struct Region;
  struct Slot;
  DevicePath() = default;
  Result<Future<>> UploadAfter(void* device_dst, const std::byte* host, uint64_t bytes,
                               cudaStream_t after);
  Status AddSquares(const void* piece, uint64_t elements, DType dtype, cudaStream_t stream,
                    bool accumulate, gpu::DeviceGradNorm* result);

  Runtime* rt_ = nullptr;
  DeviceMemory ring_;
  uint64_t head_ = 0;             // where the next piece goes in the ring
  std::deque<Region> in_flight_;  // pieces being copied down, newest last
  // Each piece's D2H; finished ones are dropped.
  std::deque<Future<>> landing_;
  // With a Landed callback: the D2H of each piece handed to it and not yet awaited, oldest
  // first (the caller's thread adds, the consumer takes).
  std::mutex arriving_mu_;
  std::deque<Future<>> arriving_;
  std::vector<std::unique_ptr<Slot>> slots_;
  size_t next_slot_ = 0;
  Future<> last_upload_;  // the newest upload (the H2D stream runs them in order)
  // The gradients' squares (item 5): the GPU's workspace, the stream of its newest launch,
  // which a launch on another stream is ordered after, each entry's result on the GPU and its
  // pinned copy.
  struct Norm;
  std::unique_ptr<Norm> norm_;
  Landed landed_;
  uint64_t pieces_ = 0, bytes_to_host_ = 0, bytes_to_gpu_ = 0;
  double upload_wait_seconds_ = 0;
};

}  // namespace zoffload::internal
