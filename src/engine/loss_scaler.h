// LossScaler: the fp16 loss scale of the OffloadEngine (config section fp16).
//
// Static (fp16.loss_scale > 0): that scale, always. Dynamic (loss_scale 0): it starts at
// 2^initial_scale_power. A step whose gradients hold inf/NaN is skipped and counts one
// overflow; after `hysteresis` overflows since the scale last changed, the scale halves (never
// below min_loss_scale). After loss_scale_window steps in a row without overflow it doubles.
// Every change of the scale restarts both counts. bf16 and fp32 training use a scale of 1.
//
// Thread-safety: a value; not synchronized.
#pragma once

#include <cstdint>

#include "zoffload/config.h"

namespace zoffload::internal {

class LossScaler {
 public:
  explicit LossScaler(const Fp16Config& fp16);

  float scale() const { return scale_; }
  /// Records a step's outcome and moves the scale accordingly.
  void Update(bool overflow);

  /// What a checkpoint keeps: the scale and both counts.
  struct State {
    float scale = 1;
    int overflows = 0;
    int good_steps = 0;
  };
  State state() const { return {scale_, overflows_, good_steps_}; }
  void Restore(const State& s) {
    scale_ = s.scale;
    overflows_ = s.overflows;
    good_steps_ = s.good_steps;
  }

 private:
  bool dynamic_;
  float scale_;
  Fp16Config config_;
  int overflows_ = 0;   // since the scale last changed
  int good_steps_ = 0;  // in a row, since the scale last changed or the last overflow
};

}  // namespace zoffload::internal
