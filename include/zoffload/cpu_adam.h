// CPU Adam/AdamW on host-resident shards: SIMD (Highway, runtime dispatch) + OpenMP. The same
// skeleton runs Adagrad and Lion (AdamHyper::rule).
//
// A shard is fp32 master parameters with their Adam moments in fp32, bf16 (stochastic
// rounding) or 8-bit block-wise quantized form (docs/cpu_adam.md describes the code), and
// gradients in fp32, bf16 or fp16. One pass reads the gradients and state, updates them, and
// can write a bf16/fp16 copy of the new parameters into a caller-given (pinned) buffer.
//
// A step: GradientNorm (one fast pass, float64 accumulation, also the inf/NaN check) gives the
// global norm; on overflow the step is skipped and nothing is written; otherwise the clip
// coefficient and 1/loss_scale are folded into one gradient scale applied inside the update.
//
// Results are identical for any thread count: work is split into fixed tiles and every
// element's arithmetic (and its stochastic-rounding bits) depends only on its index.
//
// Thread-safety: the functions are reentrant; concurrent calls share the machine's cores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "zoffload/config.h"
#include "zoffload/dtype.h"
#include "zoffload/export.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

/// The optional low-precision copy of the updated parameters.
enum class ParamCopy : uint8_t { kNone, kBf16, kFp16 };

std::string_view ToString(ParamCopy copy);

/// Elements per quantization block of the int8 state (one fp32 scale per block per moment).
inline constexpr size_t kInt8StateBlock = 256;
static_assert(kUpdateChunkMultiple % kInt8StateBlock == 0, "update chunks hold whole blocks");

/// Bytes of m and v storage (each) for `n` elements at `precision`, scales included.
size_t AdamMomentBytes(StatePrecision precision, size_t n);

/// One shard's memory; nothing is owned.
struct AdamShard {
  float* params = nullptr;  ///< fp32 master parameters, updated in place
  size_t n = 0;
  StatePrecision state = StatePrecision::kFp32;
  /// fp32: float[n]; bf16: uint16_t[n] (bf16 bits); int8: int8_t[n] followed by
  /// float[ceil(n/256)] scales (use AdamMomentBytes to size it).
  void* m = nullptr;
  /// As m; int8: uint8_t[n] (quantized sqrt(v)) followed by float scales.
  void* v = nullptr;
  const void* grads = nullptr;
  DType grad_dtype = DType::kFp32;
  /// bf16 bits or fp16 values, n of them, when copy != kNone. May be `grads` itself when
  /// those are 2-byte gradients: each element's gradient is read before its copy is written.
  void* param_copy = nullptr;
  ParamCopy copy = ParamCopy::kNone;
  /// Index of params[0] within its whole tensor, when the shard is a piece of one (a
  /// multiple of kInt8StateBlock for int8 state). Stochastic rounding draws its bits from
  /// whole-tensor indices, so a tensor updated piece by piece gets the bits it would get in
  /// one piece.
  uint64_t index_offset = 0;
  /// Where the update reads the state from when not from where it writes it (params, m, v):
  /// the same layouts, not overlapping those; null: in place. Every byte of params, m and v
  /// (AdamMomentBytes of them) is written, so they may hold anything before.
  const float* params_from = nullptr;
  const void* m_from = nullptr;
  const void* v_from = nullptr;
};

/// The update rule of a step. Per element, with g the scaled gradient (plus weight_decay * p
/// when the decay is coupled) and p first multiplied by 1 - lr * weight_decay when decoupled:
enum class UpdateRule : uint8_t {
  /// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  /// p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  kAdam,
  /// v += g^2; p -= lr * g / (sqrt(v) + eps). m is not used (may be null); betas ignored.
  kAdagrad,
  /// p -= lr * sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g. v is not used (may be null);
  /// eps ignored.
  kLion,
};
std::string_view ToString(UpdateRule rule);

/// Hyperparameters of one step (the caller owns the schedule).
struct AdamHyper {
  UpdateRule rule = UpdateRule::kAdam;  ///< int8 state: Adam only
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = true;  ///< AdamW (true) or L2-coupled Adam (false)
  int64_t step = 1;                    ///< 1 for the first update (bias correction)
};

/// The rule and hyperparameters of a config's optimizer section (step 1; lr as configured).
AdamHyper HyperFromConfig(const OptimizerConfig& optimizer);

struct GradNorm {
  double l2 = 0;       ///< sqrt of the sum of squares (of the raw gradients)
  bool finite = true;  ///< false if any gradient is inf or NaN
};

/// One shard's float64 sum of squared gradients and inf/NaN check.
struct GradSquares {
  double sum = 0;
  bool finite = true;
};
GradSquares GradientSquares(const AdamShard& shard, int threads = 0);

/// The global L2 norm over shards' gradients, float64 accumulation, and inf/NaN check: the
/// square root of the shards' GradientSquares added in shard order (so a caller that has them
/// per shard gets the same bits from NormOf).
GradNorm GradientNorm(std::span<const AdamShard> shards, int threads = 0);
/// The norm of shards whose GradientSquares are `squares`, in shard order.
GradNorm NormOf(std::span<const GradSquares> squares);

/// The update pass alone: gradients are multiplied by `grad_scale` (1/loss_scale times the
/// clip coefficient). Grads must be finite (GradientNorm checks). `threads` 0 = CpuAdam default.
Status AdamUpdate(const AdamShard& shard, const AdamHyper& hyper, float grad_scale,
                  int threads = 0);

/// The SIMD target the kernels dispatch to on this CPU ("AVX3_DL", "AVX2", ...).
std::string CpuAdamTarget();

/// Physical cores (hwloc), the default thread count.
int DefaultAdamThreads();

struct AdamStepResult {
  bool skipped = false;  ///< overflow: nothing was written
  double grad_norm = 0;  ///< of the unscaled gradients (raw norm / loss_scale)
  float clip_coef = 1;   ///< applied to the unscaled gradients
};

/// A whole optimizer step over shards: norm pass, overflow skip, clipping, update.
/// `loss_scale` is the fp16 loss scale (1 without one); `max_grad_norm` 0 disables clipping.
Result<AdamStepResult> AdamStep(std::span<const AdamShard> shards, const AdamHyper& hyper,
                                float loss_scale = 1.0f, float max_grad_norm = 0.0f,
                                int threads = 0);

}  // namespace zoffload
ZO_API_END
