// The per-step arithmetic shared by the CPU Adam and the GPU Adam (src/gpu/kernels.cu), so
// that both compute the same float operations from the same coefficients.
#pragma once

#include <cmath>

#include "zoffload/cpu_adam.h"

#ifdef __CUDACC__
#define ZO_HOST_DEVICE __host__ __device__
#else
#define ZO_HOST_DEVICE
#endif

namespace zoffload::internal {

/// Per-step coefficients of the update, computed once in float64 and rounded to float.
struct AdamCoefficients {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t) for Adam; lr for Adagrad and Lion
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t) for Adam; 1 for Adagrad
  float eps;
  float l2;     // coupled weight decay (Adam); 0 for AdamW
  float decay;  // 1 - lr * weight_decay for AdamW; 1 for Adam
};
AdamCoefficients MakeAdamCoefficients(const AdamHyper& hyper);

/// The clipping decision of a step from the raw (still loss-scaled) gradient norm: sets
/// *grad_norm (unscaled) and *clip_coef, returns the gradient scale clip_coef / loss_scale.
ZO_HOST_DEVICE inline float ClipAndUnscale(double raw_norm, float loss_scale, float max_grad_norm,
                                           double* grad_norm, float* clip_coef) {
  *grad_norm = raw_norm / loss_scale;
  *clip_coef = 1.0f;
  if (max_grad_norm > 0 && *grad_norm > max_grad_norm) {
    *clip_coef = static_cast<float>(max_grad_norm / (*grad_norm + 1e-6));
  }
  return static_cast<float>(static_cast<double>(*clip_coef) / loss_scale);
}

/// The norm a skipped step reports: its gradients hold inf or NaN, and so does the norm (inf
/// where the sum overflowed, else NaN) — never a finite number such as 0.
inline double NonfiniteNorm(double raw_norm) {
  return raw_norm != raw_norm || raw_norm > 1e308 ? raw_norm : __builtin_nan("");
}

}  // namespace zoffload::internal
