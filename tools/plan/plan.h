// zoffload-plan's model: what a training run through the OffloadEngine holds in each tier
// (GPU, host, NVMe) and how long its step takes, for a model shape and this machine's speeds.
//
// Memory (bytes; P parameters, b x s tokens per micro-batch, N data-parallel ranks on this
// machine, one GPU each; GPU figures are per GPU, host and NVMe figures for the machine):
// - GPU: the bf16 parameters (2P; ZeRO stage 3: the rank's partition 2P/N, none with
//   offload_param, plus the fetched window when N > 1 or offload_param: the largest module's
//   parameters and stage3_prefetch_bucket_size more, 2 bytes each; with offload_param on one
//   rank also the parameters kept for reuse where the most are kept, at the turn from forward
//   to backward (KeptAtTurn), at most stage3_max_live_parameters), zoffload's gradient ring
//   (one rank, parameters resident: two buckets of reduce_bucket_size elements, 2 bytes each,
//   capped at 2P; across ranks and with offload_param the gradients go straight to pinned host
//   memory instead), and the activations: with
//   gradient checkpointing each layer's input (2bsh; with activation_checkpointing.
//   cpu_checkpointing in pinned host memory instead) plus one layer recomputed (2bs(4h + 3i))
//   and the logits in bf16, fp32 and their gradient (10bsV); without it, 34bsh per layer (the
//   stored tensors of a transformer layer with fused attention) plus the logits.
// - host: the fp32 master (4P) and Adam's moments (fp32 8P, bf16 4P, int8 2P + scales) on the
//   host share (1 - ratio), the gradient buffers (accumulation 1: 2P, the gradient in place;
//   more: 4P fp32 sums + 2P landing, and with overlap delayed 2P for the new values), stage 3
//   with offload_param the bf16 parameters (2P; offload_param "nvme": its host cache,
//   2 min(max_in_cpu, P), and ZeRO's gradients replace the gradient buffers: 4P fp32 sums, 2P
//   at one rank with one micro-batch), the layers' inputs with cpu_checkpointing, and
//   each rank's process (N kProcessBytes: torch and CUDA). Stages 1-3 partition the state and
//   the gradient buffers across the ranks (each holds 1/N: the machine holds them once); stage
//   1 all-reduces the gradients and keeps its partition, stage 2 reduce-scatters them: the
//   same memory, with twice the communication at stage 1. Pinned (page-locked, counted against
//   the memlock limit): what the GPU copies to or from — the bf16 gradient buffers (landing,
//   new values) and offloaded parameters; the state and the fp32 sums are pageable.
// - NVMe: the NVMe share of the state, twice (the optimizer state keeps two copies), and with
//   offload_param "nvme" the bf16 parameters (2P).
// Step time (seconds; one rank, stages 1-2; accumulation N > 1 in mode delayed only, where the
// N micro-batches' forward+backward (N F) and N gradients down replace F and one; what is
// measured), from the
// forward+backward time F (backward is kBackwardShare of it: Speeds::backward_share), CPU Adam's
// rate for the layout, and NVMe's rate for the NVMe share:
// - none: F + Adam; backward: F(1 - kBackwardShare) + max(F kBackwardShare, kb Adam);
//   delayed: max(F, kd Adam), where kb = kBackwardSlowdown and kd = kDelayedSlowdown are
//   Adam's slowdowns beside the training loop (measured on the H200, docs/PERF.md). Each parameter
//   tensor adds kHandOverSeconds to the backward (H: hooks, copies and uploads around the step).
//   NVMe state adds its I/O where the pipeline cannot hide it: max(Adam, I/O) replaces Adam; the
//   I/O moves the NVMe share's bytes in and out at the disk's mixed read+write rate (or read, then
//   write). PCIe (when its speeds are given) moves 2P down and 2P up: in mode none the gradients
//   under backward (max(backward, down)) and the parameters under the update (max(update, up));
//   in backward and delayed both ways at once, a third term in the max.
// - stage 3 + offload_param, one rank, mode none: max(F, the copies) + Adam + H, where the
//   copies are each parameter fetched per use (3 x 2P bytes up with checkpointing: forward, the
//   recomputed forward and backward; 2 x 2P without) and the gradients down (2P), at the host-
//   to-device rate: prefetch runs them under the compute (H100, docs/PERF.md run 8: 96-97 % of
//   them hidden at 9.98B and 13.21B). With a share of the state on NVMe, max(Adam, its I/O)
//   replaces Adam (checked on the 13.21B run). offload_param "nvme": the values the host cache
//   cannot hold (V bytes) are read twice a step (forward; backward with its recomputation) ahead
//   of use, max(F, the copies, 2V at the read rate), and written back by the update, max(Adam,
//   the state's I/O + V at the write rate); not checked against a run yet, and the bound says so.
// F is the measured forward+backward scaled to the model's parameters (same tokens).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal::plan {

inline constexpr double kBackwardShare = 0.73;  // of forward+backward, with checkpointing
// CPU Adam beside the training loop, against alone (7B runs 3-4, H200; run 6 on the H100, with
// gradients taken in place, is 8 % under the estimate): per parameter as gradients land
// (overlap backward: each one's own norm pass, the threads half idle while backward runs), and
// in one pass during the next step (overlap delayed).
inline constexpr double kBackwardSlowdown = 1.22;
inline constexpr double kDelayedSlowdown = 1.06;
inline constexpr uint64_t kProcessBytes = uint64_t{3} << 29;  // 1.5 GiB: torch, CUDA context
// Per parameter tensor: what a step takes beyond forward+backward and the update (the hooks,
// the last gradients' copy, the last uploads); fitted on the 7B runs, not a measured phase.
inline constexpr double kHandOverSeconds = 0.15e-3;

struct ModelShape {
  std::string name;
  uint64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0;
  bool tied = false;  ///< input and output embeddings shared
  uint64_t params = 0;
  uint64_t tensors = 0;  ///< parameter tensors (0: unknown)
  /// The parameters of the largest module (a Llama shape: the embedding or the output layer,
  /// else an MLP projection); 0: unknown.
  uint64_t largest_module() const;
  /// The parameters of one decoder layer (0: unknown).
  uint64_t layer() const;
};

/// A named shape ("llama-7b", "llama-13b", "llama-70b", "llama3-8b"), a HuggingFace
/// config.json, or (when `params` > 0) just a parameter count. Unknown names are an error that
/// suggests the nearest one.
Result<ModelShape> ModelNamed(const std::string& name_or_config);
/// A Llama-shaped HuggingFace config.json's model (`name` for messages); every size checked.
Result<ModelShape> ModelFromConfigJson(const nlohmann::json& config, const std::string& name);
ModelShape ModelOfParams(uint64_t params);
/// The parameters and parameter tensors of a Llama-shaped model (fills params and tensors).
void CountLlama(ModelShape& m);

struct Workload {
  uint64_t batch = 4, sequence = 2048;
  int accumulation = 1;
  bool checkpointing = true;
  bool cpu_checkpointing = false;         ///< the checkpointed layers' inputs in host memory
  uint64_t bucket_elements = 50'000'000;  ///< reduce_bucket_size
  int world = 1;                          ///< data-parallel ranks on this machine, a GPU each
  int stage = 2;                          ///< zero_optimization.stage (0 counts as 1)
  bool offload_param = false;             ///< stage 3: offload_param.device "cpu" or "nvme"
  /// offload_param "nvme" (one rank: zoffload.torch runs it as ZeRO at world size 1): the
  /// values on NVMe behind a host cache of max_in_cpu elements
  bool param_nvme = false;
  uint64_t max_in_cpu = 1'000'000'000;
  uint64_t prefetch_elements = 50'000'000;  ///< stage 3: stage3_prefetch_bucket_size
  /// stage 3 + offload_param, one rank: stage3_max_live_parameters, the most kept for reuse
  uint64_t live_elements = 1'000'000'000;
  /// and stage3_max_reuse_distance: the fetches between two uses that still keep a module's
  uint64_t reuse_distance = 1'000'000'000;
};

struct Candidate {
  Overlap overlap = Overlap::kNone;
  StatePrecision state = StatePrecision::kFp32;
  double nvme_ratio = 0;  ///< share of the optimizer state on NVMe (0: all in host memory)
};

struct Speeds {
  double fwd_bwd_seconds = 0;   ///< the GPU's forward + backward of one step; 0: unknown
  uint64_t fwd_bwd_params = 0;  ///< the model it was measured on; 0: the model planned
  /// Of fwd_bwd_seconds, the backward (zoffload-bench engine's stand-in is all backward: 1).
  double backward_share = kBackwardShare;
  double adam_gparams[3] = {0, 0, 0};  ///< CPU Adam per state precision (fp32, bf16, int8)
  double& adam(StatePrecision p) { return adam_gparams[static_cast<int>(p)]; }
  double adam(StatePrecision p) const { return adam_gparams[static_cast<int>(p)]; }
  double nvme_read_gbps = 0, nvme_write_gbps = 0;
  double nvme_mixed_gbps = 0;  ///< reads and writes at once (zoffload-bench step); 0: unknown
  /// zoffload-bench pcie (pinned): each way alone, and each way while the other runs; 0: unknown.
  double pcie_h2d_gbps = 0, pcie_d2h_gbps = 0, pcie_both_gbps = 0;
  /// One zoffload-bench pcie figure by its test name ("h2d", "d2h", "both_h2d", "both_d2h").
  void SetPcie(std::string_view test, double gbps);
};

struct Estimate {
  Candidate candidate;
  uint64_t gpu_bytes = 0, host_bytes = 0, nvme_bytes = 0;
  uint64_t gpu_params = 0, gpu_ring = 0, gpu_activations = 0;  ///< per GPU
  uint64_t host_state = 0, host_grads = 0, host_params = 0;    ///< the machine's
  uint64_t host_activations = 0;  ///< cpu_checkpointing: the layers' inputs, per GPU
  uint64_t host_process = 0;
  uint64_t host_pinned = 0;                                   ///< of host_bytes: page-locked
  double adam_seconds = 0, io_seconds = 0, step_seconds = 0;  ///< 0: a speed is unknown
  double pcie_seconds = 0;  ///< the transfers the mode makes, at the rate they run at
  std::string bound;        ///< "GPU (forward+backward)", "CPU Adam", "NVMe", or why no time
};

Estimate EstimateRun(const ModelShape& m, const Workload& w, const Candidate& c, const Speeds& s);

/// Speeds read from zoffload-bench JSON files (adam, nvme, step, engine, pcie) and
/// bench/finetune_7b.py's JSON (its fwd_bwd system gives F, its exact zoffload system CPU
/// Adam's rate; an engine record gives F as its gradient production alone, all backward);
/// later files override earlier ones.
Result<Speeds> SpeedsFromJson(const std::vector<std::string>& files);
/// Adds the speeds of one such file's parsed JSON (`file` for messages) to `speeds`; fields of
/// another type than expected are ignored, as absent ones are.
Status AddSpeeds(const nlohmann::json& records, const std::string& file, Speeds* speeds);

}  // namespace zoffload::internal::plan
