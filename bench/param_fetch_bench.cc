// Stage 3 with offload_param "nvme" in one process (zoffload::ZeroOptimizer at world size 1):
// how much of the parameters' NVMe reads the read-ahead hides under the model's compute.
//
// A model of L layers of S bf16 elements. Each step runs a forward (gather a layer, then `ms`
// of compute), a backward in reverse (gather the layer again, 2 x `ms`, hand its gradient
// over) and the update. The compute is a sleep: a GPU's, which leaves the host's cores free.
// Measured in the same run, each from the second step (the read-ahead follows the last step's
// order) as the median of the timed steps:
//   - compute alone: the same sleeps, no gathers;
//   - forward + backward with the read-ahead (stage3_prefetch_bucket_size: 2 layers) and
//     without it (0), and of it the time blocked in gathers: the fetch's exposed time;
//   - the same with a cache of every layer: the time blocked is the gathers' copies alone,
//     and what the runs above block beyond it is the NVMe part;
//   - the disk alone (bench/disk_probe.h, the step profile's anchor): a pass of the values'
//     bytes read from a file in the same directory through the I/O engine (the fetch's bound
//     per pass of the gathers).
// Prints the exposed fetch each way and the share of its NVMe part the read-ahead hides.
//
//   build/default/bench/param_fetch_bench DIR [layers 16] [MiB per layer 32] [ms per layer 20]
//                                         [cache in layers 4] [steps 3]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/disk_probe.h"
#include "common/strings.h"
#include "zoffload/config.h"
#include "zoffload/zero.h"

namespace {

using zoffload::DType;
using zoffload::Status;
using zoffload::internal::StrCat;
using zoffload::internal::bench::DiskProbe;
using zoffload::internal::bench::Median;
using zoffload::internal::bench::SecondsSince;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string dir;
  int layers = 16;
  uint64_t layer_mib = 32;
  int ms = 20;
  int cache_layers = 4;
  int steps = 3;
};

void Compute(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// Per step after the first: forward + backward seconds, of which blocked in gathers (the
// fetch's exposed time) and in gradient hand-overs, and the update's seconds. Gathers and
// hand-overs only when `zero` is given.
struct Timed {
  std::vector<double> passes, gathers, handovers, updates;
};

zoffload::Result<Timed> Train(const Args& a, zoffload::ZeroOptimizer* zero) {
  const uint64_t n = a.layer_mib << 19;              // bf16 elements per layer
  std::vector<uint16_t> values(n), grad(n, 0x3c00);  // the gradient: bf16 1.0
  Timed t;
  for (int step = 0; step <= a.steps; ++step) {
    double gathers = 0, handovers = 0;
    auto gather = [&](int l) -> Status {
      const auto start = Clock::now();
      if (zero != nullptr) ZO_RETURN_IF_ERROR(zero->GatherParameter(StrCat("l", l), values.data()));
      gathers += SecondsSince(start);
      return Status::Ok();
    };
    const auto start = Clock::now();
    for (int l = 0; l < a.layers; ++l) {
      ZO_RETURN_IF_ERROR(gather(l));
      Compute(a.ms);
    }
    for (int l = a.layers - 1; l >= 0; --l) {
      ZO_RETURN_IF_ERROR(gather(l));
      Compute(2 * a.ms);
      const auto handover = Clock::now();
      if (zero != nullptr) {
        ZO_RETURN_IF_ERROR(zero->GradientReady(StrCat("l", l), grad.data(), n, DType::kBf16));
      }
      handovers += SecondsSince(handover);
    }
    const double pass = SecondsSince(start);
    const auto update = Clock::now();
    if (zero != nullptr) ZO_RETURN_IF_ERROR(zero->Step().status());
    if (step > 0) {
      t.passes.push_back(pass);
      t.gathers.push_back(gathers);
      t.handovers.push_back(handovers);
      t.updates.push_back(SecondsSince(update));
    }
  }
  return t;
}

zoffload::Result<Timed> TrainOnNvme(const Args& a, uint64_t prefetch_elements, int run) {
  const uint64_t n = a.layer_mib << 19;
  const std::string nvme = StrCat(a.dir, "/param-fetch-", ::getpid(), "-", run);
  std::filesystem::create_directories(nvme);
  const std::string json = StrCat(
      R"({"bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": )",
      n, R"(, "stage3_prefetch_bucket_size": )", prefetch_elements,
      R"(, "offload_optimizer": {"device": "cpu"},
          "offload_param": {"device": "nvme", "nvme_path": ")",
      nvme, R"(", "max_in_cpu": )", static_cast<uint64_t>(a.cache_layers) * n, "}}}");
  ZO_ASSIGN_OR_RETURN(zoffload::Config config, zoffload::ParseConfig(json));
  std::vector<uint16_t> init(n, 0x3f80);
  std::vector<zoffload::ParameterSpec> specs;
  for (int l = 0; l < a.layers; ++l) {
    specs.push_back({.name = StrCat("l", l), .data = init.data(), .elements = n});
  }
  zoffload::ZeroRank rank;
  rank.run = StrCat("param-fetch-", ::getpid(), "-", run);
  zoffload::Result<Timed> timed = [&]() -> zoffload::Result<Timed> {
    ZO_ASSIGN_OR_RETURN(auto zero, zoffload::ZeroOptimizer::Create(config, specs, rank));
    return Train(a, zero.get());
  }();
  std::filesystem::remove_all(nvme);
  return timed;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "param_fetch_bench: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: param_fetch_bench DIR [layers 16] [MiB per layer 32] [ms per layer 20] "
                 "[cache in layers 4] [steps 3]\n");
    return 2;
  }
  Args a;
  a.dir = argv[1];
  if (argc > 2) a.layers = std::max(2, std::atoi(argv[2]));
  if (argc > 3) a.layer_mib = std::max(1, std::atoi(argv[3]));
  if (argc > 4) a.ms = std::max(0, std::atoi(argv[4]));
  if (argc > 5) a.cache_layers = std::max(1, std::atoi(argv[5]));
  if (argc > 6) a.steps = std::max(1, std::atoi(argv[6]));
  const uint64_t n = a.layer_mib << 19;
  std::printf(
      "%d layers of %llu MiB (bf16) on NVMe in %s, host cache %d layers, %d ms of compute "
      "per layer and pass; %d timed steps\n",
      a.layers, static_cast<unsigned long long>(a.layer_mib), a.dir.c_str(), a.cache_layers, a.ms,
      a.steps);
  auto compute = Train(a, nullptr);
  if (!compute.ok()) return Fail(compute.status());
  auto ahead = TrainOnNvme(a, 2 * n, 0);
  if (!ahead.ok()) return Fail(ahead.status());
  auto none = TrainOnNvme(a, 0, 1);
  if (!none.ok()) return Fail(none.status());
  Args cached = a;
  cached.cache_layers = a.layers;  // every value stays in host memory: the gathers' copies alone
  auto floor = TrainOnNvme(cached, 2 * n, 2);
  if (!floor.ok()) return Fail(floor.status());
  const uint64_t pass_bytes = static_cast<uint64_t>(a.layers) * (a.layer_mib << 20);
  auto disk = DiskProbe::Create(a.dir, zoffload::AioConfig{}, pass_bytes, false);
  if (!disk.ok()) return Fail(disk.status());
  const double read_gbps = (*disk)->read_gbps();
  const double c = Median(compute->passes), with = Median(ahead->gathers),
               without = Median(none->gathers);
  std::printf("compute alone (forward + backward)       %7.3f s\n", c);
  std::printf(
      "with the read-ahead: fwd+bwd %7.3f s, blocked in gathers %.3f s, in hand-overs "
      "%.3f s, update %.3f s\n",
      Median(ahead->passes), with, Median(ahead->handovers), Median(ahead->updates));
  std::printf(
      "without (stage3_prefetch_bucket_size 0): fwd+bwd %7.3f s, blocked in gathers "
      "%.3f s, in hand-overs %.3f s, update %.3f s\n",
      Median(none->passes), without, Median(none->handovers), Median(none->updates));
  std::printf(
      "the disk alone: one pass of the values   %7.3f s (%.2f GB/s; a step gathers "
      "each layer twice)\n",
      static_cast<double>(pass_bytes) / (read_gbps * 1e9), read_gbps);
  const double copies = Median(floor->gathers);
  std::printf("every value in the cache: blocked in gathers %.3f s (their copies alone)\n", copies);
  if (without > copies) {
    std::printf(
        "the read-ahead hides %.0f %% of the fetch's NVMe time (blocked beyond the copies: "
        "%.3f s instead of %.3f s)\n",
        100.0 * (1.0 - std::max(0.0, with - copies) / (without - copies)),
        std::max(0.0, with - copies), without - copies);
  }
  return 0;
}
