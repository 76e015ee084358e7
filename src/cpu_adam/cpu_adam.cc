#include "zoffload/cpu_adam.h"

#include <omp.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/cpu_features.h"
#include "common/log.h"
#include "common/strings.h"
#include "common/topology.h"
#include "cpu_adam/adam_kernels.h"

namespace zoffload {

using internal::BestSimdTarget;
using internal::LogLevel;
using internal::LogOnce;
using internal::StrCat;
using internal::Topology;
using internal::Tracer;

namespace internal {

AdamCoefficients MakeAdamCoefficients(const AdamHyper& h) {
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  const bool adam = h.rule == UpdateRule::kAdam;
  AdamCoefficients c{};
  c.beta1 = h.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = h.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.step_size = adam ? static_cast<float>(h.lr / bc1) : h.lr;
  c.inv_sqrt_bc2 = adam ? static_cast<float>(1.0 / std::sqrt(bc2)) : 1.0f;
  c.eps = h.eps;
  c.l2 = h.decoupled_weight_decay ? 0.0f : h.weight_decay;
  c.decay = h.decoupled_weight_decay
                ? static_cast<float>(1.0 - static_cast<double>(h.lr) * h.weight_decay)
                : 1.0f;
  return c;
}

}  // namespace internal

namespace {

// Elements per OpenMP work item: large enough to amortize scheduling, small enough to
// balance 16+ threads on 10M-element shards. A multiple of kInt8StateBlock and of every
// vector length, so tiles never split a block or a vector.
constexpr size_t kTile = 16384;
constexpr size_t kMinTile = 4096;

// The tile of an element-wise pass (whose results do not depend on where tiles start) over n
// elements with `threads`: about kTile, so that the tiles come out to a multiple of the thread
// count. With fixed tiles a 4M-element chunk is 256 tiles: of 15 threads one took 18 while the
// other 14 took 17 and then waited, 5 % of every chunk's pass.
size_t BalancedTile(size_t n, int threads) {
  const size_t round = static_cast<size_t>(threads) * kTile;
  const size_t tiles = static_cast<size_t>(threads) * std::max<size_t>(1, (n + round - 1) / round);
  return std::max(kMinTile, internal::RoundUp((n + tiles - 1) / tiles, kInt8StateBlock));
}

int Threads(int requested) { return requested > 0 ? requested : DefaultAdamThreads(); }

// The machine, loaded once for the thread count and core binding (null if hwloc fails).
const Topology* AdamTopology() {
  static const std::unique_ptr<Topology> topology = []() -> std::unique_ptr<Topology> {
    auto t = Topology::Load();
    if (!t.ok()) {
      LogOnce(LogLevel::kWarning, "adam-topology",
              StrCat("CPU Adam: ", t.status().message(), "; threads are not bound to cores"));
      return nullptr;
    }
    return std::make_unique<Topology>(std::move(*t));
  }();
  return topology.get();
}

std::atomic<bool> bind_cores{false};

// Worker k of a parallel region runs on physical core k (modulo the cores) while binding is
// on. The calling thread (k = 0) is the caller's and keeps its own placement.
void PlaceThread(int k) {
  thread_local int bound = -1;  // the core this worker is bound to, -1 if none
  const int want = bind_cores.load(std::memory_order_relaxed) ? k : -1;
  if (k == 0 || want == bound) return;
  const Topology* topology = AdamTopology();
  if (topology == nullptr) return;
  if (Status s = topology->BindThisThreadToCore(want); !s.ok()) {
    LogOnce(LogLevel::kWarning, "adam-bind", StrCat("CPU Adam: ", s.message()));
    return;
  }
  bound = want;
}

internal::AdamKernelArgs MakeArgs(const AdamShard& s, const AdamHyper& h, float grad_scale) {
  internal::AdamKernelArgs a{};
  a.p = s.params;
  a.g = s.grads;
  a.m = s.m;
  a.v = s.v;
  a.p_in = s.params_from != nullptr ? s.params_from : s.params;
  a.m_in = s.m_from != nullptr ? s.m_from : s.m;
  a.v_in = s.v_from != nullptr ? s.v_from : s.v;
  if (s.state == StatePrecision::kInt8) {
    const size_t codes = (s.n + 3) & ~size_t{3};  // the scales follow the codes, aligned
    a.m_scales = reinterpret_cast<float*>(static_cast<int8_t*>(s.m) + codes);
    a.v_scales = reinterpret_cast<float*>(static_cast<uint8_t*>(s.v) + codes);
    a.m_scales_in = reinterpret_cast<const float*>(static_cast<const int8_t*>(a.m_in) + codes);
    a.v_scales_in = reinterpret_cast<const float*>(static_cast<const uint8_t*>(a.v_in) + codes);
  }
  a.copy = s.param_copy;
  a.grad_type = s.grad_dtype;
  a.state = s.state;
  a.copy_type = s.copy;
  a.rule = h.rule;
  a.c = internal::MakeAdamCoefficients(h);
  a.grad_scale = grad_scale;
  a.seed = static_cast<uint32_t>(h.step) * 0x9E3779B9u + 0x7F4A7C15u;
  a.index_offset = s.index_offset;
  return a;
}

Status CheckShard(const AdamShard& s, const AdamHyper& h) {
  if (s.n == 0) return Status::Ok();
  const bool uses_m = h.rule != UpdateRule::kAdagrad, uses_v = h.rule != UpdateRule::kLion;
  if (s.params == nullptr || s.grads == nullptr || (uses_m && s.m == nullptr) ||
      (uses_v && s.v == nullptr)) {
    return InvalidArgumentError(StrCat("AdamUpdate: params, grads", uses_m ? ", m" : "",
                                       uses_v ? ", v" : "", " must be set (", ToString(h.rule),
                                       ")"));
  }
  if (s.state == StatePrecision::kInt8 && h.rule != UpdateRule::kAdam) {
    return InvalidArgumentError(
        StrCat("AdamUpdate: int8 state is for Adam only, not ", ToString(h.rule)));
  }
  if (s.copy != ParamCopy::kNone && s.param_copy == nullptr) {
    return InvalidArgumentError("AdamUpdate: copy requested but param_copy is null");
  }
  if (h.step < 1)
    return InvalidArgumentError(StrCat("AdamUpdate: step must be >= 1, got ", h.step));
  if (s.state == StatePrecision::kInt8 && s.index_offset % kInt8StateBlock != 0) {
    return InvalidArgumentError(StrCat("AdamUpdate: index_offset ", s.index_offset,
                                       " of an int8-state shard is not a multiple of ",
                                       kInt8StateBlock));
  }
  if (h.rule != UpdateRule::kAdagrad &&
      !(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1)) {
    return InvalidArgumentError(
        StrCat("AdamUpdate: betas must be in [0, 1), got ", h.beta1, ", ", h.beta2));
  }
  if (h.rule != UpdateRule::kLion && !(h.eps > 0)) {
    return InvalidArgumentError(StrCat("AdamUpdate: eps must be > 0, got ", h.eps));
  }
  return Status::Ok();
}

// Denormal inputs cost microcode assists of ~100 cycles each on Intel cores; moments of
// parameters whose gradients stay zero decay into that range (m after ~800 steps). Passes run
// with flush-to-zero and denormals-are-zero, restored afterwards. Values below 1.2e-38 are
// treated as 0, which changes nothing measurable in an update.
class FlushDenormals {
 public:
#if defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Runs body(begin, end) over the tiles of [0, n) (`tile` elements each, the last one
// shorter); with `tracer`, each thread's share is a span
// named `label` on its track. Tiles are handed out one at a time (dynamic schedule): in an
// overlapped step the training thread and the CUDA driver's threads share the cores, and with a
// static split one preempted thread held back the whole pass (measured on the H200: Adam took
// 1.64-1.72 s inside a 7B step against 1.44 s alone). Results do not depend on which thread runs
// a tile: every kernel, stochastic rounding included, is a function of the element index.
template <typename F>
void ForTiles(size_t n, size_t tile, int threads, F&& body, Tracer* tracer = nullptr,
              const std::string* label = nullptr) {
  const auto tiles = static_cast<int64_t>((n + tile - 1) / tile);
  // One tile (a norm's weights) runs on the calling thread: no team to wake and join.
#pragma omp parallel num_threads(threads) if (tiles > 1)
  {
    PlaceThread(omp_get_thread_num());
    const FlushDenormals flush;
    const auto start = tracer != nullptr ? Tracer::Clock::now() : Tracer::Clock::time_point();
    size_t elements = 0;
    int64_t taken = 0;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t t = 0; t < tiles; ++t) {
      const size_t begin = static_cast<size_t>(t) * tile;
      const size_t end = std::min(n, begin + tile);
      body(begin, end);
      elements += end - begin;
      ++taken;
    }
    if (tracer != nullptr && taken > 0) {
      tracer->Record(StrCat("adam thread ", omp_get_thread_num()), *label, start,
                     Tracer::Clock::now(), StrCat(elements, " elements in ", taken, " tiles"));
    }
  }
}

}  // namespace

std::string_view ToString(UpdateRule rule) {
  switch (rule) {
    case UpdateRule::kAdam:
      return "adam";
    case UpdateRule::kAdagrad:
      return "adagrad";
    case UpdateRule::kLion:
      break;
  }
  return "lion";
}

AdamHyper HyperFromConfig(const OptimizerConfig& optimizer) {
  AdamHyper h;
  switch (optimizer.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      h.rule = UpdateRule::kAdam;
      break;
    case OptimizerType::kAdagrad:
      h.rule = UpdateRule::kAdagrad;
      break;
    case OptimizerType::kLion:
      h.rule = UpdateRule::kLion;
      break;
  }
  const OptimizerParams& p = optimizer.params;
  h.lr = static_cast<float>(p.lr);
  h.beta1 = static_cast<float>(p.betas[0]);
  h.beta2 = static_cast<float>(p.betas[1]);
  h.eps = static_cast<float>(p.eps);
  h.weight_decay = static_cast<float>(p.weight_decay);
  h.decoupled_weight_decay = optimizer.decoupled_weight_decay();
  return h;
}

std::string_view ToString(ParamCopy copy) {
  switch (copy) {
    case ParamCopy::kNone:
      return "none";
    case ParamCopy::kBf16:
      return "bf16";
    case ParamCopy::kFp16:
      return "fp16";
  }
  return "?";
}

int DefaultAdamThreads() {
  const Topology* topology = AdamTopology();
  return topology != nullptr ? std::max(1, topology->PhysicalCores()) : omp_get_num_procs();
}

void internal::SetCpuAdamCoreBinding(bool bind) {
  bind_cores.store(bind, std::memory_order_relaxed);
}

std::string CpuAdamTarget() { return BestSimdTarget(); }

GradSquares GradientSquares(const AdamShard& s, int threads) {
  // Per-tile partial sums of fixed tiles, added in tile order: the same result for any
  // thread count.
  const size_t tiles = (s.n + kTile - 1) / kTile;
  std::vector<double> partial(tiles, 0.0);
  std::vector<char> finite(tiles, 1);
  ForTiles(s.n, kTile, Threads(threads), [&](size_t begin, size_t end) {
    bool ok = true;
    partial[begin / kTile] = internal::GradSumSquares(s.grads, s.grad_dtype, begin, end, &ok);
    finite[begin / kTile] = ok ? 1 : 0;
  });
  GradSquares out;
  for (size_t t = 0; t < tiles; ++t) {
    out.sum += partial[t];
    out.finite = out.finite && finite[t] != 0;
  }
  return out;
}

GradNorm NormOf(std::span<const GradSquares> squares) {
  GradNorm out;
  double total = 0;
  for (const GradSquares& s : squares) {
    total += s.sum;
    out.finite = out.finite && s.finite;
  }
  out.l2 = std::sqrt(total);
  if (!std::isfinite(out.l2)) out.finite = false;
  return out;
}

GradNorm GradientNorm(std::span<const AdamShard> shards, int threads) {
  std::vector<GradSquares> squares;
  squares.reserve(shards.size());
  for (const AdamShard& s : shards) squares.push_back(GradientSquares(s, threads));
  return NormOf(squares);
}

Status internal::AdamUpdateTraced(const AdamShard& shard, const AdamHyper& hyper, float grad_scale,
                                  int threads, Tracer* tracer, const std::string& label) {
  ZO_RETURN_IF_ERROR(CheckShard(shard, hyper));
  if (shard.n == 0) return Status::Ok();
  const internal::AdamKernelArgs args = MakeArgs(shard, hyper, grad_scale);
  if (shard.state == StatePrecision::kInt8) {  // the bytes between codes and scales too
    for (const auto& [to, from] : {std::pair{shard.m, args.m_in}, {shard.v, args.v_in}}) {
      if (to == from) continue;
      std::memcpy(static_cast<char*>(to) + shard.n, static_cast<const char*>(from) + shard.n,
                  ((shard.n + 3) & ~size_t{3}) - shard.n);
    }
  }
  const int team = Threads(threads);
  ForTiles(
      shard.n, BalancedTile(shard.n, team), team,
      [&](size_t begin, size_t end) { internal::AdamRange(args, begin, end); }, tracer, &label);
  return Status::Ok();
}

Status AdamUpdate(const AdamShard& shard, const AdamHyper& hyper, float grad_scale, int threads) {
  return internal::AdamUpdateTraced(shard, hyper, grad_scale, threads, nullptr, {});
}

void internal::AdamBandwidthCeiling(const AdamShard& shard, int threads, UpdateRule rule) {
  AdamHyper hyper;
  hyper.rule = rule;
  const internal::AdamKernelArgs args = MakeArgs(shard, hyper, 1.0f);
  const int team = Threads(threads);
  ForTiles(shard.n, BalancedTile(shard.n, team), team,
           [&](size_t begin, size_t end) { internal::BandwidthRange(args, begin, end); });
}

Result<AdamStepResult> AdamStep(std::span<const AdamShard> shards, const AdamHyper& hyper,
                                float loss_scale, float max_grad_norm, int threads) {
  if (!(loss_scale > 0))
    return InvalidArgumentError(StrCat("AdamStep: loss_scale must be > 0, got ", loss_scale));
  for (const AdamShard& s : shards) ZO_RETURN_IF_ERROR(CheckShard(s, hyper));
  AdamStepResult result;
  const GradNorm norm = GradientNorm(shards, threads);
  if (!norm.finite) {
    result.skipped = true;  // overflow: nothing is written
    result.grad_norm = internal::NonfiniteNorm(norm.l2);
    return result;
  }
  const float grad_scale = internal::ClipAndUnscale(norm.l2, loss_scale, max_grad_norm,
                                                    &result.grad_norm, &result.clip_coef);
  for (const AdamShard& s : shards) ZO_RETURN_IF_ERROR(AdamUpdate(s, hyper, grad_scale, threads));
  return result;
}

}  // namespace zoffload
