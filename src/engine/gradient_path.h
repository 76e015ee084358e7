// GradientPath: the engine core's seam for where gradients arrive and where new parameter
// values go — one implementation per kind of parameter memory:
// - host (host_gradient_path.cc): parameters and gradients are host memory; a gradient is
//   copied (or added) into the engine's buffer as it is handed over, and the update writes the
//   new values into the parameter in place;
// - device (device_gradient_path.cc, CUDA builds): gradients go down through a GPU ring to
//   pinned memory on the copy engine's D2H stream while backward runs (DevicePath), the update
//   writes each chunk's new values where its gradient landed (or into a staging slot) and they
//   go up on the H2D stream.
// The core (engine_core.h) holds one and never asks which.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/aligned_buffer.h"
#include "tiers/optimizer_state.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/engine.h"
#include "zoffload/status.h"

namespace zoffload::internal {

struct EngineCore;
struct EngineParam;

/// A gradient piece handed to the engine's worker thread: `host` is where it lands (null: it
/// is there already); `tag` says whose it is (Tag), or names a schedule's task.
struct WorkItem {
  std::byte* host = nullptr;
  uint64_t bytes = 0;
  uint32_t tag = 0;
  /// The tag of a piece of parameter `param`'s gradient: whether it adds to the window's sum,
  /// and whether it is the parameter's last gradient of the window.
  static uint32_t Tag(size_t param, bool add, bool last) {
    return static_cast<uint32_t>(param << 2 | (add ? 2u : 0u) | (last ? 1u : 0u));
  }
  size_t param() const { return tag >> 2; }
  bool adds() const { return (tag & 2u) != 0; }
  bool last() const { return (tag & 1u) != 0; }
};

/// The sink (ParamSink) writes an update's new values chunk by chunk to the model.
class GradientPath : public ParamSink {
 public:
  ~GradientPath() override = default;
  virtual bool on_gpu() const = 0;
  /// Allocates what parameter `p` needs on this path beyond its gradient buffer.
  virtual Status Allocate(EngineParam& p) = 0;
  /// The first gradient of a window is about to be handed over.
  virtual void BeginWindow() {}
  /// Takes parameter i's gradient (the parameter's elements and dtype, checked) into its
  /// buffer (`add`: a later micro-batch of the window, summed), after the work on `stream`;
  /// its pieces go to the worker where the core or the schedule wants them there.
  virtual Status Hand(size_t i, const void* grad, bool add, bool last, void* stream) = 0;
  /// A further gradient of parameter i after its declared micro-batches (EngineCore::AddsAsTorch):
  /// added into its gradient in its dtype, as torch adds into .grad, once it is in host memory.
  virtual Status HandExtra(size_t i, const void* grad, void* stream) = 0;
  /// On the worker, before the core uses a piece Hand sent it: false if it failed to arrive
  /// (the step then reports it: WaitLanded).
  virtual bool Arrived(const WorkItem& item) = 0;
  /// Blocks until every gradient handed over is in host memory.
  virtual Status WaitLanded() = 0;
  /// Parameter i's sum of squares where the path made it (on the GPU, once landed).
  virtual std::optional<GradSquares> Squares(size_t i) const = 0;
  /// Where a caller may write parameter `p`'s gradient for Hand to take in place, or null.
  virtual void* InPlaceBuffer(EngineParam& p) = 0;
  /// Sends `p`'s values waiting at `from` (host, the parameter's dtype) to the model, after the
  /// work on `stream`.
  virtual Status Publish(EngineParam& p, const std::byte* from, void* stream) = 0;
  /// Before the sink writes where `p`'s gradient landed outside a step (LoadState): the last
  /// upload from there is done.
  virtual Status AwaitUpload(EngineParam& p) = 0;
  /// Parameter `p`'s values in host memory: its own memory, or read into `scratch` (grown to
  /// the parameter's bytes where it is used).
  virtual Result<const void*> Values(const EngineParam& p, AlignedBuffer& scratch) = 0;
  virtual Status WaitParameters(void* stream) = 0;
  /// Adds the transfers since the last call (bytes each way, upload waits) to `stats`.
  virtual void TakeTransferStats(EngineStepStats* stats) = 0;
  virtual uint64_t host_bytes() const = 0;
  virtual uint64_t gpu_bytes() const = 0;
};

/// The host path (no GPU, or EngineOptions::host_params).
std::unique_ptr<GradientPath> MakeHostPath(EngineCore& core);
/// The device path, for `core`'s parameters, state and schedule (made before it): a ring of two
/// buckets of zero_optimization.reduce_bucket_size elements. UNIMPLEMENTED in a build without
/// CUDA (the core asks for it only where a GPU is usable).
Result<std::unique_ptr<GradientPath>> MakeDevicePath(EngineCore& core);

}  // namespace zoffload::internal
