// The smallest OffloadEngine loop: a linear model y = W x fitted by AdamW, its gradients
// written by hand on the CPU, the engine in host mode (no GPU needed). A framework's loop has
// the same shape: backward hands each gradient to GradientReady, then Step, then (on a GPU)
// WaitParameters before the next forward.
//
//   build/default/examples/engine_host [config.json]
// Exits 1 unless the loss falls below a hundredth of its start.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "zoffload/engine.h"

int main(int argc, char** argv) {
  using namespace zoffload;
  constexpr int kIn = 64, kOut = 16, kBatch = 32, kSteps = 300;
  Result<Config> config =
      argc > 1 ? LoadConfigFile(argv[1])
               : ParseConfig(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                                 "zero_optimization": {"stage": 2,
                                   "offload_optimizer": {"device": "cpu"}}})");
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> target(kIn * kOut), w(kIn * kOut, 0.0f), grad(kIn * kOut);
  for (float& t : target) t = normal(rng);

  EngineOptions options;
  options.host_params = true;  // parameters and gradients in host memory
  auto engine = OffloadEngine::Create(*config, {{"w", w.data(), w.size(), DType::kFp32}}, options);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  double first_loss = 0, loss = 0;
  std::vector<float> x(kIn), err(kOut);
  for (int step = 0; step < kSteps; ++step) {
    std::fill(grad.begin(), grad.end(), 0.0f);
    loss = 0;
    for (int b = 0; b < kBatch; ++b) {  // forward and backward of a batch, by hand
      for (float& v : x) v = normal(rng);
      for (int o = 0; o < kOut; ++o) {
        float y = 0, t = 0;
        for (int i = 0; i < kIn; ++i) {
          y += w[o * kIn + i] * x[i];
          t += target[o * kIn + i] * x[i];
        }
        err[o] = y - t;
        loss += 0.5 * err[o] * err[o] / kBatch;
      }
      for (int o = 0; o < kOut; ++o) {
        for (int i = 0; i < kIn; ++i) grad[o * kIn + i] += err[o] * x[i] / kBatch;
      }
    }
    if (step == 0) first_loss = loss;
    if (Status s = (*engine)->GradientReady("w", grad.data(), grad.size(), DType::kFp32); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    auto stats = (*engine)->Step();  // updates w in place
    if (!stats.ok()) {
      std::fprintf(stderr, "%s\n", stats.status().ToString().c_str());
      return 1;
    }
    if (step % 50 == 0 || step == kSteps - 1) {
      std::printf("step %3d  loss %.6f  grad norm %.4f  %.2f ms\n", step, loss, stats->grad_norm,
                  1e3 * stats->seconds);
    }
  }
  return loss < first_loss / 100 ? 0 : 1;
}
