// ZeRO from C++: the ranks of one run are processes on this machine, each with its own batch;
// each rank keeps 1/N of the optimizer state (and at stage 3 of the parameters). The model is
// y = W x + b fitted by AdamW, gradients written by hand (host memory, no GPU needed).
//
//   build/default/examples/zero_host --ranks 3 [--stage 1|2|3]    launches 3 ranks of itself
//   RANK=r WORLD_SIZE=n ZOFFLOAD_RUN_ID=name zero_host [--stage S]  one rank (as a launcher
//                                                                   such as torchrun starts it)
// Exits 1 unless every rank's loss falls below a hundredth of its start.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "zoffload/zero.h"

namespace {

using namespace zoffload;

constexpr int kIn = 32, kOut = 8, kBatch = 16, kSteps = 200;

int Fail(const Status& s) {
  std::fprintf(stderr, "%s\n", s.ToString().c_str());
  return 1;
}

// One rank's training; prints its last loss and a checksum of the weights.
int Train(int stage) {
  auto rank = ZeroRank::FromEnvironment();
  if (!rank.ok()) return Fail(rank.status());
  auto config = ParseConfig(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
      "zero_optimization": {"stage": )" +
                                std::to_string(stage) + R"(,
        "reduce_bucket_size": 100, "offload_optimizer": {"device": "cpu"}}})",
                            {.world_size = rank->world});
  if (!config.ok()) return Fail(config.status());
  std::vector<float> w(kIn * kOut, 0.0f), b(kOut, 0.0f), gw(w.size()), gb(b.size());
  auto zero = ZeroOptimizer::Create(*config,
                                    {{"w", w.data(), w.size(), DType::kFp32, nullptr, 0, {8, 32}},
                                     {"b", b.data(), b.size(), DType::kFp32}},
                                    *rank);
  if (!zero.ok()) return Fail(zero.status());
  ZeroOptimizer& z = **zero;
  std::mt19937 truth(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> target(w.size());
  for (float& t : target) t = normal(truth);
  double first_loss = 0, loss = 0;
  std::vector<float> x(kIn), err(kOut);
  for (int step = 0; step < kSteps; ++step) {
    if (stage == 3) {  // this rank keeps only its partition: gather before use
      if (Status s = z.GatherParameter("w", w.data()); !s.ok()) return Fail(s);
      if (Status s = z.GatherParameter("b", b.data()); !s.ok()) return Fail(s);
    }
    std::mt19937 rng(static_cast<uint32_t>(step * 1000 + rank->rank));  // this rank's batch
    std::fill(gw.begin(), gw.end(), 0.0f);
    std::fill(gb.begin(), gb.end(), 0.0f);
    loss = 0;
    for (int n = 0; n < kBatch; ++n) {
      for (float& v : x) v = normal(rng);
      for (int o = 0; o < kOut; ++o) {
        float y = b[o], t = 0;
        for (int i = 0; i < kIn; ++i) {
          y += w[o * kIn + i] * x[i];
          t += target[o * kIn + i] * x[i];
        }
        err[o] = y - t;
        loss += 0.5 * err[o] * err[o] / kBatch;
        gb[o] += err[o] / (kBatch * rank->world);  // the mean over every rank's batch
        for (int i = 0; i < kIn; ++i) gw[o * kIn + i] += err[o] * x[i] / (kBatch * rank->world);
      }
    }
    if (step == 0) first_loss = loss;
    if (Status s = z.GradientReady("b", gb.data(), gb.size(), DType::kFp32); !s.ok())
      return Fail(s);
    if (Status s = z.GradientReady("w", gw.data(), gw.size(), DType::kFp32); !s.ok())
      return Fail(s);
    auto stats = z.Step();  // stages 1-2: w and b now hold the new values on every rank
    if (!stats.ok()) return Fail(stats.status());
  }
  double sum = 0;
  for (float v : w) sum += v;
  std::printf(
      "rank %d of %d, stage %d: loss %.3g -> %.3g, state of %llu of %zu elements here, "
      "weights' sum %.9g\n",
      rank->rank, rank->world, stage, first_loss, loss,
      static_cast<unsigned long long>(z.owned_elements()), w.size() + b.size(), sum);
  return loss < first_loss / 100 ? 0 : 1;
}

// Starts `ranks` copies of this program as the ranks of one run; 0 if all succeed.
int Launch(const char* self, int ranks, int stage) {
  const std::string run = "zero-host-" + std::to_string(::getpid());
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      ::setenv("ZOFFLOAD_RUN_ID", run.c_str(), 1);
      const std::string stage_arg = std::to_string(stage);
      ::execl(self, self, "--stage", stage_arg.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed += WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 0, stage = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--stage") == 0) stage = std::atoi(argv[i + 1]);
  }
  if (ranks > 0) return Launch(argv[0], ranks, stage);
  return Train(stage);
}
