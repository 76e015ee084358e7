// Adam kernels for every Highway target compiled in; HWY_DYNAMIC_DISPATCH picks the best
// the CPU supports. Each kernel is one template over (gradient type, state precision, copy
// type); a small switch selects the instantiation.
//
// 1. Loads and stores go through helpers that convert to and from fp32 lanes: bf16 by bit
//    shifts (exact on load; round-to-nearest-even or stochastic on store), fp16 by Highway's
//    promote/demote, int8 state through per-block scales.
// 2. Stochastic rounding takes its random bits from a hash of (seed, element index), so the
//    result does not depend on threads or tiling.
// 3. Tails (fewer elements than a vector, or than an int8 block) are copied into zero-padded
//    local arrays and run through the same vector code, so every element gets the same
//    arithmetic wherever it sits.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_adam/adam_kernels.cc"
#include <hwy/cache_control.h>
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu_adam/adam_kernels.h"

HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
// Highway 1.0's AVX3_DL requires AVX512-VNNI at run time but names only the VEX form (avxvnni)
// in its compile flags; AddRandomWord uses the 512-bit form.
#pragma GCC target("avx512vnni")
#endif
namespace zoffload::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using VU32 = hn::Vec<DU32>;

// ---- element conversions ----------------------------------------------------------------

HWY_INLINE VF LoadBf16(DF df, const uint16_t* p) {
  const hn::Rebind<uint16_t, DF> d16;
  const DU32 du;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
}

// bf16 bits of v: round to nearest even, or stochastically when `random` is given.
HWY_INLINE void StoreBf16(DF df, VF v, uint16_t* p, const VU32* random) {
  const DU32 du;
  const DI32 di;
  const hn::Rebind<uint16_t, DF> d16;
  const VU32 bits = hn::BitCast(du, v);
  VU32 out;
  if (random != nullptr) {
    // Moments are finite (gradients were checked), so no NaN handling is needed here.
    out = hn::Add(bits, hn::And(*random, hn::Set(du, 0xFFFFu)));
  } else {
    const VU32 lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
    const VU32 rounded = hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb));
    // A NaN parameter stays a (quiet) NaN in the copy.
    out = hn::IfThenElse(hn::RebindMask(du, hn::Ne(v, v)), hn::Set(du, 0x7FC00000u), rounded);
  }
  // The shifted value fits 16 bits, so the saturating demote is exact.
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, hn::ShiftRight<16>(out))), d16, p);
  (void)df;
}

HWY_INLINE VF LoadF16(DF df, const hwy::float16_t* p) {
  const hn::Rebind<hwy::float16_t, DF> d16;
  return hn::PromoteTo(df, hn::LoadU(d16, p));
}

// fp16 with round-to-nearest-even on every target (Highway's emulated demote truncates):
// normal results by integer rounding of the fp32 bits, subnormal ones by letting an fp32
// add round at 2^-24, overflow to inf, NaN kept.
HWY_INLINE void StoreF16(DF df, VF v, hwy::float16_t* p) {
  const DU32 du;
  const DI32 di;
  const hn::Rebind<uint16_t, DF> d16;
  const VU32 bits = hn::BitCast(du, v);
  const VU32 sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  const VU32 mag = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  const VU32 lsb = hn::And(hn::ShiftRight<13>(mag), hn::Set(du, 1u));
  const VU32 normal = hn::Sub(hn::ShiftRight<13>(hn::Add(mag, hn::Add(hn::Set(du, 0xFFFu), lsb))),
                              hn::Set(du, (127u - 15u) << 10));
  const VF half = hn::Set(df, 0.5f);
  const VU32 subnormal =
      hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, mag), half)), hn::BitCast(du, half));
  const auto mag_i = hn::BitCast(di, mag);
  VU32 out =
      hn::IfThenElse(hn::RebindMask(du, hn::Gt(hn::Set(di, 0x38800000), mag_i)), subnormal, normal);
  out = hn::IfThenElse(hn::RebindMask(du, hn::Gt(mag_i, hn::Set(di, 0x477FEFFF))),
                       hn::Set(du, 0x7C00u), out);
  out = hn::IfThenElse(hn::RebindMask(du, hn::Gt(mag_i, hn::Set(di, 0x7F800000))),
                       hn::Set(du, 0x7E00u), out);
  out = hn::Or(out, sign);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, out)), d16, reinterpret_cast<uint16_t*>(p));
}

template <DType kType>
HWY_INLINE VF LoadGrad(DF df, const void* g, size_t i) {
  if constexpr (kType == DType::kFp32) {
    return hn::LoadU(df, static_cast<const float*>(g) + i);
  } else if constexpr (kType == DType::kBf16) {
    return LoadBf16(df, static_cast<const uint16_t*>(g) + i);
  } else {
    return LoadF16(df, static_cast<const hwy::float16_t*>(g) + i);
  }
}

template <ParamCopy kCopy>
HWY_INLINE void StoreCopy(DF df, VF p, void* copy, size_t i) {
  if constexpr (kCopy == ParamCopy::kBf16) {
    StoreBf16(df, p, static_cast<uint16_t*>(copy) + i, nullptr);
  } else if constexpr (kCopy == ParamCopy::kFp16) {
    StoreF16(df, p, static_cast<hwy::float16_t*>(copy) + i);
  }
}

// 32 random bits per lane from (seed, element index): a murmur3-style finalizer. `lanes` is
// Iota(du, 0), computed once by the caller (Highway's Iota is a scalar loop).
HWY_INLINE VU32 RandomBits(DU32 du, VU32 lanes, uint32_t seed, size_t index) {
  VU32 x = hn::Add(lanes, hn::Set(du, static_cast<uint32_t>(index) + seed));
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  x = hn::Mul(x, hn::Set(du, 0x85EBCA6Bu));
  x = hn::Xor(x, hn::ShiftRight<13>(x));
  x = hn::Mul(x, hn::Set(du, 0xC2B2AE35u));
  return hn::Xor(x, hn::ShiftRight<16>(x));
}

#if HWY_TARGET == HWY_AVX3_DL
// The round key of the AES-round generators below (any constant mixes; this is 2^32 / phi).
HWY_INLINE __m512i AesKey() { return _mm512_set1_epi32(static_cast<int>(0x9E3779B9u)); }
#endif

// Random bits for the bf16 state's stochastic rounding, a function of (seed, element index)
// only: Next() returns those of the next N elements, starting at element `first`.
#if HWY_TARGET == HWY_AVX3_DL
// With VAES: two AES rounds over the aligned group of 16 indices holding an element (each round
// one instruction for 16 lanes, against two 32-bit multiplies and six more operations for the
// hash); a range that starts inside a group takes its lanes from two groups by one permutation.
class ElementRandom {
 public:
  ElementRandom(VU32 lanes, uint32_t seed, uint64_t first)
      : lanes_(lanes.raw),
        seed_(seed),
        group_(static_cast<uint32_t>(first & ~uint64_t{15})),
        shift_(static_cast<uint32_t>(first & 15)),
        select_(_mm512_add_epi32(lanes.raw, _mm512_set1_epi32(static_cast<int>(shift_)))),
        low_(Group(group_)) {}

  VU32 Next() {
    group_ += 16;
    if (shift_ == 0) {
      const __m512i r = low_;
      low_ = Group(group_);
      return VU32{r};
    }
    const __m512i high = Group(group_);
    const __m512i r = _mm512_permutex2var_epi32(low_, select_, high);
    low_ = high;
    return VU32{r};
  }

 private:
  __m512i Group(uint32_t first) const {
    const __m512i x = _mm512_add_epi32(lanes_, _mm512_set1_epi32(static_cast<int>(first + seed_)));
    return _mm512_aesenc_epi128(_mm512_aesenc_epi128(x, AesKey()), AesKey());
  }

  __m512i lanes_;
  uint32_t seed_, group_, shift_;
  __m512i select_, low_;
};
#else
// Elsewhere: the murmur-style hash of each element's index.
class ElementRandom {
 public:
  ElementRandom(VU32 lanes, uint32_t seed, uint64_t first)
      : lanes_(lanes), seed_(seed), next_(first) {}

  VU32 Next() {
    const VU32 r = RandomBits(DU32(), lanes_, seed_, next_);
    next_ += hn::Lanes(DU32());
    return r;
  }

 private:
  VU32 lanes_;
  uint32_t seed_;
  uint64_t next_;
};
#endif

// 1/sqrt(x) and 1/x to at least 12 bits: the hardware estimates where the target has them,
// exact operations on the scalar and EMU128 targets (whose estimates are coarser).
HWY_INLINE VF RsqrtEstimate(DF df, VF x) {
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
  return hn::Div(hn::Set(df, 1.0f), hn::Sqrt(x));
#else
  (void)df;
  return hn::ApproximateReciprocalSqrt(x);
#endif
}
HWY_INLINE VF RcpEstimate(DF df, VF x) {
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
  return hn::Div(hn::Set(df, 1.0f), x);
#else
  (void)df;
  return hn::ApproximateReciprocal(x);
#endif
}

// The next random vector from the last: one AES round where VAES makes it one instruction,
// a step of xorshift32 in every lane elsewhere.
HWY_INLINE VU32 NextRandom(VU32 x) {
#if HWY_TARGET == HWY_AVX3_DL
  return VU32{_mm512_aesenc_epi128(x.raw, AesKey())};
#else
  x = hn::Xor(x, hn::ShiftLeft<13>(x));
  x = hn::Xor(x, hn::ShiftRight<17>(x));
  return hn::Xor(x, hn::ShiftLeft<5>(x));
#endif
}

// w + the signed 16-bit word kWord (0: low, 1: high) of each lane of r, a uniform integer in
// [-32768, 32767]: one VNNI multiply-add (by 1 in that word, 0 in the other) where AVX3_DL has it.
template <int kWord>
HWY_INLINE hn::Vec<DI32> AddRandomWord(hn::Vec<DI32> w, VU32 r) {
#if HWY_TARGET == HWY_AVX3_DL
  return hn::Vec<DI32>{
      _mm512_dpwssd_epi32(w.raw, r.raw, _mm512_set1_epi32(kWord == 0 ? 1 : 0x10000))};
#else
  const DI32 di;
  const auto ri = hn::BitCast(di, r);
  return hn::Add(w, hn::ShiftRight<16>(kWord == 0 ? hn::ShiftLeft<16>(ri) : ri));
#endif
}

// Stores the 8-bit codes of two vectors (x0 then x1), for x = code * 65536 + 32768 (16.16 fixed
// point, offset by one half): floor(x + s) >> 16 with s the signed random word kWord of the
// lane, i.e. floor(code + u) for u uniform on [0, 1) in steps of 2^-16 — a stochastic rounding
// unbiased to 2^-16 of a step. The codes are built to stay inside [-127, 127] (m, T = int8_t)
// or [0, 255] (v, T = uint8_t), so no clamp is needed on AVX-512; elsewhere the narrowing
// saturates anyway.
template <typename T, int kWord>
HWY_INLINE void StoreStochasticCodes(DF df, VF x0, VU32 r0, VF x1, VU32 r1, T* p) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // AVX-512: a conversion that floors (Highway 1.0's ConvertTo truncates and adds an overflow
  // fix-up), then the narrowing.
  const auto fixed = [&](VF x, VU32 r) {
    const hn::Vec<DI32> f{
        _mm512_cvt_roundps_epi32(x.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
    return AddRandomWord<kWord>(f, r).raw;
  };
  const __m512i f0 = fixed(x0, r0), f1 = fixed(x1, r1);
#if HWY_TARGET == HWY_AVX3_DL
  // The code is byte 2 of each sum: one byte permutation (VBMI) gathers both vectors'.
  const __m512i index =
      _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                      0, 0, 0, 0, 0, 0, 126, 122, 118, 114, 110, 106, 102, 98, 94, 90, 86, 82, 78,
                      74, 70, 66, 62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_castsi512_si256(_mm512_permutex2var_epi8(f0, index, f1)));
#else
  const __m512i q0 = _mm512_srai_epi32(f0, 16), q1 = _mm512_srai_epi32(f1, 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16), _mm512_cvtepi32_epi8(q1));
#endif
  (void)df;
#else
  // Elsewhere: the conversion truncates toward zero (for negative m, a bias of 2^-16 of a step
  // at most), the arithmetic shift floors, the narrowing saturates.
  const DI32 di;
  const hn::Rebind<T, DF> d8;
  const size_t N = hn::Lanes(df);
  const auto code = [&](VF x, VU32 r) {
    return hn::DemoteTo(d8, hn::ShiftRight<16>(AddRandomWord<kWord>(hn::ConvertTo(di, x), r)));
  };
  hn::StoreU(code(x0, r0), d8, p);
  hn::StoreU(code(x1, r1), d8, p + N);
#endif
}

// max(acc, |x|) for acc >= 0.
HWY_INLINE VF MaxAbs(VF acc, VF x) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return VF{_mm512_range_ps(acc.raw, x.raw, 0x0B)};  // VRANGEPS: larger magnitude, sign cleared
#else
  return hn::Max(acc, hn::Abs(x));
#endif
}

// ---- the update -------------------------------------------------------------------------

struct Coefs {
  VF b1, omb1, b2, omb2, step, inv_sqrt_bc2, eps, l2, decay, gs;
  explicit Coefs(DF df, const AdamKernelArgs& a)
      : b1(hn::Set(df, a.c.beta1)),
        omb1(hn::Set(df, a.c.one_minus_beta1)),
        b2(hn::Set(df, a.c.beta2)),
        omb2(hn::Set(df, a.c.one_minus_beta2)),
        step(hn::Set(df, a.c.step_size)),
        inv_sqrt_bc2(hn::Set(df, a.c.inv_sqrt_bc2)),
        eps(hn::Set(df, a.c.eps)),
        l2(hn::Set(df, a.c.l2)),
        decay(hn::Set(df, a.c.decay)),
        gs(hn::Set(df, a.grad_scale)) {}
};

// One vector of the update: new m, v, p. Square root and division are exact IEEE operations
// (the fp32 path is memory-bound; the int8 path, which is not, uses estimates).
HWY_INLINE void Update(const Coefs& c, VF g, VF& m, VF& v, VF& p) {
  g = hn::Mul(g, c.gs);
  g = hn::MulAdd(c.l2, p, g);  // coupled weight decay (l2 = 0 for AdamW)
  m = hn::MulAdd(m, c.b1, hn::Mul(g, c.omb1));
  v = hn::MulAdd(v, c.b2, hn::Mul(hn::Mul(g, g), c.omb2));
  const VF s = hn::Sqrt(v);
  const VF denom = hn::MulAdd(s, c.inv_sqrt_bc2, c.eps);
  p = hn::NegMulAdd(c.step, hn::Div(m, denom), hn::Mul(p, c.decay));
}

// Adagrad: v += g^2; p -= lr * g / (sqrt(v) + eps).
HWY_INLINE void AdagradUpdate(const Coefs& c, VF g, VF& v, VF& p) {
  g = hn::Mul(g, c.gs);
  g = hn::MulAdd(c.l2, p, g);
  v = hn::MulAdd(g, g, v);
  const VF denom = hn::Add(hn::Sqrt(v), c.eps);
  p = hn::NegMulAdd(c.step, hn::Div(g, denom), hn::Mul(p, c.decay));
}

// Lion: p -= lr * sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g.
HWY_INLINE void LionUpdate(const Coefs& c, VF g, VF& m, VF& p) {
  const DF df;
  g = hn::Mul(g, c.gs);
  g = hn::MulAdd(c.l2, p, g);
  const VF direction = hn::MulAdd(m, c.b1, hn::Mul(g, c.omb1));
  const VF sign = hn::IfThenZeroElse(hn::Eq(direction, hn::Zero(df)),
                                     hn::CopySign(hn::Set(df, 1.0f), direction));
  p = hn::NegMulAdd(c.step, sign, hn::Mul(p, c.decay));
  m = hn::MulAdd(m, c.b2, hn::Mul(g, c.omb2));
}

template <StatePrecision kS>
HWY_INLINE VF LoadMoment(DF df, const void* base, size_t i) {
  if constexpr (kS == StatePrecision::kFp32) {
    return hn::LoadU(df, static_cast<const float*>(base) + i);
  } else {
    return LoadBf16(df, static_cast<const uint16_t*>(base) + i);
  }
}

// bf16 moments round stochastically with `random`'s low 16 bits.
template <StatePrecision kS>
HWY_INLINE void StoreMoment(DF df, VF x, void* base, size_t i, const VU32& random) {
  if constexpr (kS == StatePrecision::kFp32) {
    hn::StoreU(x, df, static_cast<float*>(base) + i);
  } else {
    StoreBf16(df, x, static_cast<uint16_t*>(base) + i, &random);
  }
}

// fp32 / bf16 state over [begin, end), end - begin a multiple of the vector length. Only the
// moments the rule uses are read and written.
// The state is read from p_in, m_in, v_in and written to p, m, v (the same memory in place).
template <DType kG, StatePrecision kS, ParamCopy kC, UpdateRule kR>
HWY_INLINE void AdamVectors(const AdamKernelArgs& a, const float* p_in, const void* m_in,
                            const void* v_in, float* p, const void* g, void* m, void* v, void* copy,
                            size_t begin, size_t end, size_t index_base) {
  const DF df;
  const DU32 du;
  const size_t N = hn::Lanes(df);
  const Coefs c(df, a);
  constexpr bool kUsesM = kR != UpdateRule::kAdagrad, kUsesV = kR != UpdateRule::kLion;
  ElementRandom random(hn::Iota(du, 0), a.seed, a.index_offset + index_base + begin);
  // Unrolled: more loads in flight per core (dev, 2 cores: fp32 state 0.97 -> 1.03 of the
  // ceiling, bf16 state 0.94 -> 1.05; the int8 block loop, compute-bound, gains nothing).
#pragma GCC unroll 8
  for (size_t i = begin; i < end; i += N) {
    VF pv = hn::LoadU(df, p_in + i);
    VF mv = kUsesM ? LoadMoment<kS>(df, m_in, i) : hn::Zero(df);
    VF vv = kUsesV ? LoadMoment<kS>(df, v_in, i) : hn::Zero(df);
    const VF gv = LoadGrad<kG>(df, g, i);
    if constexpr (kR == UpdateRule::kAdam) {
      Update(c, gv, mv, vv, pv);
    } else if constexpr (kR == UpdateRule::kAdagrad) {
      AdagradUpdate(c, gv, vv, pv);
    } else {
      LionUpdate(c, gv, mv, pv);
    }
    hn::StoreU(pv, df, p + i);
    // bf16: 32 random bits per element; the low 16 round m, the high 16 round v.
    VU32 rm = hn::Zero(du);
    if constexpr (kS == StatePrecision::kBf16) rm = random.Next();
    if constexpr (kUsesM) StoreMoment<kS>(df, mv, m, i, rm);
    if constexpr (kUsesV) StoreMoment<kS>(df, vv, v, i, hn::ShiftRight<16>(rm));
    StoreCopy<kC>(df, pv, copy, i);
  }
}

// int8 state, one block of kInt8StateBlock elements (a tail block is zero-padded by the
// caller). Companded codes keep small moments representable next to the block's largest:
//   m: q = round(127 * sign(m) * sqrt(|m| / M)),  M = max |m| in the block;
//   v: q = round(255 * (v / V)^(1/4)),             V^(1/4) = max v^(1/4) in the block.
// Rounding is stochastic (unbiased in the code domain, 16 random bits per code); the scales
// are stored as fp32. The codes cost arithmetic, not bytes, so this is written for few
// operations: the square roots and the division come from the hardware estimates (relative
// error below 2^-12, far under a code step), the decoding scales are folded into beta1 and
// beta2 and the step size into the denominator, the random bits come from one cheap generator
// step per vector (NextRandom), and on AVX-512 the codes are rounded and narrowed in a few
// instructions, the random word added by one VNNI instruction where there is VNNI
// (StoreStochasticCodes). While block b's codes are computed (a loop that reads no memory),
// block b + kInt8PrefetchBlocks is prefetched (3: best on the 2-core dev VM against 1, 2 and
// 4; on the H200 host within 1-2 % of 2; docs/PERF.md).
constexpr size_t kInt8PrefetchBlocks = 3;

// The state is read from p_in, mq_in, vq_in and the scales *m_scale_in, *v_scale_in, and
// written to p, mq, vq, *m_scale, *v_scale (the same memory when in place).
template <DType kG, ParamCopy kC>
HWY_INLINE void AdamInt8Block(const AdamKernelArgs& a, const float* p_in, const int8_t* mq_in,
                              const uint8_t* vq_in, const float* m_scale_in,
                              const float* v_scale_in, float* p, const void* g, int8_t* mq,
                              uint8_t* vq, float* m_scale, float* v_scale, void* copy, size_t index,
                              VU32 lanes, bool prefetch_ahead) {
  const DF df;
  const DU32 du;
  const DI32 di;
  const hn::Rebind<int8_t, DF> d8;
  const hn::Rebind<uint8_t, DF> du8;
  const size_t N = hn::Lanes(df);
  HWY_ALIGN float m_new[kInt8StateBlock];
  HWY_ALIGN float r_new[kInt8StateBlock];  // v^(1/4)
  // Decoding: m = (M / 127^2) * q|q|, v = (V^(1/4) / 255)^4 * q^4, folded into the betas.
  const float r_deq = *v_scale_in * (1.0f / 255.0f);
  const VF b1 = hn::Set(df, a.c.beta1 * *m_scale_in * (1.0f / (127.0f * 127.0f)));
  const VF b2 = hn::Set(df, a.c.beta2 * (r_deq * r_deq) * (r_deq * r_deq));
  // Coupled weight decay folds grad_scale into the gradient; otherwise into (1 - beta).
  const bool coupled = a.c.l2 != 0.0f;
  const float gs = a.grad_scale;
  const VF gscale = hn::Set(df, gs), l2 = hn::Set(df, a.c.l2);
  const VF omb1 = hn::Set(df, coupled ? a.c.one_minus_beta1 : a.c.one_minus_beta1 * gs);
  const VF omb2 = hn::Set(df, coupled ? a.c.one_minus_beta2 : a.c.one_minus_beta2 * gs * gs);
  // The step size divides the denominator: p' = p decay - m / (sqrt(v) c / step + eps / step).
  // (lr = 0 makes both terms infinite, and the update m * 1/inf = 0, as sqrt(v) > 0 here.)
  const float step = a.c.step_size;
  const VF decay = hn::Set(df, a.c.decay);
  const VF sqrt_coef = hn::Set(df, a.c.inv_sqrt_bc2 / step), eps = hn::Set(df, a.c.eps / step);
  // v and the code computations add the smallest normal float, so no estimate sees a zero.
  const VF tiny = hn::Set(df, 1.17549435e-38f);
  VF m_max = hn::Zero(df), r_max = hn::Zero(df);
  const auto update = [&](auto kCoupled) {
    for (size_t i = 0; i < kInt8StateBlock; i += N) {
      VF pv = hn::LoadU(df, p_in + i);
      const VF qm = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, mq_in + i)));
      const VF qv = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(du8, vq_in + i)));
      const VF qv2 = hn::Mul(qv, qv);
      VF gv = LoadGrad<kG>(df, g, i);
      if constexpr (kCoupled) gv = hn::MulAdd(l2, pv, hn::Mul(gv, gscale));
      const VF m = hn::MulAdd(hn::Mul(qm, hn::Abs(qm)), b1, hn::Mul(gv, omb1));
      const VF v = hn::MulAdd(hn::Mul(qv2, qv2), b2, hn::MulAdd(hn::Mul(gv, gv), omb2, tiny));
      const VF rs = RsqrtEstimate(df, v);  // 1 / sqrt(v)
      const VF inv_denom = RcpEstimate(df, hn::MulAdd(hn::Mul(v, rs), sqrt_coef, eps));
      pv = hn::MulSub(pv, decay, hn::Mul(m, inv_denom));
      hn::StoreU(pv, df, p + i);
      StoreCopy<kC>(df, pv, copy, i);
      const VF r = RsqrtEstimate(df, rs);  // v^(1/4)
      hn::Store(m, df, m_new + i);
      hn::Store(r, df, r_new + i);
      m_max = MaxAbs(m_max, m);
      r_max = hn::Max(r_max, r);
    }
  };
  if (coupled) {
    update(std::true_type{});
  } else {
    update(std::false_type{});
  }
  const float ms = hn::GetLane(hn::MaxOfLanes(df, m_max));
  const float rs = hn::GetLane(hn::MaxOfLanes(df, r_max));
  *m_scale = ms;
  *v_scale = rs;
  // Codes times 65536 plus one half (16.16 fixed point, see StoreStochasticCodes). m's: with
  // K = 127 * 65536, sign(m) K sqrt(|m| / M) = (K / sqrt(M)) m rsqrt(|m|), where taking at least
  // the smallest normal float keeps rsqrt finite (and the code 0) for m = 0 and the code below
  // K for |m| below it. K is shrunk by 2^-13 so that the estimate's error (at most 2^-14 with
  // AVX-512) cannot carry a code past 127: a bias of 1/64 of a step at the block maximum only.
  // v's: r K' / V^(1/4), K' = 255 * 65536, 16/65536 of a step short of the end: r <= V^(1/4)
  // exactly (the same values), and the margin covers the product's rounding. Both factors stay
  // finite: M >= 2^-149 when positive, V^(1/4) >= 2^-32.
  constexpr float kM = 127.0f * 65536.0f * (1.0f - 0x1p-13f), kV = 255.0f * 65536.0f - 16.0f;
  const VF km = hn::Set(df, ms > 0 ? kM / std::sqrt(ms) : 0.0f);
  const VF kr = hn::Set(df, rs > 0 ? kV / rs : 0.0f);
  const VF half = hn::Set(df, 32768.0f);
  // Random bits depend on the block's first element index only: a murmur-style hash seeds the
  // generator (made odd, so xorshift32 never starts from the zero state); one step per vector,
  // its low 16 bits round m and its high 16 bits v.
  VU32 random = hn::Or(RandomBits(du, lanes, a.seed, index), hn::Set(du, 1u));
  const auto codes = [&](size_t i, VF* cm, VF* cr) {
    const VF m = hn::Load(df, m_new + i);
    *cm = hn::MulAdd(hn::Mul(m, km), RsqrtEstimate(df, MaxAbs(tiny, m)), half);
    *cr = hn::MulAdd(hn::Load(df, r_new + i), kr, half);
  };
  const size_t gb = DTypeBytes(kG);
  for (size_t i = 0; i < kInt8StateBlock; i += 2 * N) {  // the block is a multiple of 2N
    if (prefetch_ahead) {
      const size_t next = kInt8PrefetchBlocks * kInt8StateBlock + i;  // 2N elements from there
      for (size_t b = 0; b < 8 * N; b += 64) {
        hwy::Prefetch(reinterpret_cast<const char*>(p_in + next) + b);
      }
      for (size_t b = 0; b < 2 * N * gb; b += 64)
        hwy::Prefetch(static_cast<const char*>(g) + next * gb + b);
      hwy::Prefetch(mq_in + next);
      hwy::Prefetch(vq_in + next);
    }
    const VU32 r0 = NextRandom(random);
    random = NextRandom(r0);
    VF cm0, cr0, cm1, cr1;
    codes(i, &cm0, &cr0);
    codes(i + N, &cm1, &cr1);
    StoreStochasticCodes<int8_t, 0>(df, cm0, r0, cm1, random, mq + i);
    StoreStochasticCodes<uint8_t, 1>(df, cr0, r0, cr1, random, vq + i);
  }
}

size_t StateBytes(StatePrecision s) {
  return s == StatePrecision::kFp32 ? 4 : s == StatePrecision::kBf16 ? 2 : 1;
}
size_t CopyBytes(ParamCopy c) { return c == ParamCopy::kNone ? 0 : 2; }

template <typename T>
T* At(void* base, size_t bytes_per_elem, size_t i) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + bytes_per_elem * i);
}
template <typename T>
const T* At(const void* base, size_t bytes_per_elem, size_t i) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + bytes_per_elem * i);
}

template <DType kG, StatePrecision kS, ParamCopy kC, UpdateRule kR>
void AdamRangeT(const AdamKernelArgs& a, size_t begin, size_t end) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const size_t gb = DTypeBytes(kG), sb = StateBytes(kS), cb = CopyBytes(kC);
  void* g = const_cast<void*>(a.g);
  if constexpr (kS == StatePrecision::kInt8) {
    const VU32 lanes = hn::Iota(DU32(), 0);
    for (size_t b = begin; b < end; b += kInt8StateBlock) {
      const size_t len = std::min(kInt8StateBlock, end - b);
      float* ms = a.m_scales + b / kInt8StateBlock;
      float* vs = a.v_scales + b / kInt8StateBlock;
      const float* ms_in = a.m_scales_in + b / kInt8StateBlock;
      const float* vs_in = a.v_scales_in + b / kInt8StateBlock;
      auto* mq = static_cast<int8_t*>(a.m) + b;
      auto* vq = static_cast<uint8_t*>(a.v) + b;
      const auto* mq_in = static_cast<const int8_t*>(a.m_in) + b;
      const auto* vq_in = static_cast<const uint8_t*>(a.v_in) + b;
      if (len == kInt8StateBlock) {
        AdamInt8Block<kG, kC>(
            a, a.p_in + b, mq_in, vq_in, ms_in, vs_in, a.p + b, At<char>(g, gb, b), mq, vq, ms, vs,
            kC == ParamCopy::kNone ? nullptr : At<char>(a.copy, cb, b), a.index_offset + b, lanes,
            b + (1 + kInt8PrefetchBlocks) * kInt8StateBlock <= end);
        continue;
      }
      // A partial last block: zero-padded copies through the same code.
      HWY_ALIGN float p[kInt8StateBlock] = {};
      HWY_ALIGN float gp[kInt8StateBlock] = {};
      HWY_ALIGN int8_t mp[kInt8StateBlock] = {};
      HWY_ALIGN uint8_t vp[kInt8StateBlock] = {};
      HWY_ALIGN uint16_t cp[kInt8StateBlock] = {};
      std::memcpy(p, a.p_in + b, len * 4);
      std::memcpy(gp, At<char>(g, gb, b), len * gb);
      std::memcpy(mp, mq_in, len);
      std::memcpy(vp, vq_in, len);
      AdamInt8Block<kG, kC>(a, p, mp, vp, ms_in, vs_in, p, gp, mp, vp, ms, vs, cp,
                            a.index_offset + b, lanes, false);
      std::memcpy(a.p + b, p, len * 4);
      std::memcpy(mq, mp, len);
      std::memcpy(vq, vp, len);
      if constexpr (kC != ParamCopy::kNone) std::memcpy(At<char>(a.copy, cb, b), cp, len * cb);
    }
  } else {
    const size_t body_end = begin + (end - begin) / N * N;
    AdamVectors<kG, kS, kC, kR>(a, a.p_in, a.m_in, a.v_in, a.p, a.g, a.m, a.v, a.copy, begin,
                                body_end, 0);
    const size_t len = end - body_end;
    if (len == 0) return;
    HWY_ALIGN float p[hn::MaxLanes(DF())] = {};
    HWY_ALIGN float gp[hn::MaxLanes(DF())] = {};
    HWY_ALIGN float mp[hn::MaxLanes(DF())] = {};
    HWY_ALIGN float vp[hn::MaxLanes(DF())] = {};
    HWY_ALIGN uint16_t cp[hn::MaxLanes(DF())] = {};
    std::memcpy(p, a.p_in + body_end, len * 4);
    std::memcpy(gp, At<char>(g, gb, body_end), len * gb);
    constexpr bool kUsesM = kR != UpdateRule::kAdagrad, kUsesV = kR != UpdateRule::kLion;
    if constexpr (kUsesM) std::memcpy(mp, At<char>(a.m_in, sb, body_end), len * sb);
    if constexpr (kUsesV) std::memcpy(vp, At<char>(a.v_in, sb, body_end), len * sb);
    AdamVectors<kG, kS, kC, kR>(a, p, mp, vp, p, gp, mp, vp, cp, 0, N, body_end);
    std::memcpy(a.p + body_end, p, len * 4);
    if constexpr (kUsesM) std::memcpy(At<char>(a.m, sb, body_end), mp, len * sb);
    if constexpr (kUsesV) std::memcpy(At<char>(a.v, sb, body_end), vp, len * sb);
    if constexpr (kC != ParamCopy::kNone) std::memcpy(At<char>(a.copy, cb, body_end), cp, len * cb);
  }
}

template <DType kG, StatePrecision kS, UpdateRule kR>
void DispatchCopy(const AdamKernelArgs& a, size_t begin, size_t end) {
  switch (a.copy_type) {
    case ParamCopy::kNone:
      return AdamRangeT<kG, kS, ParamCopy::kNone, kR>(a, begin, end);
    case ParamCopy::kBf16:
      return AdamRangeT<kG, kS, ParamCopy::kBf16, kR>(a, begin, end);
    case ParamCopy::kFp16:
      return AdamRangeT<kG, kS, ParamCopy::kFp16, kR>(a, begin, end);
  }
}

// int8 state is Adam's only (checked before dispatch).
template <DType kG, StatePrecision kS>
void DispatchRule(const AdamKernelArgs& a, size_t begin, size_t end) {
  if constexpr (kS == StatePrecision::kInt8) {
    return DispatchCopy<kG, kS, UpdateRule::kAdam>(a, begin, end);
  } else {
    switch (a.rule) {
      case UpdateRule::kAdam:
        return DispatchCopy<kG, kS, UpdateRule::kAdam>(a, begin, end);
      case UpdateRule::kAdagrad:
        return DispatchCopy<kG, kS, UpdateRule::kAdagrad>(a, begin, end);
      case UpdateRule::kLion:
        return DispatchCopy<kG, kS, UpdateRule::kLion>(a, begin, end);
    }
  }
}

template <DType kG>
void DispatchState(const AdamKernelArgs& a, size_t begin, size_t end) {
  switch (a.state) {
    case StatePrecision::kFp32:
      return DispatchRule<kG, StatePrecision::kFp32>(a, begin, end);
    case StatePrecision::kBf16:
      return DispatchRule<kG, StatePrecision::kBf16>(a, begin, end);
    case StatePrecision::kInt8:
      return DispatchRule<kG, StatePrecision::kInt8>(a, begin, end);
  }
}

void AdamRangeImpl(const AdamKernelArgs& a, size_t begin, size_t end) {
  switch (a.grad_type) {
    case DType::kFp32:
      return DispatchState<DType::kFp32>(a, begin, end);
    case DType::kBf16:
      return DispatchState<DType::kBf16>(a, begin, end);
    case DType::kFp16:
      return DispatchState<DType::kFp16>(a, begin, end);
  }
}

// ---- the bandwidth ceiling --------------------------------------------------------------

// Reads and writes exactly the bytes AdamRange does (grads read; params and the moments the
// rule uses read and written; copy written), with one XOR per vector instead of Adam's arithmetic.
// The value XOR'ed in is masked by a.ceiling_mask, 0 at run time: the data stays intact (an update
// run after it sees real numbers, not bit noise that could be denormal), yet the compiler cannot
// drop the loads and stores. All streams are walked together, as the update does, in units of L
// elements (kGb vectors of grads, 4 of params, kSb each of m and v, kCb of the copy), every
// count a compile-time constant so that the loop body is straight-line code.
template <size_t kGb, size_t kSb, size_t kCb, bool kM, bool kV>
void BandwidthUnits(const uint8_t* g, uint8_t* p, uint8_t* m, uint8_t* v, uint8_t* c, size_t units,
                    uint8_t mask_byte) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t L = hn::Lanes(d8);
  const auto mask = hn::Set(d8, mask_byte);
  using V = decltype(hn::Zero(d8));
  V acc = hn::Zero(d8);
  for (size_t u = 0; u < units; ++u) {
    // Every load of the unit before its stores, as the update does: a store followed by a load
    // 4 KiB apart (the buffers are huge-page aligned) would stall on the address alias.
    for (size_t k = 0; k < kGb; ++k) acc = hn::Xor(acc, hn::LoadU(d8, g + (u * kGb + k) * L));
    acc = hn::And(acc, mask);
    V pv[4], mv[kSb], vv[kSb];
    for (size_t k = 0; k < 4; ++k) pv[k] = hn::LoadU(d8, p + (u * 4 + k) * L);
    for (size_t k = 0; k < kSb; ++k) {
      if constexpr (kM) mv[k] = hn::LoadU(d8, m + (u * kSb + k) * L);
      if constexpr (kV) vv[k] = hn::LoadU(d8, v + (u * kSb + k) * L);
    }
    for (size_t k = 0; k < 4; ++k) hn::StoreU(hn::Xor(pv[k], acc), d8, p + (u * 4 + k) * L);
    for (size_t k = 0; k < kSb; ++k) {
      if constexpr (kM) hn::StoreU(hn::Xor(mv[k], acc), d8, m + (u * kSb + k) * L);
      if constexpr (kV) hn::StoreU(hn::Xor(vv[k], acc), d8, v + (u * kSb + k) * L);
    }
    for (size_t k = 0; k < kCb; ++k) hn::StoreU(acc, d8, c + (u * kCb + k) * L);
  }
}

template <size_t k>
using Size = std::integral_constant<size_t, k>;

void BandwidthRangeImpl(const AdamKernelArgs& a, size_t begin, size_t end) {
  const size_t L = hn::Lanes(hn::ScalableTag<uint8_t>());
  const size_t gb = DTypeBytes(a.grad_type);
  const size_t sb = StateBytes(a.state);
  const size_t cb = CopyBytes(a.copy_type);
  const auto* g = static_cast<const uint8_t*>(a.g) + begin * gb;
  auto* p = reinterpret_cast<uint8_t*>(a.p + begin);
  const bool uses_m = a.rule != UpdateRule::kAdagrad, uses_v = a.rule != UpdateRule::kLion;
  auto* m = uses_m ? static_cast<uint8_t*>(a.m) + begin * sb : nullptr;
  auto* v = uses_v ? static_cast<uint8_t*>(a.v) + begin * sb : nullptr;
  auto* c = cb != 0 ? static_cast<uint8_t*>(a.copy) + begin * cb : nullptr;
  const auto run = [&](auto kGb, auto kSb, auto kCb, auto kM, auto kV) {
    BandwidthUnits<decltype(kGb)::value, decltype(kSb)::value, decltype(kCb)::value,
                   decltype(kM)::value, decltype(kV)::value>(g, p, m, v, c, (end - begin) / L,
                                                             a.ceiling_mask);
  };
  const auto with_moments = [&](auto kGb, auto kSb, auto kCb) {
    if (uses_m && uses_v) {
      run(kGb, kSb, kCb, std::true_type{}, std::true_type{});
    } else if (uses_m) {
      run(kGb, kSb, kCb, std::true_type{}, std::false_type{});
    } else {
      run(kGb, kSb, kCb, std::false_type{}, std::true_type{});
    }
  };
  const auto with_copy = [&](auto kGb, auto kSb) {
    if (cb == 0) {
      with_moments(kGb, kSb, Size<0>{});
    } else {
      with_moments(kGb, kSb, Size<2>{});
    }
  };
  const auto with_state = [&](auto kGb) {
    if (sb == 1) {
      with_copy(kGb, Size<1>{});
    } else if (sb == 2) {
      with_copy(kGb, Size<2>{});
    } else {
      with_copy(kGb, Size<4>{});
    }
  };
  if (gb == 2) {
    with_state(Size<2>{});
  } else {
    with_state(Size<4>{});
  }
}

// ---- gradient norm ----------------------------------------------------------------------

template <DType kG>
double SumSquaresT(const void* g, size_t begin, size_t end, bool* finite) {
  const DF df;
  const size_t N = hn::Lanes(df);
  double total = 0;
  auto all_finite = hn::IsFinite(hn::Zero(df));
  size_t i = begin;
  constexpr size_t kChunk = 16;  // vectors summed in fp32 before joining the float64 total
  while (i + N <= end) {
    VF acc = hn::Zero(df);
    for (size_t k = 0; k < kChunk && i + N <= end; ++k, i += N) {
      const VF x = LoadGrad<kG>(df, g, i);
      all_finite = hn::And(all_finite, hn::IsFinite(x));
      acc = hn::MulAdd(x, x, acc);
    }
    total += static_cast<double>(hn::GetLane(hn::SumOfLanes(df, acc)));
  }
  if (!hn::AllTrue(df, all_finite)) *finite = false;
  for (; i < end; ++i) {  // tail: scalar float64
    HWY_ALIGN float x[hn::MaxLanes(DF())] = {};
    std::memcpy(x, static_cast<const char*>(g) + i * DTypeBytes(kG), DTypeBytes(kG));
    const float xf = hn::GetLane(LoadGrad<kG>(df, x, 0));
    if (!std::isfinite(xf)) *finite = false;
    total += static_cast<double>(xf) * xf;
  }
  return total;
}

double GradSumSquaresImpl(const void* g, DType type, size_t begin, size_t end, bool* finite) {
  switch (type) {
    case DType::kFp32:
      return SumSquaresT<DType::kFp32>(g, begin, end, finite);
    case DType::kBf16:
      return SumSquaresT<DType::kBf16>(g, begin, end, finite);
    case DType::kFp16:
      return SumSquaresT<DType::kFp16>(g, begin, end, finite);
  }
  return 0;
}

}  // namespace HWY_NAMESPACE
}  // namespace zoffload::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace zoffload::internal {

HWY_EXPORT(AdamRangeImpl);
HWY_EXPORT(BandwidthRangeImpl);
HWY_EXPORT(GradSumSquaresImpl);

void AdamRange(const AdamKernelArgs& args, size_t begin, size_t end) {
  HWY_DYNAMIC_DISPATCH(AdamRangeImpl)(args, begin, end);
}
void BandwidthRange(const AdamKernelArgs& args, size_t begin, size_t end) {
  HWY_DYNAMIC_DISPATCH(BandwidthRangeImpl)(args, begin, end);
}
double GradSumSquares(const void* grads, DType type, size_t begin, size_t end, bool* finite) {
  return HWY_DYNAMIC_DISPATCH(GradSumSquaresImpl)(grads, type, begin, end, finite);
}

}  // namespace zoffload::internal
#endif
