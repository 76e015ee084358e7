// OptimizerState: the Adam state of many tensors (fp32 master parameters, m, v), kept in host
// memory or on NVMe, and the optimizer step over it.
//
// Placement: with home nvme, `offload_ratio` of the elements live on NVMe; tensors holding the
// rest (filled in order, whole tensors) stay in host memory and are updated chunk by chunk
// between the NVMe chunks (an even share before each NVMe chunk's read is waited for), so
// their CPU Adam runs while the disk works. The steps below are those of the NVMe part.
//
// The NVMe pipeline (one step):
// 1. The gradients (host memory) are checked and normed (GradientNorm) while the first chunks
//    are being read: on inf/NaN the step is skipped and nothing is written; otherwise the clip
//    coefficient and 1/loss_scale become one gradient scale.
// 2. Every tensor is cut into chunks of chunk_elements(). The state of all tensors lives in
//    two swap tensors, "optimizer-<layout>.a" and ".b" (<layout>: a hash of the tensor names
//    and sizes, the precision and the chunk size, so a different model never reads another's
//    state), each chunk after chunk, each chunk's params, m and v images side by side, each
//    starting at a block boundary. A step reads the current copy and writes the other: a chunk
//    is one request each way, two sequential streams, the pattern disks serve best. The disk
//    holds the state twice; in exchange the current copy is never written during a step.
// 3. The chunks of all tensors stream through `buffers` slots of host memory: while chunk i is
//    updated by CPU Adam, chunks i+1.. are read and chunk i-1 is written back. A slot is
//    reused only after its write-back has completed. Host memory is the slots, never the state.
// 4. Before the first write the step marks the copy it writes "writing" in the swap manifest
//    (one small manifest update per step, which also records the other copy clean); after the
//    last it commits, deferring the manifest update, and that copy becomes current. A step
//    that fails (read error, checksum mismatch, write error) waits for its requests, never
//    commits, voids the copy it was writing and leaves the current one as it was: the state
//    reads as before the step, and the step may be retried. (With tensors in host memory too,
//    once any of them was updated, the object refuses further steps.)
//    On reopen, the newest committed copy is current: a process killed mid-step loses that
//    step only; killed between steps, at most the last step (whose commit was deferred).
// 5. Chunks are updated with AdamShard::index_offset set, so the result is bit-identical to
//    one AdamUpdate over each whole tensor in memory. Tensors in host memory are updated in
//    chunks of the same size, so a ParamSink sees every tensor chunk by chunk.
// 6. Host memory (the state in host memory and the slots) is reserved from the runtime
//    context's host budget; the swap space, and the trace, are the context's.
//
// Thread-safety: one thread at a time (a step uses the Adam threads and I/O threads itself).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/trace.h"
#include "swap/swap_space.h"
#include "tiers/runtime_context.h"
#include "zoffload/config.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/status.h"

namespace zoffload::internal {

enum class StateHome : uint8_t { kHost, kNvme };

struct OptimizerTensor {
  std::string name;  ///< stable key (e.g. the parameter's name)
  uint64_t n = 0;    ///< elements
  /// Where it starts in the parameter it is a piece of (a ZeRO partition's span): bf16
  /// moments' stochastic rounding then draws the bits the whole parameter's elements would.
  /// (int8 moments' blocks of kInt8StateBlock start at the piece, whatever this says.)
  uint64_t first = 0;
};

struct PipelineOptions {
  int buffers = 4;            ///< chunk slots in host memory; >= 2
  bool overlap_read = true;   ///< read the next chunks while one is updated
  bool overlap_write = true;  ///< write the previous chunk back while one is updated
  /// Elements per chunk; 0: 64M for host state, else 4M (16M for int8).
  uint64_t chunk_elements = 0;
};

struct OptimizerStateOptions {
  StateHome home = StateHome::kHost;
  /// Home nvme: the share of the elements whose state lives on NVMe, in (0, 1]; the rest
  /// stays in host memory.
  double offload_ratio = 1.0;
  StatePrecision precision = StatePrecision::kFp32;
  PipelineOptions pipeline;
  int threads = 0;  ///< CPU Adam threads; 0 = physical cores

  /// From a config: offload_optimizer.device (cpu -> host, nvme -> nvme), ratio (nvme: the
  /// NVMe share; cpu: the share below 1 that stays on the GPU is the engine's, this object
  /// holds the host share), buffer_count, pipeline_read/pipeline_write,
  /// zoffload.optimizer_state, cpu_adam_threads, update_chunk_elements. (NVMe paths are the
  /// runtime context's; zoffload.cpu_adam_bind_cores is process-wide: SetCpuAdamCoreBinding.)
  static Result<OptimizerStateOptions> FromConfig(const Config& config);
};

/// One tensor's gradients for a step, and where its updated low-precision copy goes.
struct TensorGrads {
  const void* grads = nullptr;  ///< host memory, n elements of `dtype`
  DType dtype = DType::kFp32;
  void* param_copy = nullptr;  ///< n elements, when copy != kNone (and no ParamSink)
  ParamCopy copy = ParamCopy::kNone;
  /// This tensor's hyperparameters (its parameter group's); null: the step's.
  const AdamHyper* hyper = nullptr;
};

/// Where a step's updated parameters go, chunk by chunk, in update order: Begin gives the
/// buffer the chunk's low-precision copy is written into (the tensor's TensorGrads::copy
/// says which; ignored when kNone), End runs once the chunk is updated, with its fp32 master
/// values (valid during the call only). A pipeline uploads chunk i in End while chunk i + 1
/// is updated. Called on the stepping thread.
class ParamSink {
 public:
  virtual ~ParamSink() = default;
  virtual Result<void*> Begin(size_t tensor, uint64_t first, uint64_t n) = 0;
  virtual Status End(size_t tensor, uint64_t first, uint64_t n, const float* master) = 0;
};

struct StepStats {
  double seconds = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
  double adam_seconds = 0;     ///< time in CPU Adam
  double io_wait_seconds = 0;  ///< time the step waited for reads or slot write-backs
};

class OptimizerState {
 public:
  /// Allocates the state of `tensors` (zero, parameters unset until Initialize). With NVMe
  /// home, uses the context's swap space (reusing the tensors already stored there, sizes
  /// checked). `context` must outlive the state.
  static Result<std::unique_ptr<OptimizerState>> Create(std::vector<OptimizerTensor> tensors,
                                                        RuntimeContext& context,
                                                        OptimizerStateOptions options);
  ~OptimizerState();

  size_t size() const { return tensors_.size(); }
  const OptimizerTensor& tensor(size_t i) const { return tensors_[i]; }
  uint64_t chunk_elements() const { return chunk_; }
  StateHome home() const { return options_.home; }
  /// Whether tensor i's state is in host memory (else on NVMe).
  bool in_host(size_t i) const { return !params_[i].empty(); }
  /// Host bytes held: the state in host memory, the pipeline slots and Keep's second sets.
  /// (Any thread, during a step too.)
  uint64_t host_bytes() const;

  /// Sets tensor i's state (and writes it durably): master parameters (n floats), and m and v
  /// in Read's layout (AdamMomentBytes each), or zeros where null.
  Status Write(size_t i, const float* params, const void* m = nullptr, const void* v = nullptr);
  /// Copies tensor i's state out: params (n floats), m and v (AdamMomentBytes each).
  Status Read(size_t i, float* params, void* m, void* v);

  /// One optimizer step over every tensor; grads[i] belongs to tensor i. With `sink`, the
  /// updated parameters go to it chunk by chunk (TensorGrads::param_copy is not used).
  /// `order` (a permutation of the tensors, or empty for index order) is the order in which
  /// tensors in host memory are updated. `norm`, when given, is these gradients' norm as the
  /// caller computed it already (while they arrived): the step then has no norm pass.
  Result<AdamStepResult> Step(std::span<const TensorGrads> grads, const AdamHyper& hyper,
                              float loss_scale = 1.0f, float max_grad_norm = 0.0f,
                              ParamSink* sink = nullptr, std::span<const size_t> order = {},
                              const GradNorm* norm = nullptr);
  /// The norm pass of Step alone: the raw (loss-scaled) L2 norm of `grads` and whether all are
  /// finite, for a caller that needs it before the step (Step takes it back as `norm`).
  Result<GradNorm> Norm(std::span<const TensorGrads> grads) const;
  /// CPU Adam over tensor t alone (its state in host memory), the gradients times
  /// `grad_scale`, timed into `stats`: a step taken tensor by tensor (no norm, clip or skip
  /// here; the caller decides).
  Status UpdateTensor(size_t t, const TensorGrads& grads, const AdamHyper& hyper, float grad_scale,
                      ParamSink* sink, StepStats* stats);

  /// Speculation (an update made before the step knows it may stand: overlap "backward").
  /// Keep(t), right before tensor t's update: its state (host memory) is set aside, so that
  /// Undo can bring it back, and the update reads it from there and writes the new state into
  /// a second set of buffers (AdamShard::params_from: no bytes are copied). The first Keep of a
  /// tensor makes that second set (12 B/param with fp32 moments, 8 bf16, about 6 int8; from
  /// the host budget) if the sets held stay within `room` bytes, else returns false and keeps
  /// nothing; a set, once made, serves every later step. Undo: every tensor kept since the
  /// last Commit or Undo is as it was before (the sets swap back). Commit: the updates stand.
  Result<bool> Keep(size_t t, uint64_t room);
  /// Returns the tensors it brought back.
  std::vector<size_t> Undo();
  void Commit();
  /// Tensor t's master parameters (n floats), its state in host memory.
  const float* host_master(size_t t) const { return params_[t].as<float>(); }
  /// The same reads and writes as an NVMe step, without the update: the time the disk needs
  /// for a step's bytes (the I/O bound). State is rewritten unchanged.
  Result<StepStats> IoOnlyPass();
  const StepStats& last_step() const { return last_; }
  SwapSpace* swap() { return swap_; }

 private:
  /// Each tensor's gradients as a shard of the norm pass; an error for a missing one.
  Result<std::vector<AdamShard>> GradientShards(std::span<const TensorGrads> grads) const;
  struct Slot;
  OptimizerState() = default;
  // Create's parts: host memory for the tensors that fill the host share (whole tensors, in
  // order), returning the others; then their NVMe share (the chunks, the two copies in the swap
  // space, the newer committed one current, and the pipeline's slots).
  Result<std::vector<OptimizerTensor>> AllocateHostShare();
  Status SetUpNvme(const std::vector<OptimizerTensor>& on_nvme);
  // One chunk of one tensor, and where its images lie in the swap tensors.
  struct Item {
    size_t tensor;
    uint64_t first;   // element index of the chunk in its tensor
    uint64_t n;       // elements
    uint64_t offset;  // byte offset of the chunk's images in the swap tensor
  };
  uint64_t ImageBytes(uint64_t elements, bool moment) const;
  // Where the m and v images of an n-element chunk start within the chunk's images.
  std::array<uint64_t, 3> PartOffsets(uint64_t n) const;
  // Byte range of item k: its images, padded to the block size, or up to the swap tensor's
  // end for the last item.
  std::pair<uint64_t, uint64_t> ItemRange(size_t k) const;
  // Runs every item through the slots: read, update (when `hyper`), write back; commits.
  // `decide` (when set) runs once the first reads are in flight and gives the gradient scale,
  // or nothing to skip the step (nothing is written then); the tensors in host memory are
  // updated between the NVMe chunks after it.
  Status Stream(std::span<const TensorGrads> grads, const AdamHyper* hyper, ParamSink* sink,
                const std::function<std::optional<float>()>& decide, StepStats* stats);
  // CPU Adam over elements [first, first + n) of tensor `t`, whose state is at params, m, v;
  // the copy goes to the sink when there is one; timed into stats and traced as `label`.
  // Where a piece's state is read from when not from where it is written (a kept tensor).
  struct StateFrom {
    const float* params = nullptr;
    const void* m = nullptr;
    const void* v = nullptr;
  };
  Status UpdatePiece(size_t t, const TensorGrads& g, float* params, void* m, void* v,
                     uint64_t first, uint64_t n, const AdamHyper& hyper, float grad_scale,
                     ParamSink* sink, const std::string& label, StepStats* stats,
                     const StateFrom& from);
  // Updates the tensors whose state is in host memory, chunk by chunk, in `order` (empty:
  // index order).
  Status UpdateInHost(std::span<const TensorGrads> grads, const AdamHyper& hyper, float grad_scale,
                      ParamSink* sink, StepStats* stats, std::span<const size_t> order = {});
  // Tensor t (in host memory), chunk by chunk.
  Status UpdateHostTensor(size_t t, const TensorGrads& grads, const AdamHyper& hyper,
                          float grad_scale, ParamSink* sink, StepStats* stats);
  // The chunk of tensor t (in host memory) that starts at element `first`.
  Status UpdateHostChunk(size_t t, uint64_t first, const TensorGrads& grads, const AdamHyper& hyper,
                         float grad_scale, ParamSink* sink, StepStats* stats);

  std::vector<OptimizerTensor> tensors_;
  OptimizerStateOptions options_;
  uint64_t chunk_ = 0;
  std::vector<Item> items_;          // every chunk of every tensor on NVMe, in order
  std::vector<size_t> first_item_;   // items_ index of each tensor's first chunk (+ end)
  std::array<std::string, 2> keys_;  // the two swap tensors of the state (see 2.)
  int current_ = 0;                  // which of them holds the state
  uint64_t block_ = 0;
  // The state of the tensors in host memory (empty buffers for those on NVMe).
  // The moments are laid out chunk after chunk, as in the swap tensor: chunk c's image
  // (codes, then for int8 its scales) at AdamMomentBytes(precision, c * chunk_).
  std::vector<HostMemory> params_, m_, v_;
  // Keep's second sets (empty until a tensor's first Keep; while kept, the state as it was),
  // whether the next update of each tensor reads there, and the tensors kept since the last
  // Commit or Undo.
  std::vector<HostMemory> copy_params_, copy_m_, copy_v_;
  std::atomic<uint64_t> copy_bytes_{0};  // of the second sets (host_bytes reads it anywhere)
  uint64_t state_bytes_ = 0;             // the state and the slots, set by Create
  std::vector<bool> reads_copy_;
  std::vector<size_t> kept_;
  Runtime* rt_ = nullptr;
  Tracer* tracer_ = nullptr;  // the context's
  // The NVMe part.
  SwapSpace* swap_ = nullptr;  // the context's
  std::vector<std::unique_ptr<Slot>> slots_;
  Status broken_;  // set when a step failed after updating state in host memory
  StepStats last_;
};

}  // namespace zoffload::internal
