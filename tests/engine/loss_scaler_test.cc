#include "engine/loss_scaler.h"

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(LossScaler, DynamicHalvesAfterHysteresisAndDoublesAfterTheWindow) {
  Fp16Config c;
  c.enabled = true;
  c.initial_scale_power = 4;
  c.hysteresis = 2;
  c.loss_scale_window = 3;
  c.min_loss_scale = 4;
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 16.0f);
  s.Update(true);  // one overflow of two tolerated
  EXPECT_EQ(s.scale(), 16.0f);
  s.Update(true);
  EXPECT_EQ(s.scale(), 8.0f);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 8.0f);
  s.Update(true);  // the window restarts
  s.Update(false);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 16.0f);
  for (int i = 0; i < 10; ++i) s.Update(true);
  EXPECT_EQ(s.scale(), 4.0f);  // never below min_loss_scale
}

TEST(LossScaler, StaticAndOffNeverMove) {
  Fp16Config fixed;
  fixed.enabled = true;
  fixed.loss_scale = 512;
  LossScaler s(fixed);
  s.Update(true);
  s.Update(true);
  EXPECT_EQ(s.scale(), 512.0f);
  LossScaler off(Fp16Config{});
  off.Update(true);
  EXPECT_EQ(off.scale(), 1.0f);
}

}  // namespace
}  // namespace zoffload::internal
