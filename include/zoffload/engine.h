// OffloadEngine: ZeRO-Offload for one GPU — the object a training loop holds.
//
// The engine owns the optimizer: fp32 master weights and the Adam state (host memory or NVMe,
// fp32/bf16/int8 moments, as the config says). The model keeps its low-precision parameters
// in GPU memory; the engine takes each gradient as backward produces it, updates on the CPU,
// and writes the new parameters back into the model's memory.
//
// One training step:
// 1. Create registers every parameter (name, memory, elements, dtype, group); the masters
//    start as the parameter's values (or the fp32 values given).
// 2. GradientReady(name, grad, ...) is called as each gradient is produced (PyTorch's
//    post-accumulate-grad hook). The engine copies it, on the caller's stream, into a GPU ring
//    of two buckets of zero_optimization.reduce_bucket_size elements, so the caller may free
//    the gradient as soon as the call returns, and at once sends it on to pinned host memory on
//    the copy engine's D2H stream while backward runs on (the ring's space is reused once its
//    copy is done; the caller's stream waits for that on the GPU, never the host). With
//    gradient_accumulation_steps > 1 the engine's worker thread adds each landed gradient into
//    fp32 host accumulators (gradients are summed over the micro-batches; divide the loss by
//    the number of micro-batches for their mean).
// 3. Step() at the accumulation boundary: it waits for the gradients still in flight, then
//    (a) the global gradient norm (float64) with the inf/NaN check, (b) the fp16 loss scale's
//    overflow skip (nothing is written; the scale follows fp16.* of the config), (c) clipping
//    to gradient_clipping, and (d) the CPU update of every parameter, chunk by chunk: each
//    chunk writes its new bf16/fp16 values in the same pass over its gradient where that
//    landed (state in host memory; NVMe state: into a pinned staging slot, as a failed step
//    keeps its gradients), and they are uploaded from there while the next chunk is
//    updated. Each parameter group's hyperparameters (SetGroup) apply, so a learning-rate
//    schedule works.
// 4. WaitParameters(stream) makes the caller's stream wait for the uploads; the host never
//    waits for them.
//
// Host-only mode: with no GPU (or EngineOptions::host_params) parameters and gradients are
// host memory; gradients are copied (or accumulated) during GradientReady and the update
// writes the parameters in place. The same API and the same arithmetic.
//
// The results are bit-identical to CPU Adam over the same gradients in memory (AdamUpdate per
// tensor after GradientNorm and the clip decision), whatever the placement, ratio, thread
// count or bucket size.
//
// Thread-safety: one thread at a time (PyTorch runs a device's backward hooks on one thread):
// GradientReady calls must not overlap each other or Step, WaitParameters, SetGroup,
// ReadState, LoadState and SetSteps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/dtype.h"
#include "zoffload/export.h"
#include "zoffload/runtime.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

struct ParameterSpec {
  std::string name;      ///< unique, stable (checkpoints and state are keyed by it)
  void* data = nullptr;  ///< the model's parameter: device memory, or host memory in host mode
  uint64_t elements = 0;
  DType dtype = DType::kBf16;
  /// Initial fp32 master values (host memory, `elements` floats), e.g. from an fp32
  /// checkpoint; null: the masters start as `data`'s values.
  const float* initial = nullptr;
  int group = 0;  ///< index into EngineOptions::groups
  /// The parameter's shape, kept in checkpoints for exported weights; empty: {elements}.
  std::vector<uint64_t> shape = {};
};

struct EngineOptions {
  /// Parameters and gradients are host memory and no GPU is used. Chosen anyway when no GPU
  /// is usable (or the build has no CUDA).
  bool host_params = false;
  /// The parameters are device memory: fail with FAILED_PRECONDITION instead of falling back to
  /// host mode when no GPU is usable.
  bool require_gpu = false;
  /// The parameter groups; empty: one group from the config's optimizer.params.
  std::vector<ParamGroup> groups;
  /// A context shared with other parts (must outlive the engine); null: the engine makes its
  /// own from the config (RuntimeOptions::FromConfig).
  RuntimeContext* context = nullptr;
  /// Pinned upload buffers of one chunk each, for NVMe state (host state uploads from where
  /// the gradients landed); >= 2.
  int staging_slots = 4;
};

/// What one Step did and how long each phase took.
struct EngineStepStats {
  int64_t step = 0;                ///< optimizer steps taken so far (skipped ones not counted)
  bool skipped = false;            ///< inf/NaN gradients: nothing was updated
  double grad_norm = 0;            ///< of the unscaled gradients
  float clip_coef = 1;             ///< applied to the unscaled gradients
  float loss_scale = 1;            ///< used by this step (fp16), then updated
  double seconds = 0;              ///< the whole Step call
  double wait_grads_seconds = 0;   ///< waiting for gradients still on their way to the host
  double update_seconds = 0;       ///< norm, update, NVMe I/O and upload issue
  double adam_seconds = 0;         ///< of which in CPU Adam
  double upload_wait_seconds = 0;  ///< of which waiting for a staging slot's upload
  double io_wait_seconds = 0;      ///< of which waiting for NVMe
  uint64_t bytes_to_host = 0;      ///< gradients over PCIe, every micro-step of this step
  uint64_t bytes_to_gpu = 0;       ///< parameters over PCIe
  uint64_t nvme_bytes_read = 0, nvme_bytes_written = 0;
  /// Overlap "backward": how the update ran. "committed": made during backward and kept (the
  /// step needed no clipping and its gradients were finite); "redone": made during backward,
  /// then undone and made again after it, exactly as overlap "none" (`speculation_why` says
  /// why: clipped, inf/NaN); "exact": made after backward only (`speculation_why`: the last
  /// step clipped or overflowed, the loss scale changed). Empty under the other modes.
  std::string speculation;
  std::string speculation_why;
  /// Overlap "backward": elements updated during backward (the rest after it).
  uint64_t speculated_elements = 0;
};

class OffloadEngine {
 public:
  /// Validates `config` (offload_optimizer.device cpu or nvme, bf16/fp16/fp32 as the
  /// parameters' dtypes), allocates the state (host budget, NVMe space), and initializes the
  /// masters. Errors name the parameter, the key or the size at fault.
  static Result<std::unique_ptr<OffloadEngine>> Create(const Config& config,
                                                       std::vector<ParameterSpec> params,
                                                       EngineOptions options = {});
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  /// Hands over parameter `name`'s gradient (`elements` of `dtype`, the parameter's): device
  /// memory, ordered after the work enqueued on `stream` (a cudaStream_t; null: the legacy
  /// default stream), or host memory in host mode. The memory may be reused once this
  /// returns. Each parameter takes one gradient per micro-batch; with
  /// gradient_accumulation_steps 1 (or unset) and overlap "none", further gradients before Step
  /// are added into the first in the dtype, as torch adds into .grad (on a GPU too: they go
  /// down like the first and the engine's worker adds them in while backward runs).
  Status GradientReady(std::string_view name, const void* grad, uint64_t elements, DType dtype,
                       void* stream = nullptr);
  /// Host mode: the engine's own (pinned, with a GPU present) memory for parameter `name`'s
  /// gradient, where a caller may write it before GradientReady(name, that memory, ...), which
  /// then takes it in place, with no copy: a D2H straight into it saves a pass over every
  /// gradient on the host. Null where the engine cannot take a gradient in place: with a GPU
  /// (the engine's own copies do it), gradient_accumulation_steps > 1 (sums), or overlap
  /// "delayed" (the running update still reads the last gradient there). Write the buffer
  /// only between Step and this parameter's GradientReady.
  Result<void*> GradientBuffer(std::string_view name);
  /// Overlap "none": the global L2 norm of this step's gradients, unscaled by the fp16 loss
  /// scale (inf or NaN when a gradient holds one): what torch's clip_grad_norm_ returns, for a
  /// training loop that clips before Step. Every parameter must have its gradients; the norm
  /// is computed once and Step reuses it (a new gradient drops it). FAILED_PRECONDITION under
  /// the other overlap modes, whose updates do not wait for the norm.
  Result<double> GradientNorm();
  /// The max norm that Step clips the global gradient norm to (0: no clipping), from the next
  /// Step on: the config's gradient_clipping, as a training loop's clip_grad_norm_ sets it.
  /// Refused above 0 under overlap "backward".
  Status SetGradientClipping(double max_norm);
  /// The optimizer step; every parameter must have had gradient_accumulation_steps gradients.
  /// On an error the gradients are kept and the state is as before (see docs/engine.md for
  /// the one exception), so Step may be called again.
  Result<EngineStepStats> Step();
  /// Work enqueued on `stream` (a cudaStream_t) after this call sees the updated parameters.
  /// The host does not wait. A no-op in host mode.
  Status WaitParameters(void* stream = nullptr);
  /// Overlap "delayed": waits for the update still running and sends its values to the model
  /// (after the work enqueued on `stream`), so the parameters are those of the last Step, as
  /// without overlap. For the end of training, or before reading the model's weights. A no-op
  /// in the other modes.
  Status Flush(void* stream = nullptr);

  /// The fp16 loss scale to multiply the loss by (1 without fp16 or with a static scale 1).
  float loss_scale() const;
  int group_count() const;
  const ParamGroup& group(int index) const;
  /// Changes a group's hyperparameters from the next Step on (an LR schedule).
  Status SetGroup(int index, const ParamGroup& group);

  /// Parameter `name`'s optimizer state: master values (elements floats), m and v
  /// (AdamMomentBytes of the state precision each; int8: codes, then the block scales).
  Status ReadState(std::string_view name, float* master, void* m, void* v);
  /// Sets parameter `name`'s optimizer state (ReadState's layout; m, v null: zeros) and writes
  /// the master values, in the parameter's dtype, into the model's parameter (call
  /// WaitParameters before the next forward). For restoring a checkpoint; with SetSteps.
  Status LoadState(std::string_view name, const float* master, const void* m, const void* v);
  /// Sets the optimizer step count (Adam's bias correction continues from it).
  Status SetSteps(int64_t steps);

  /// Writes a checkpoint into directory `dir` (created; an existing one is replaced
  /// atomically): every parameter's master and moments, the step count, the fp16 loss scale
  /// and the groups (docs/checkpoints.md). Between steps only. One parameter's state is in
  /// memory at a time, whatever the state's home.
  Status Save(const std::string& dir);
  /// Restores a checkpoint that Save wrote for the same parameters (names, sizes, dtypes) and
  /// state precision; the state's home (host, NVMe, ratio) may differ. Every checksum is
  /// verified before anything changes; the model's parameters get the masters (call
  /// WaitParameters before the next forward). The run then continues bit-identically.
  Status Load(const std::string& dir);

  bool on_gpu() const;
  int64_t steps() const;  ///< optimizer steps taken (skipped ones not counted)
  uint64_t total_elements() const;
  const EngineStepStats& last_step() const;
  /// Host bytes the engine holds: state, gradient buffers, staging.
  uint64_t host_bytes() const;
  /// Device bytes the engine holds beyond the model's parameters: the gradient ring.
  uint64_t gpu_bytes() const;

 private:
  struct Impl;
  explicit OffloadEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Writes the fp32 master weights of the checkpoint in `checkpoint_dir` (OffloadEngine::Save)
/// to `out` as safetensors: one F32 tensor per parameter, named and shaped as registered
/// (ParameterSpec::shape), readable by the safetensors package and by transformers. Each
/// parameter is checked against its checksum first and only one is in memory at a time. The
/// file appears whole or not at all; an existing `out` is replaced only with `overwrite`.
/// The zoffload-export tool and zoffload.export_safetensors call this.
Status ExportSafetensors(const std::string& checkpoint_dir, const std::string& out,
                         bool overwrite = false);

}  // namespace zoffload
ZO_API_END
