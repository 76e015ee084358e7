#include "engine/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace zoffload::internal {

LossScaler::LossScaler(const Fp16Config& fp16)
    : dynamic_(fp16.enabled && fp16.loss_scale == 0),
      scale_(!fp16.enabled         ? 1.0f
             : fp16.loss_scale > 0 ? static_cast<float>(fp16.loss_scale)
                                   : std::ldexp(1.0f, fp16.initial_scale_power)),
      config_(fp16) {}

void LossScaler::Update(bool overflow) {
  if (!dynamic_) return;
  if (overflow) {
    good_steps_ = 0;
    if (++overflows_ >= config_.hysteresis) {
      scale_ = std::max(scale_ / 2, static_cast<float>(config_.min_loss_scale));
      overflows_ = 0;
    }
    return;
  }
  if (++good_steps_ >= config_.loss_scale_window) {
    scale_ *= 2;
    good_steps_ = 0;
    overflows_ = 0;
  }
}

}  // namespace zoffload::internal
