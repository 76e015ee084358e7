// Accuracy of the low-precision optimizer states on a real optimization problem: a small
// MLP (32 -> 64 tanh -> 1) fitted by full-batch Adam to data from a random teacher network,
// once per state precision (fp32, bf16, int8), everything else identical. Prints the training
// loss every 50 steps as a table (and CSV with --csv FILE); --seed S draws another teacher, data
// set and initialization; --seeds K runs seeds 0..K-1 and prints, per state, the mean |ln(loss /
// fp32 loss)| over the printed steps and at the last one. docs/cpu_adam.md records both.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "zoffload/cpu_adam.h"

namespace {

constexpr int kIn = 32, kHidden = 64, kTeacherHidden = 16, kSamples = 2048, kSteps = 600;
constexpr int kParams = kHidden * kIn + kHidden + kHidden + 1;

struct Data {
  std::vector<float> x, y;
};

Data MakeData(unsigned seed) {
  std::mt19937 rng(1234 + seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w1(kTeacherHidden * kIn), w2(kTeacherHidden);
  for (float& w : w1) w = normal(rng) / std::sqrt(static_cast<float>(kIn));
  for (float& w : w2) w = normal(rng);
  Data d;
  d.x.resize(kSamples * kIn);
  d.y.resize(kSamples);
  for (float& v : d.x) v = normal(rng);
  for (int s = 0; s < kSamples; ++s) {
    float out = 0;
    for (int h = 0; h < kTeacherHidden; ++h) {
      float a = 0;
      for (int i = 0; i < kIn; ++i) a += w1[h * kIn + i] * d.x[s * kIn + i];
      out += w2[h] * std::tanh(a);
    }
    d.y[s] = out + 0.05f * normal(rng);
  }
  return d;
}

// Loss and gradient of the mean squared error; params = [W1 | b1 | w2 | b2].
double LossAndGrad(const Data& d, const std::vector<float>& p, std::vector<float>* g) {
  std::fill(g->begin(), g->end(), 0.0f);
  const float* w1 = p.data();
  const float* b1 = w1 + kHidden * kIn;
  const float* w2 = b1 + kHidden;
  const float b2 = w2[kHidden];
  float* gw1 = g->data();
  float* gb1 = gw1 + kHidden * kIn;
  float* gw2 = gb1 + kHidden;
  double loss = 0;
  std::vector<float> hidden(kHidden);
  for (int s = 0; s < kSamples; ++s) {
    const float* x = &d.x[s * kIn];
    float out = b2;
    for (int h = 0; h < kHidden; ++h) {
      float a = b1[h];
      for (int i = 0; i < kIn; ++i) a += w1[h * kIn + i] * x[i];
      hidden[h] = std::tanh(a);
      out += w2[h] * hidden[h];
    }
    const float err = out - d.y[s];
    loss += 0.5 * err * err;
    const float scale = err / kSamples;
    gw2[kHidden] += scale;
    for (int h = 0; h < kHidden; ++h) {
      gw2[h] += scale * hidden[h];
      const float back = scale * w2[h] * (1 - hidden[h] * hidden[h]);
      gb1[h] += back;
      for (int i = 0; i < kIn; ++i) gw1[h * kIn + i] += back * x[i];
    }
  }
  return loss / kSamples;
}

std::vector<double> Train(const Data& d, zoffload::StatePrecision state, unsigned seed) {
  std::mt19937 rng(99 + seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(kParams), g(kParams);
  for (int i = 0; i < kHidden * kIn; ++i) p[i] = normal(rng) / std::sqrt(static_cast<float>(kIn));
  for (int h = 0; h < kHidden; ++h)
    p[kHidden * kIn + kHidden + h] = normal(rng) / std::sqrt(static_cast<float>(kHidden));
  std::vector<unsigned char> m(zoffload::AdamMomentBytes(state, kParams), 0);
  std::vector<unsigned char> v(zoffload::AdamMomentBytes(state, kParams), 0);
  zoffload::AdamShard shard;
  shard.params = p.data();
  shard.n = kParams;
  shard.state = state;
  shard.m = m.data();
  shard.v = v.data();
  shard.grads = g.data();
  zoffload::AdamHyper h;
  h.lr = 3e-3f;
  h.weight_decay = 1e-4f;
  std::vector<double> losses;
  for (int step = 1; step <= kSteps; ++step) {
    const double loss = LossAndGrad(d, p, &g);
    if ((step - 1) % 50 == 0) losses.push_back(loss);
    h.step = step;
    if (!zoffload::AdamUpdate(shard, h, 1.0f, 1).ok()) std::abort();
  }
  losses.push_back(LossAndGrad(d, p, &g));
  return losses;
}

// The loss curves of the three state precisions on the problem drawn from `seed`.
struct Curves {
  std::vector<double> fp32, bf16, int8;
};

Curves TrainAll(unsigned seed) {
  const Data d = MakeData(seed);
  return {Train(d, zoffload::StatePrecision::kFp32, seed),
          Train(d, zoffload::StatePrecision::kBf16, seed),
          Train(d, zoffload::StatePrecision::kInt8, seed)};
}

// Runs seeds 0..seeds-1; prints mean |ln(state loss / fp32 loss)| over the steps after 0, and
// the mean and largest at the last step.
void SeedSummary(unsigned seeds) {
  struct Deviation {
    double all = 0, last = 0, last_max = 0;
    size_t points = 0;
  } bf16_dev, int8_dev;
  for (unsigned seed = 0; seed < seeds; ++seed) {
    const Curves c = TrainAll(seed);
    const auto add = [&](Deviation& dev, const std::vector<double>& losses) {
      for (size_t i = 1; i < losses.size(); ++i) {
        const double x = std::fabs(std::log(losses[i] / c.fp32[i]));
        dev.all += x;
        ++dev.points;
        if (i + 1 == losses.size()) {
          dev.last += x;
          dev.last_max = std::max(dev.last_max, x);
        }
      }
    };
    add(bf16_dev, c.bf16);
    add(int8_dev, c.int8);
    std::fprintf(stderr, "seed %u of %u done\n", seed + 1, seeds);
  }
  std::printf(
      "|ln(loss / fp32 loss)| over seeds 0..%u: mean over steps 50..%d, mean and max at %d\n",
      seeds - 1, kSteps, kSteps);
  for (const auto& [name, dev] : {std::pair{"bf16", bf16_dev}, std::pair{"int8", int8_dev}}) {
    std::printf("%s state: %.4f  %.4f  %.4f\n", name, dev.all / static_cast<double>(dev.points),
                dev.last / seeds, dev.last_max);
  }
}

}  // namespace

int main(int argc, char** argv) {
  unsigned seed = 0, seeds = 0;
  const char* csv = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--seed") {
      seed = static_cast<unsigned>(std::stoul(argv[i + 1]));
    } else if (flag == "--seeds") {
      seeds = static_cast<unsigned>(std::stoul(argv[i + 1]));
    } else if (flag == "--csv") {
      csv = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: adam_accuracy [--seed S | --seeds K] [--csv FILE]\n");
      return 2;
    }
  }
  if (seeds > 0) {
    SeedSummary(seeds);
    return 0;
  }
  const auto [fp32, bf16, int8] = TrainAll(seed);
  std::printf("MLP %d-%d-1 (tanh), %d params, %d samples, full-batch AdamW lr 3e-3, seed %u\n", kIn,
              kHidden, kParams, kSamples, seed);
  std::printf("%6s %12s %12s %12s %10s %10s\n", "step", "fp32 state", "bf16 state", "int8 state",
              "bf16/fp32", "int8/fp32");
  for (size_t i = 0; i < fp32.size(); ++i) {
    std::printf("%6zu %12.6f %12.6f %12.6f %10.4f %10.4f\n", i * 50, fp32[i], bf16[i], int8[i],
                bf16[i] / fp32[i], int8[i] / fp32[i]);
  }
  if (csv != nullptr) {
    std::FILE* f = std::fopen(csv, "w");
    if (f == nullptr) {
      std::perror(csv);
      return 1;
    }
    std::fprintf(f, "step,fp32,bf16,int8\n");
    for (size_t i = 0; i < fp32.size(); ++i)
      std::fprintf(f, "%zu,%g,%g,%g\n", i * 50, fp32[i], bf16[i], int8[i]);
    std::fclose(f);
  }
  return 0;
}
