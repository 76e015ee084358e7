// DevicePath: the OffloadEngine's CUDA side (compiled only with CUDA) — gradient buckets
// going down, parameter chunks going up.
//
// Down (during backward):
// 1. Add copies a gradient (device memory) into the current bucket with a device-to-device
//    copy enqueued on the caller's stream, so it runs after the kernel that produced the
//    gradient and before anything the caller later enqueues there (the caller may free or
//    reuse the gradient at once).
// 2. A full bucket is flushed: its pieces go to their pinned host destinations on the copy
//    engine's D2H stream, after an event on the caller's stream; the caller's stream moves to
//    the other bucket. Before a bucket is written again, the caller's stream waits (on the
//    GPU, never the host) for that bucket's last D2H.
// 3. When a Landed callback is set, each flush ends with a host function on the D2H stream
//    that hands the flushed pieces to it (a CUDA thread; it must neither block nor call CUDA).
// Up (during Step): a ring of pinned staging slots; AcquireSlot waits (host) for the slot's
// previous upload; Upload sends it on the H2D stream; WaitParameters orders a caller's stream
// after the last upload.
//
// Thread-safety: one thread at a time (the engine serializes its calls).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tiers/runtime_context.h"
#include "zoffload/status.h"

namespace zoffload::internal {

class DevicePath {
 public:
  /// A piece of a gradient in a bucket and where it lands on the host.
  struct Piece {
    std::byte* host = nullptr;
    uint64_t bytes = 0;
    uint64_t offset = 0;  ///< in the bucket
    uint32_t tag = 0;     ///< the caller's (a parameter index)
  };
  using Landed = std::function<void(std::vector<Piece>)>;

  /// Two buckets of `bucket_bytes` (device), `slots` staging slots of `slot_bytes` (pinned).
  static Result<std::unique_ptr<DevicePath>> Create(RuntimeContext::Impl& rt, uint64_t bucket_bytes,
                                                    int slots, uint64_t slot_bytes, Landed landed);
  ~DevicePath();

  /// The CUDA device `ptr` points into, or -1 for host memory.
  static Result<int> DeviceOf(const void* ptr);
  int device() const { return device_; }

  /// Sends `bytes` of device memory at `grad` (produced on `stream`) to pinned `host`.
  Status Add(const void* grad, uint64_t bytes, std::byte* host, uint32_t tag, void* stream);
  /// Sends the current bucket now (no-op when empty).
  Status Flush(void* stream);
  /// Blocks until every flushed piece is in host memory.
  Status WaitLanded();

  /// The next staging slot (slot_bytes of pinned memory), once its last upload is done.
  Result<std::byte*> AcquireSlot();
  /// Uploads the first `bytes` of the slot last acquired to `device_dst`.
  Status Upload(void* device_dst, uint64_t bytes);
  Status WaitParameters(void* stream);
  /// device -> host, synchronously (pageable memory is fine).
  Status CopyToHost(void* host, const void* device, uint64_t bytes);

  /// Non-empty flushes so far (each runs the Landed callback once).
  uint64_t flushes() const { return flushes_; }
  uint64_t bytes_to_host() const { return bytes_to_host_; }
  uint64_t bytes_to_gpu() const { return bytes_to_gpu_; }
  double upload_wait_seconds() const { return upload_wait_seconds_; }
  uint64_t gpu_bytes() const;
  uint64_t host_bytes() const;

 private:
  struct Bucket;
  struct Slot;
  DevicePath() = default;

  RuntimeContext::Impl* rt_ = nullptr;
  int device_ = 0;
  uint64_t bucket_bytes_ = 0;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  size_t current_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
  size_t next_slot_ = 0;
  Landed landed_;
  uint64_t flushes_ = 0, bytes_to_host_ = 0, bytes_to_gpu_ = 0;
  double upload_wait_seconds_ = 0;
};

}  // namespace zoffload::internal
