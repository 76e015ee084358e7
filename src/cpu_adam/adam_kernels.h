// The per-range SIMD kernels behind CpuAdam (dispatched with Highway) and their arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/trace.h"
#include "cpu_adam/adam_math.h"
#include "zoffload/cpu_adam.h"

namespace zoffload::internal {

/// Everything a kernel needs; pointers are the shard's (whole arrays, indexed by element).
struct AdamKernelArgs {
  float* p;
  const void* g;
  void* m;
  void* v;
  float* m_scales;  // int8 state: one per kInt8StateBlock elements
  float* v_scales;
  // Where the state is read from (AdamShard::params_from...; the same as p, m, v in place).
  const float* p_in;
  const void* m_in;
  const void* v_in;
  const float* m_scales_in;
  const float* v_scales_in;
  void* copy;
  DType grad_type;
  StatePrecision state;
  ParamCopy copy_type;
  UpdateRule rule;
  AdamCoefficients c;
  float grad_scale;
  uint32_t seed;          // stochastic rounding: derived from the step
  uint64_t index_offset;  // AdamShard::index_offset
  uint8_t ceiling_mask;   // bandwidth kernel: bits it XORs into the data (0: leaves it intact)
};

/// AdamUpdate that records each thread's share of the tiles as a span named `label` on
/// track "adam thread <k>" of `tracer` (when not null).
Status AdamUpdateTraced(const AdamShard& shard, const AdamHyper& hyper, float grad_scale,
                        int threads, Tracer* tracer, const std::string& label);

/// A pass moving the same bytes as AdamUpdate on the same shard, with trivial arithmetic: the
/// memory-bandwidth ceiling the benchmark compares the update with. It writes the shard.
void AdamBandwidthCeiling(const AdamShard& shard, int threads = 0,
                          UpdateRule rule = UpdateRule::kAdam);

/// Process-wide: whether CPU Adam's worker k (of every parallel pass) runs bound to physical
/// core k modulo the cores (hwloc), or where the OS puts it. The calling thread, worker 0, is
/// never bound. Default off; config zoffload.cpu_adam_bind_cores (the trainers set it).
void SetCpuAdamCoreBinding(bool bind);

/// Updates elements [begin, end). For int8 state, begin is a multiple of kInt8StateBlock.
void AdamRange(const AdamKernelArgs& args, size_t begin, size_t end);
/// Moves the same bytes as AdamRange over [begin, end) with trivial arithmetic.
void BandwidthRange(const AdamKernelArgs& args, size_t begin, size_t end);
/// Sum of squares of grads [begin, end) (float64 across chunks); sets *finite to false on
/// inf/NaN.
double GradSumSquares(const void* grads, DType type, size_t begin, size_t end, bool* finite);

}  // namespace zoffload::internal
