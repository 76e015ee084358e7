// The config's rules beyond each key's type: ranges, the batch sizes' arithmetic, and what
// keys rule out together (config.h: ValidateConfig, HyperparameterProblems, AioProblems).
#include "common/config_rules.h"

#include <set>
#include <utility>

#include "common/strings.h"

namespace zoffload {

using internal::NormalDirectory;
using internal::StrCat;

namespace {

// ---- cross-field rules ------------------------------------------------------------------

class RuleChecker {
 public:
  explicit RuleChecker(std::vector<std::string>* errors) : errors_(errors) {}
  void Require(bool ok, std::string_view path, const std::string& message) {
    if (!ok) errors_->push_back(StrCat(path, ": ", message));
  }
  void Add(const std::string& problem) { errors_->push_back(problem); }
  template <typename T>
  void Positive(T value, std::string_view path) {
    Require(value > 0, path, StrCat("must be > 0, got ", value));
  }
  template <typename T>
  void NonNegative(T value, std::string_view path) {
    Require(value >= 0, path, StrCat("must be >= 0, got ", value));
  }

 private:
  std::vector<std::string>* errors_;
};

void ResolveBatchSizes(Config& c, int world_size, RuleChecker& check) {
  auto& train = c.train_batch_size;
  auto& micro = c.train_micro_batch_size_per_gpu;
  auto& accumulation = c.gradient_accumulation_steps;
  bool ok = true;
  for (const auto& [value, name] :
       {std::pair{train, "train_batch_size"}, std::pair{micro, "train_micro_batch_size_per_gpu"},
        std::pair{accumulation, "gradient_accumulation_steps"}}) {
    if (value.has_value() && *value <= 0) {
      check.Require(false, name, StrCat("must be > 0, got ", *value));
      ok = false;
    }
  }
  if (!ok) return;
  const int64_t ws = world_size;
  // The products below must not wrap: a wrapped product could "match" (2^62 + 1 times 4).
  int64_t probe;
  if ((micro && __builtin_mul_overflow(*micro, ws, &probe)) ||
      (accumulation && __builtin_mul_overflow(*accumulation, ws, &probe)) ||
      (micro && accumulation &&
       (__builtin_mul_overflow(*micro, *accumulation, &probe) ||
        __builtin_mul_overflow(probe, ws, &probe)))) {
    check.Require(false, "train_micro_batch_size_per_gpu",
                  StrCat("train_micro_batch_size_per_gpu (", micro.value_or(1),
                         ") x gradient_accumulation_steps (", accumulation.value_or(1),
                         ") x world size (", ws, ") overflows a 64-bit count"));
    return;
  }
  if (train && micro && accumulation) {
    const int64_t product = *micro * *accumulation * ws;
    check.Require(*train == product, "train_batch_size",
                  StrCat(*train, " != train_micro_batch_size_per_gpu (", *micro,
                         ") x gradient_accumulation_steps (", *accumulation, ") x world size (", ws,
                         ") = ", product));
  } else if (train && micro) {
    const int64_t per_step = *micro * ws;
    check.Require(*train % per_step == 0, "train_batch_size",
                  StrCat(*train, " is not divisible by train_micro_batch_size_per_gpu (", *micro,
                         ") x world size (", ws, ") = ", per_step));
    if (*train % per_step == 0) accumulation = *train / per_step;
  } else if (train && accumulation) {
    const int64_t per_micro = *accumulation * ws;
    check.Require(*train % per_micro == 0, "train_batch_size",
                  StrCat(*train, " is not divisible by gradient_accumulation_steps (",
                         *accumulation, ") x world size (", ws, ") = ", per_micro));
    if (*train % per_micro == 0) micro = *train / per_micro;
  } else if (micro && accumulation) {
    train = *micro * *accumulation * ws;
  } else if (train) {
    accumulation = 1;
    check.Require(*train % ws == 0, "train_batch_size",
                  StrCat(*train, " is not divisible by world size (", ws, ")"));
    if (*train % ws == 0) micro = *train / ws;
  } else if (micro) {
    accumulation = 1;
    train = *micro * ws;
  } else if (!accumulation) {
    accumulation = 1;  // The training loop owns the batch; only accumulation matters here.
  }
}

void CheckRules(Config& c, int world_size, RuleChecker& check) {
  check.Require(world_size >= 1, "(world size)", StrCat("must be >= 1, got ", world_size));
  if (world_size >= 1) ResolveBatchSizes(c, world_size, check);
  check.NonNegative(c.gradient_clipping, "gradient_clipping");

  const OptimizerParams& p = c.optimizer.params;
  for (const std::string& problem : HyperparameterProblems(ParamGroup::FromConfig(c.optimizer))) {
    check.Add(StrCat("optimizer.params.", problem));
  }
  check.Require(!(c.optimizer.type == OptimizerType::kAdamW && !p.adam_w_mode),
                "optimizer.params.adam_w_mode",
                "false contradicts type AdamW (decoupled weight decay); use type Adam");
  check.Require(c.zoffload.optimizer_state != StatePrecision::kInt8 ||
                    c.optimizer.type == OptimizerType::kAdam ||
                    c.optimizer.type == OptimizerType::kAdamW,
                "zoffload.optimizer_state",
                StrCat("int8 state is for Adam and AdamW only, not ", ToString(c.optimizer.type)));

  const Overlap overlap = c.zoffload.overlap;
  if (overlap == Overlap::kBackward || overlap == Overlap::kDelayed) {
    const std::string mode = StrCat("\"", ToString(overlap), "\"");
    check.Require(!(overlap == Overlap::kDelayed && c.fp16.enabled), "zoffload.overlap",
                  "\"delayed\" cannot be combined with fp16.enabled: the loss scale's overflow "
                  "check must see every gradient before the next step's loss; use bf16, or "
                  "overlap \"none\" or \"backward\"");
    check.Require(c.zero_optimization.offload_optimizer.device != OffloadDevice::kNvme,
                  "zoffload.overlap",
                  StrCat(mode,
                         " needs the optimizer state in host memory "
                         "(zero_optimization.offload_optimizer.device \"cpu\"), not nvme"));
    check.Require(!(overlap == Overlap::kDelayed &&
                    c.zero_optimization.offload_param.device != OffloadDevice::kNone),
                  "zoffload.overlap",
                  "\"delayed\" cannot be combined with zero_optimization.offload_param: the "
                  "update would write the parameter values being fetched for the next step; use "
                  "overlap \"none\" or \"backward\"");
  }
  check.NonNegative(c.zoffload.delayed_warmup_steps, "zoffload.delayed_warmup_steps");
  check.Positive(c.zoffload.comm_timeout_seconds, "zoffload.comm_timeout_seconds");

  check.Require(!(c.fp16.enabled && c.bf16.enabled), "fp16.enabled",
                "fp16 and bf16 cannot both be enabled");
  check.NonNegative(c.fp16.loss_scale, "fp16.loss_scale");
  check.Require(c.fp16.initial_scale_power >= 0 && c.fp16.initial_scale_power <= 63,
                "fp16.initial_scale_power",
                StrCat("must be in [0, 63], got ", c.fp16.initial_scale_power));
  check.Positive(c.fp16.loss_scale_window, "fp16.loss_scale_window");
  check.Positive(c.fp16.hysteresis, "fp16.hysteresis");
  check.Positive(c.fp16.min_loss_scale, "fp16.min_loss_scale");

  const ZeroConfig& z = c.zero_optimization;
  check.Require(z.stage >= 0 && z.stage <= 3, "zero_optimization.stage",
                StrCat("must be 0, 1, 2 or 3, got ", z.stage));
  check.Positive(z.reduce_bucket_size, "zero_optimization.reduce_bucket_size");
  check.Positive(z.allgather_bucket_size, "zero_optimization.allgather_bucket_size");
  check.NonNegative(z.stage3_prefetch_bucket_size, "zero_optimization.stage3_prefetch_bucket_size");
  check.NonNegative(z.stage3_param_persistence_threshold,
                    "zero_optimization.stage3_param_persistence_threshold");
  check.Positive(z.stage3_max_live_parameters, "zero_optimization.stage3_max_live_parameters");
  check.NonNegative(z.stage3_max_reuse_distance, "zero_optimization.stage3_max_reuse_distance");

  const bool have_stripe = !c.zoffload.nvme_paths.empty();
  const OffloadOptimizerConfig& oo = z.offload_optimizer;
  if (oo.device != OffloadDevice::kNone) {
    check.Require(
        z.stage >= 1, "zero_optimization.offload_optimizer.device",
        StrCat("offloading the optimizer needs zero_optimization.stage >= 1, got ", z.stage));
  }
  check.Require(!(oo.device == OffloadDevice::kNvme && oo.nvme_path.empty() && !have_stripe),
                "zero_optimization.offload_optimizer.nvme_path",
                "device is \"nvme\" but no nvme_path (nor zoffload.nvme_paths) is given");
  check.Positive(oo.buffer_count, "zero_optimization.offload_optimizer.buffer_count");
  check.Require(oo.device != OffloadDevice::kNvme || oo.buffer_count >= kMinNvmeBuffers,
                "zero_optimization.offload_optimizer.buffer_count",
                StrCat("device \"nvme\" streams the state through at least ", kMinNvmeBuffers,
                       " buffers (one read while one is written), got ", oo.buffer_count));
  check.Require(oo.ratio > 0 && oo.ratio <= 1, "zero_optimization.offload_optimizer.ratio",
                StrCat("must be in (0, 1], got ", oo.ratio));
  check.Require(oo.ratio == 1.0 || oo.device != OffloadDevice::kNone,
                "zero_optimization.offload_optimizer.ratio",
                "a ratio below 1 needs offload_optimizer.device \"cpu\" or \"nvme\"");

  const OffloadParamConfig& op = z.offload_param;
  if (op.device != OffloadDevice::kNone) {
    check.Require(z.stage == 3, "zero_optimization.offload_param.device",
                  StrCat("offloading parameters needs zero_optimization.stage 3, got ", z.stage));
  }
  check.Require(!(op.device == OffloadDevice::kNvme && op.nvme_path.empty() && !have_stripe),
                "zero_optimization.offload_param.nvme_path",
                "device is \"nvme\" but no nvme_path (nor zoffload.nvme_paths) is given");
  check.Positive(op.buffer_count, "zero_optimization.offload_param.buffer_count");
  check.Positive(op.buffer_size, "zero_optimization.offload_param.buffer_size");
  check.Positive(op.max_in_cpu, "zero_optimization.offload_param.max_in_cpu");

  for (const std::string& problem : AioProblems(c.aio)) check.Add(problem);

  ZoffloadSection& zs = c.zoffload;
  check.Require(zs.cpu_adam_threads >= 0 && zs.cpu_adam_threads <= 4096,
                "zoffload.cpu_adam_threads",
                StrCat("must be in [0, 4096] (0 = physical cores), got ", zs.cpu_adam_threads));
  check.Require(zs.update_chunk_elements % kUpdateChunkMultiple == 0 &&
                    zs.update_chunk_elements <= (uint64_t{1} << 30),
                "zoffload.update_chunk_elements",
                StrCat("must be a multiple of ", kUpdateChunkMultiple,
                       " in [0, 2^30] (0 = by where the state lives and its precision), got ",
                       zs.update_chunk_elements));
  for (const auto& [dir, key] : {std::pair{&c.zero_optimization.offload_optimizer.nvme_path,
                                           "zero_optimization.offload_optimizer.nvme_path"},
                                 std::pair{&c.zero_optimization.offload_param.nvme_path,
                                           "zero_optimization.offload_param.nvme_path"}}) {
    check.Require(dir->find('\0') == std::string::npos, key, "contains a NUL byte");
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < zs.nvme_paths.size(); ++i) {
    std::string& dir = zs.nvme_paths[i];
    const std::string path = StrCat("zoffload.nvme_paths[", i, "]");
    check.Require(!dir.empty(), path, "must not be empty");
    check.Require(dir.find('\0') == std::string::npos, path, "contains a NUL byte");
    if (dir.empty()) continue;
    // "/a", "/a/" and "/a//." are one directory: compared, and kept, in one spelling.
    const std::string normal = NormalDirectory(dir);
    check.Require(seen.insert(normal).second, path,
                  StrCat("\"", dir, "\" is listed twice (as \"", normal, "\")"));
    dir = normal;
  }
  for (const auto& [value, name] : {std::pair{zs.budgets.gpu_bytes, "gpu_bytes"},
                                    std::pair{zs.budgets.pinned_host_bytes, "pinned_host_bytes"},
                                    std::pair{zs.budgets.host_bytes, "host_bytes"}}) {
    if (value.has_value()) check.Positive(*value, StrCat("zoffload.budgets.", name));
  }
}

}  // namespace

Status internal::ConfigErrors(const std::vector<std::string>& errors, const std::string& source) {
  if (errors.empty()) return Status::Ok();
  std::string message =
      StrCat(errors.size(), errors.size() == 1 ? " error" : " errors", " in ", source, ":");
  for (const std::string& e : errors) message += StrCat("\n", source, ": ", e);
  return InvalidArgumentError(std::move(message));
}

Overlap internal::ChosenOverlap(const Config& c, bool zero_partitioned) {
  if (zero_partitioned && c.zoffload.overlap == Overlap::kBackward) return Overlap::kNone;
  if (c.zoffload.overlap != Overlap::kAuto) return c.zoffload.overlap;
  const bool host_state = c.zero_optimization.offload_optimizer.device != OffloadDevice::kNvme;
  return host_state && !zero_partitioned ? Overlap::kBackward : Overlap::kNone;
}

void internal::CheckConfigRules(Config& config, int world_size, std::vector<std::string>* errors) {
  RuleChecker check(errors);
  CheckRules(config, world_size, check);
}

ParamGroup ParamGroup::FromConfig(const OptimizerConfig& optimizer) {
  const OptimizerParams& p = optimizer.params;
  return {p.lr, p.betas[0], p.betas[1], p.eps, p.weight_decay};
}

std::vector<std::string> HyperparameterProblems(const ParamGroup& g) {
  std::vector<std::string> problems;
  RuleChecker check(&problems);
  check.NonNegative(g.lr, "lr");
  for (const auto& [beta, name] : {std::pair{g.beta1, "beta1"}, std::pair{g.beta2, "beta2"}}) {
    check.Require(beta >= 0 && beta < 1, "betas", StrCat(name, " must be in [0, 1), got ", beta));
  }
  check.Positive(g.eps, "eps");
  check.NonNegative(g.weight_decay, "weight_decay");
  return problems;
}

std::vector<std::string> AioProblems(const AioConfig& aio) {
  std::vector<std::string> problems;
  RuleChecker check(&problems);
  check.Require(
      aio.block_size > 0 && aio.block_size % 4096 == 0 && aio.block_size <= kMaxAioBlockSize,
      "aio.block_size",
      StrCat("must be a positive multiple of 4096 bytes up to 1 GiB, got ", aio.block_size));
  check.Require(aio.queue_depth >= 1 && aio.queue_depth <= 4096, "aio.queue_depth",
                StrCat("must be in [1, 4096], got ", aio.queue_depth));
  check.Require(aio.intra_op_parallelism >= 1 && aio.intra_op_parallelism <= 256,
                "aio.intra_op_parallelism",
                StrCat("must be in [1, 256], got ", aio.intra_op_parallelism));
  return problems;
}

Status ValidateConfig(Config& config, int world_size) {
  std::vector<std::string> errors;
  internal::CheckConfigRules(config, world_size, &errors);
  return internal::ConfigErrors(errors, "config");
}

}  // namespace zoffload
