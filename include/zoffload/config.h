// zoffload configuration: plain structs parsed from a DeepSpeed-compatible JSON subset.
//
// Parsing is strict: an unknown key is an error naming its JSON path and the nearest valid key,
// a wrong type names the path and the expected type, and impossible combinations are refused
// with the path at fault. Nothing is clamped silently. SerializeConfig(ParseConfig(x)) parses
// back to an equal Config. docs/config.md documents every key.
//
// Thread-safety: the structs are plain values; the functions are reentrant.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/export.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

/// Where a class of tensors is offloaded to.
enum class OffloadDevice { kNone, kCpu, kNvme };
/// optimizer.type: Adam/AdamW, and Adagrad and Lion on the same CPU skeleton.
enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };
/// How the Adam moments (m, v) are stored.
enum class StatePrecision { kFp32, kBf16, kInt8 };
/// When the CPU update runs relative to backward (zoffload.overlap; docs/engine.md).
/// kNone: after backward (exact). kBackward: each parameter as soon as its gradient is on the
/// host, during backward (bit-identical to kNone). kDelayed: step t's update runs during step
/// t+1's forward and backward, which use parameters one step older (not identical). kAuto:
/// the fastest exact mode the trainer allows (backward where one process holds the optimizer
/// state in host memory, else none), chosen when the trainer is made.
enum class Overlap { kNone, kBackward, kDelayed, kAuto };

std::string_view ToString(OffloadDevice device);
std::string_view ToString(OptimizerType type);
std::string_view ToString(StatePrecision precision);
std::string_view ToString(Overlap overlap);

/// optimizer.params
struct OptimizerParams {
  double lr = 1e-3;                            ///< learning rate (the caller may override per step)
  std::array<double, 2> betas = {0.9, 0.999};  ///< beta1, beta2 in [0, 1)
  double eps = 1e-8;                           ///< added to sqrt(v_hat); > 0
  double weight_decay = 0.0;                   ///< L2 (Adam) or decoupled (AdamW) decay; >= 0
  /// For type Adam: true applies weight decay decoupled (AdamW), as DeepSpeed's Adam does by
  /// default; false gives classic L2-coupled Adam. Must not be false with type AdamW.
  bool adam_w_mode = true;
  bool operator==(const OptimizerParams&) const = default;
};

/// optimizer
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  OptimizerParams params;
  /// True when weight decay is applied decoupled from the gradient (AdamW semantics): AdamW
  /// and Lion always, Adam as adam_w_mode says, Adagrad never (L2, as torch's Adagrad).
  bool decoupled_weight_decay() const {
    switch (type) {
      case OptimizerType::kAdam:
        return params.adam_w_mode;
      case OptimizerType::kAdagrad:
        return false;
      case OptimizerType::kAdamW:
      case OptimizerType::kLion:
        break;
    }
    return true;
  }
  bool operator==(const OptimizerConfig&) const = default;
};

/// The hyperparameters of one parameter group (torch's param_groups): the config's
/// optimizer.params, or a group a training loop sets. The one rule for them is
/// HyperparameterProblems, wherever they come from.
struct ParamGroup {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< per the optimizer: decoupled (AdamW) or L2 (Adam)
  static ParamGroup FromConfig(const OptimizerConfig& optimizer);
  bool operator==(const ParamGroup&) const = default;
};

/// What is wrong with `group`, one "KEY: what" line each ("lr: must be >= 0, got -1"; the keys
/// are optimizer.params's): lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0.
std::vector<std::string> HyperparameterProblems(const ParamGroup& group);

/// bf16
struct Bf16Config {
  bool enabled = false;
  bool operator==(const Bf16Config&) const = default;
};

/// fp16 (dynamic loss scaling unless loss_scale > 0)
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;       ///< 0 = dynamic; > 0 = this static scale
  int initial_scale_power = 16;  ///< dynamic scaling starts at 2^this; 0..63
  int loss_scale_window = 1000;  ///< steps without overflow before the scale doubles; >= 1
  int hysteresis = 2;            ///< overflows tolerated before the scale halves; >= 1
  double min_loss_scale = 1.0;   ///< the scale never drops below this; > 0
  bool operator==(const Fp16Config&) const = default;
};

/// zero_optimization.offload_optimizer
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;    ///< directory for the swap files when device is nvme
  bool pin_memory = false;  ///< host buffers from the pinned pool (faster PCIe copies)
  int buffer_count = 4;     ///< pipeline buffers for NVMe streaming; >= 1
  /// Share of the optimizer state kept on the offload device, in (0, 1]; the rest stays on
  /// the next faster tier: host memory for nvme, the GPU for cpu (DeepSpeed's partial offload).
  double ratio = 1.0;
  /// Overlap reading the next shards with the current update. DeepSpeed defaults to false;
  /// zoffload overlaps unless told not to (results are bit-identical either way).
  bool pipeline_read = true;
  bool pipeline_write = true;  ///< overlap writing the previous shard with the current update
  bool operator==(const OffloadOptimizerConfig&) const = default;
};

/// zero_optimization.offload_param (ZeRO-Infinity; needs stage 3)
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;            ///< directory for the swap files when device is nvme
  bool pin_memory = false;          ///< host buffers from the pinned pool
  int buffer_count = 5;             ///< parameter buffers in flight; >= 1
  int64_t buffer_size = 100000000;  ///< elements per parameter buffer; > 0
  int64_t max_in_cpu = 1000000000;  ///< elements kept in host memory when device is nvme; > 0
  bool operator==(const OffloadParamConfig&) const = default;
};

/// zero_optimization
struct ZeroConfig {
  int stage = 0;                              ///< 0..3
  bool contiguous_gradients = true;           ///< copy gradients into one contiguous buffer
  bool overlap_comm = false;                  ///< overlap gradient reduction with backward
  int64_t reduce_bucket_size = 500000000;     ///< elements per gradient reduction bucket; > 0
  int64_t allgather_bucket_size = 500000000;  ///< elements per all-gather bucket; > 0
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  int64_t stage3_prefetch_bucket_size = 50000000;       ///< elements prefetched ahead; 0: none
  int64_t stage3_param_persistence_threshold = 100000;  ///< smaller params stay resident; >= 0
  int64_t stage3_max_live_parameters = 1000000000;      ///< elements resident at once; > 0
  int64_t stage3_max_reuse_distance = 1000000000;       ///< elements; >= 0
  bool operator==(const ZeroConfig&) const = default;
};

/// aio: the NVMe I/O engine
struct AioConfig {
  int64_t block_size = 1048576;  ///< bytes per I/O request; a positive multiple of 4096
  int queue_depth = 8;           ///< requests in flight per ring; 1..4096
  int intra_op_parallelism = 1;  ///< rings (each with its own thread); 1..256. Alias: thread_count
  bool single_submit = false;    ///< submit each request alone instead of batching submissions
  bool overlap_events = true;    ///< refill the queue as each completion arrives, not per batch
  bool operator==(const AioConfig&) const = default;
};

/// zoffload.budgets: per-tier byte budgets; absent = no budget beyond the hardware.
struct TierBudgets {
  std::optional<uint64_t> gpu_bytes;          ///< bytes of GPU memory zoffload may hold
  std::optional<uint64_t> pinned_host_bytes;  ///< bytes of pinned host memory
  std::optional<uint64_t> host_bytes;         ///< bytes of pageable host memory
  /// Host memory for offloaded activations (activation_checkpointing.cpu_checkpointing).
  std::optional<uint64_t> activation_host_bytes;
  bool operator==(const TierBudgets&) const = default;
};

/// zoffload: what DeepSpeed lacks.
struct ZoffloadSection {
  /// NVMe directories to stripe swap files over (bandwidth adds up over devices). When
  /// non-empty it is used instead of the offload sections' single nvme_path.
  std::vector<std::string> nvme_paths;
  TierBudgets budgets;
  StatePrecision optimizer_state = StatePrecision::kFp32;  ///< precision of Adam's m and v
  int cpu_adam_threads = 0;          ///< OpenMP threads of the CPU optimizer; 0 = physical cores
  bool cpu_adam_bind_cores = false;  ///< CPU optimizer thread k bound to physical core k
  /// Elements per chunk of the CPU update (one OpenMP pass, one upload, one NVMe read and
  /// write); 0 = by state precision (4M; int8 16M). A multiple of 256.
  uint64_t update_chunk_elements = 0;
  std::string trace_path;            ///< when non-empty, a Chrome trace-event JSON is written here
  Overlap overlap = Overlap::kNone;  ///< "none", "backward", "delayed" or "auto"
  int delayed_warmup_steps = 0;      ///< with overlap "delayed": the first steps run exact; >= 0
  /// activation_checkpointing.cpu_checkpointing: saved tensors smaller than this stay put.
  uint64_t activation_min_bytes = uint64_t{1} << 20;
  /// Overlap "backward": host memory for the state buffers that let a step undo the updates it made
  /// during backward (clipping, overflow); absent: 3/4 of the memory free at the first step.
  std::optional<uint64_t> rollback_bytes;
  /// ZeRO across ranks: how long a collective waits for the other ranks; > 0
  double comm_timeout_seconds = 300.0;
  bool operator==(const ZoffloadSection&) const = default;
};

/// activation_checkpointing: DeepSpeed's section; zoffload reads cpu_checkpointing.
struct ActivationCheckpointingConfig {
  /// The saved inputs of checkpointed blocks go to host memory while forward runs and come
  /// back ahead of the backward that needs them (zoffload.torch: python/zoffload/activations.py).
  bool cpu_checkpointing = false;
  bool operator==(const ActivationCheckpointingConfig&) const = default;
};

/// A whole configuration.
struct Config {
  /// Batch sizes: train = micro × accumulation × world size. Any two determine the third;
  /// after ParseConfig all three are set (or, when none was given, only accumulation = 1).
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  double gradient_clipping = 0.0;     ///< max global gradient L2 norm; 0 = no clipping
  bool wall_clock_breakdown = false;  ///< print per-phase step timings
  OptimizerConfig optimizer;
  Bf16Config bf16;
  Fp16Config fp16;
  ZeroConfig zero_optimization;
  ActivationCheckpointingConfig activation_checkpointing;
  AioConfig aio;
  ZoffloadSection zoffload;
  bool operator==(const Config&) const = default;
};

/// Options for ParseConfig.
struct ParseOptions {
  int world_size = 1;             ///< ranks that share the batch; >= 1
  std::string source = "config";  ///< prefixed to error messages (a file name)
  /// When set, receives the keys of UnusedConfigKeys() that the config sets (each is also
  /// logged once per process as a warning).
  std::vector<std::string>* unused_keys = nullptr;
  /// Logs each unused key that the config sets (once per process); false for text that is
  /// SerializeConfig's output (every key set, the user warned when it was first parsed).
  bool warn_unused = true;
};

/// Parses and validates JSON text. On error the Status message lists every problem found,
/// one per line, each as "SOURCE: json.path: what is wrong".
Result<Config> ParseConfig(std::string_view json_text, const ParseOptions& options = {});

/// Reads and parses a JSON file; the file name is the error source. Only a regular file of at
/// most 16 MiB is read (a directory, FIFO or device such as /dev/zero is refused unread).
Result<Config> LoadConfigFile(const std::string& path, int world_size = 1);

/// A config's JSON before it is parsed into a Config (HuggingFace-style "auto" values still to
/// be filled): read as LoadConfigFile reads (`is_file`: `source` is a path; else it is the JSON
/// text), checked by the parser's JSON rules (syntax, duplicate keys, nesting, numbers that
/// would be read as another value), and written back as compact JSON text. The Python module
/// reads configs through it, so both languages parse one way.
Result<std::string> ReadConfigJson(const std::string& source, bool is_file);

/// Checks cross-field rules and resolves the batch sizes; ParseConfig calls it. Useful
/// after building a Config in code.
Status ValidateConfig(Config& config, int world_size = 1);

/// The aio section's problems, one "aio.KEY: what is wrong" line each (none when valid):
/// the one rule set that ValidateConfig and the I/O engine both apply.
std::vector<std::string> AioProblems(const AioConfig& aio);
/// Largest aio.block_size: one request's bytes.
inline constexpr int64_t kMaxAioBlockSize = int64_t{1} << 30;
/// Fewest offload_optimizer.buffer_count with device nvme (one slot read while one is written).
inline constexpr int kMinNvmeBuffers = 2;
/// zoffload.update_chunk_elements is a multiple of this: chunks hold whole int8 state blocks.
inline constexpr uint64_t kUpdateChunkMultiple = 256;

/// The JSON form of `config` (every key, pretty-printed).
std::string SerializeConfig(const Config& config);

/// Every JSON key path the parser accepts ("aio.block_size", ...), aliases excluded.
std::vector<std::string> AcceptedConfigKeys();

/// The accepted keys that zoffload reads nowhere yet (kept so that DeepSpeed configs parse;
/// docs/config.md marks them "unused"): setting one has no effect, and a warning says so.
std::vector<std::string> UnusedConfigKeys();

}  // namespace zoffload
ZO_API_END
