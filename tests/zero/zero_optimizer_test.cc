// ZeroOptimizer over HostComm, real processes: a small MLP trained 20 steps at ZeRO stages 1, 2
// and 3 with world sizes 2, 4 and 8 ends bit-identical (losses, norms, parameters, fp32
// masters) to world size 1 taking the same micro-batches as accumulation steps — with clipping
// on, uneven partitions (4 tensors of 91, 13, 13 and 1 elements; 8 ranks; ranks that own
// nothing) and buckets that cut tensors. World size 1 equals the OffloadEngine (host mode). A
// rank that dies mid-step makes the others fail, naming it, within the timeout. Bad calls get
// clear errors. Over NCCL (ZeroNcclTest, gpu-labelled): world size 1 equals the engine, and two
// GPUs give the bits of one (skipped, saying what they need, where the GPUs are missing).
//
// Every run is in child processes: the parent never starts OpenMP (or CUDA), which a forked
// child could not use.
#include "engine/zero_optimizer.h"

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "build_info.h"
#include "common/bad_configs.h"
#include "common/strings.h"
#include "engine/param_math.h"
#include "test_util.h"
#include "zero/host_comm.h"
#include "zero/ranks.h"
#include "zoffload/engine.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "zero/nccl_communicator.h"
#endif

namespace zoffload::internal::zero {
namespace {

using internal::testing::TempDir;
using testing::RunRanks;
using testing::SegmentName;

constexpr int kIn = 7, kHidden = 13, kBatch = 4, kSteps = 20;
const std::vector<std::string> kNames = {"w1", "b1", "w2", "b2"};
const std::vector<uint64_t> kSizes = {kHidden * kIn, kHidden, kHidden, 1};

// y = w2 . tanh(w1 x + b1) + b2, loss 0.5 (y - t)^2 averaged over the batch. Parameters are read
// as floats from their dtype; gradients go out in that dtype.
struct Mlp {
  DType dtype;
  std::vector<std::vector<float>> values;  // as floats, per tensor

  void Load(int t, const void* data) {
    values[t].resize(kSizes[t]);
    Accumulate(values[t].data(), data, dtype, kSizes[t], false);
  }

  // Micro-batch `micro` of step `step`: its loss, and the gradients (dtype bytes per tensor).
  float Backward(int step, int micro, std::vector<std::vector<std::byte>>* grads) const {
    std::mt19937 rng(static_cast<uint32_t>(1000 * step + micro));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<std::vector<float>> g(4);
    for (int t = 0; t < 4; ++t) g[t].assign(kSizes[t], 0.0f);
    float loss = 0;
    for (int s = 0; s < kBatch; ++s) {
      float x[kIn], h[kHidden];
      float sum = 0;
      for (float& v : x) sum += (v = u(rng));
      const float target = std::sin(sum);
      float y = values[3][0];
      for (int j = 0; j < kHidden; ++j) {
        float a = values[1][j];
        for (int i = 0; i < kIn; ++i) a += values[0][j * kIn + i] * x[i];
        h[j] = std::tanh(a);
        y += values[2][j] * h[j];
      }
      const float dy = (y - target) / kBatch;
      loss += 0.5f * (y - target) * (y - target) / kBatch;
      g[3][0] += dy;
      for (int j = 0; j < kHidden; ++j) {
        g[2][j] += dy * h[j];
        const float da = dy * values[2][j] * (1 - h[j] * h[j]);
        g[1][j] += da;
        for (int i = 0; i < kIn; ++i) g[0][j * kIn + i] += da * x[i];
      }
    }
    grads->resize(4);
    for (int t = 0; t < 4; ++t) {
      (*grads)[t].resize(kSizes[t] * DTypeBytes(dtype));
      CastFromFloat(g[t].data(), (*grads)[t].data(), dtype, kSizes[t]);
    }
    return loss;
  }
};

// The initial parameters (seed 0), in `dtype`.
std::vector<std::vector<std::byte>> InitialValues(DType dtype) {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 0.4f);
  std::vector<std::vector<std::byte>> out;
  for (uint64_t n : kSizes) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    out.emplace_back(n * DTypeBytes(dtype));
    CastFromFloat(v.data(), out.back().data(), dtype, n);
  }
  return out;
}

// The four parameters over `values` (InitialValues' of `dtype`).
std::vector<ParameterSpec> Specs(std::vector<std::vector<std::byte>>& values, DType dtype) {
  std::vector<ParameterSpec> specs;
  for (int t = 0; t < 4; ++t) specs.push_back({kNames[t], values[t].data(), kSizes[t], dtype});
  return specs;
}

// How one rank trains: its world, the stage, and what the config sets.
struct RankRun {
  std::string segment;  // the HostComm segment; with `nccl`, the file of the NCCL unique id
  bool nccl = false;    // NcclCommunicator, rank r on GPU r, instead of HostComm
  int world = 1, stage = 1;
  int accumulation = 1;  // micro-batches per rank and step
  DType dtype = DType::kFp32;
  std::string state = "fp32";
  std::string nvme;  // offload_optimizer nvme into this directory; empty: cpu
  // Stage 3: offload_param nvme into this directory (empty: cpu), with max_in_cpu elements.
  std::string param_nvme;
  int max_in_cpu = 0;
  double clipping = 0.05;
  std::string overlap = "none";  // zoffload.overlap
  int die_at_step = -1;          // rank world - 1 exits after its first gradient of that step
  std::string out;               // the record's file
  // Checkpoints: load this first (and train steps first_step ...), save this at the end.
  std::string load, save;
  int first_step = 0, steps = kSteps;
  bool damaged = false;  // `load` is damaged: Load must fail on every rank and change nothing
};

std::string ConfigJson(const RankRun& run) {
  const std::string device =
      run.nvme.empty() ? R"("cpu")" : StrCat(R"("nvme", "nvme_path": ")", run.nvme, R"(")");
  const std::string params =
      run.param_nvme.empty() ? ""
                             : StrCat(R"(, "offload_param": {"device": "nvme", "nvme_path": ")",
                                      run.param_nvme, R"(", "max_in_cpu": )", run.max_in_cpu, "}");
  return StrCat(R"({"gradient_accumulation_steps": )", run.accumulation,
                R"(, "gradient_clipping": )", run.clipping, R"(,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
    "zero_optimization": {"stage": )",
                run.stage, R"(, "reduce_bucket_size": 40,
      "offload_optimizer": {"device": )",
                device, "}", params, R"(},
    "zoffload": {"cpu_adam_threads": 1, "optimizer_state": ")",
                run.state, R"(", "overlap": ")", run.overlap, R"("}})");
}

// What a run records: per step, every micro-batch's loss (in global micro-batch order) and the
// norm; at the end every parameter's values and fp32 master.
struct Record {
  std::vector<float> losses;
  std::vector<double> norms;
  std::vector<float> clips;
  std::vector<std::byte> values;
  std::vector<float> masters;
  bool operator==(const Record&) const = default;
};

void WriteRecord(const std::string& path, const Record& r) {
  std::ofstream out(path, std::ios::binary);
  auto put = [&](const auto& v) {
    const uint64_t n = v.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(reinterpret_cast<const char*>(v.data()),
              static_cast<std::streamsize>(n * sizeof(v[0])));
  };
  put(r.losses);
  put(r.norms);
  put(r.clips);
  put(r.values);
  put(r.masters);
}

Record ReadRecord(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  Record r;
  auto get = [&](auto& v) {
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    v.resize(n);
    in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(v[0])));
  };
  get(r.losses);
  get(r.norms);
  get(r.clips);
  get(r.values);
  get(r.masters);
  return r;
}

#if ZO_HAVE_CUDA
// Rank `rank`'s NCCL communicator on GPU `rank`: rank 0 writes the unique id to run.segment
// (whole, by a rename), the others wait for it.
Result<std::unique_ptr<Communicator>> MakeNcclComm(const RankRun& run, int rank) {
  if (const cudaError_t e = cudaSetDevice(rank); e != cudaSuccess) {
    return Status(StatusCode::kUnavailable, StrCat("GPU ", rank, ": ", cudaGetErrorString(e)));
  }
  std::string hex;
  if (rank == 0) {
    ZO_ASSIGN_OR_RETURN(NcclUniqueId id, NcclUniqueId::Create());
    hex = id.ToHex();
    std::ofstream(run.segment + ".tmp") << hex;
    std::filesystem::rename(run.segment + ".tmp", run.segment);
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!(std::ifstream(run.segment) >> hex)) {
      if (std::chrono::steady_clock::now() > deadline) {
        return Status(StatusCode::kUnavailable, "no NCCL unique id from rank 0 within 60 s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ZO_ASSIGN_OR_RETURN(NcclUniqueId id, NcclUniqueId::FromHex(hex));
  ZO_ASSIGN_OR_RETURN(NcclComm nccl, NcclComm::Init(run.world, rank, id));
  NcclCommunicator::Options o;
  o.chunk_bytes = 64 * 4 * static_cast<uint64_t>(run.world);  // smaller than a bucket: chunks
  ZO_ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(std::move(nccl), o));
  return std::unique_ptr<Communicator>(std::move(comm));
}
#endif

Result<std::unique_ptr<Communicator>> MakeComm(const RankRun& run, int rank) {
  if (run.nccl) {
#if ZO_HAVE_CUDA
    return MakeNcclComm(run, rank);
#else
    return Status(StatusCode::kUnimplemented, "built without CUDA: no NCCL");
#endif
  }
  HostComm::Options co;
  co.name = run.segment;
  co.rank = rank;
  co.world = run.world;
  co.region_bytes = 256;  // smaller than a bucket: the collectives go in chunks
  co.timeout = std::chrono::milliseconds(run.die_at_step >= 0 ? 1'000 : 30'000);
  ZO_ASSIGN_OR_RETURN(auto comm, HostComm::Create(co));
  return std::unique_ptr<Communicator>(std::move(comm));
}

// Trains kSteps steps as rank `rank` of run.world (each rank takes micro-batches
// rank x accumulation ... of every step); writes the rank's losses to run.out + ".rank<r>" and
// rank 0's whole record to run.out. Returns 0, or the exit code of a failure (its message on
// stderr, and in run.out + ".error<r>").
int Train(const RankRun& run, int rank) {
  const DType dtype = run.dtype;
  auto fail = [&](int code, const Status& s) {
    std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
    std::ofstream(StrCat(run.out, ".error", rank)) << s.ToString();
    return code;
  };
  auto comm = MakeComm(run, rank);
  if (!comm.ok()) return fail(10, comm.status());
  auto config = ParseConfig(ConfigJson(run));
  if (!config.ok()) return fail(11, config.status());
  std::vector<std::vector<std::byte>> values = InitialValues(dtype);
  std::vector<ParameterSpec> specs = Specs(values, dtype);
  auto zero = ZeroAccess::Create(*config, specs, **comm);
  if (!zero.ok()) return fail(12, zero.status());
  ZeroOptimizer& z = **zero;
  const int stage = run.stage, accumulation = run.accumulation;
  auto masters = [&](std::vector<float>* all) {
    all->clear();
    for (int t = 0; t < 4; ++t) {
      std::vector<float> master(kSizes[t]);
      ZO_RETURN_IF_ERROR(z.GatherMaster(kNames[t], master.data()));
      all->insert(all->end(), master.begin(), master.end());
    }
    return Status::Ok();
  };
  if (!run.load.empty()) {
    std::vector<float> before, after;
    if (Status s = masters(&before); !s.ok()) return fail(19, s);
    const Status loaded = z.Load(run.load);
    if (run.damaged) {  // refused on every rank, nothing changed
      if (loaded.ok()) return 20;
      if (Status s = masters(&after); !s.ok()) return fail(21, s);
      std::ofstream(StrCat(run.out, ".error", rank)) << loaded.ToString();
      return after == before ? 0 : 22;
    }
    if (!loaded.ok()) return fail(23, loaded);
  }
  Mlp model{dtype, std::vector<std::vector<float>>(4)};
  Record record;
  int in_place = 0;  // gradients written into the optimizer's memory
  for (int step = run.first_step; step < run.first_step + run.steps; ++step) {
    for (int a = 0; a < accumulation; ++a) {
      for (int t = 0; t < 4; ++t) {
        if (stage == 3) {
          std::vector<std::byte> gathered(kSizes[t] * DTypeBytes(dtype));
          const Status s = z.GatherParameter(kNames[t], gathered.data());
          if (!s.ok()) return fail(13, s);
          model.Load(t, gathered.data());
        } else {
          model.Load(t, values[t].data());
        }
      }
      std::vector<std::vector<std::byte>> grads;
      record.losses.push_back(model.Backward(step, rank * accumulation + a, &grads));
      for (int t = 3; t >= 0; --t) {  // backward order
        // Where the optimizer offers its own memory (one rank, one micro-batch, stages 2-3),
        // the gradient is written there and taken in place.
        auto buffer = z.GradientBuffer(kNames[t]);
        if (!buffer.ok()) return fail(24, buffer.status());
        const void* grad = grads[t].data();
        if (*buffer != nullptr) {
          if (run.world > 1 || accumulation > 1 || stage == 1) {
            return fail(25, FailedPreconditionError("a gradient buffer where sums are needed"));
          }
          grad = std::memcpy(*buffer, grad, grads[t].size());
          ++in_place;
        }
        const Status s = z.GradientReady(kNames[t], grad, kSizes[t], dtype);
        if (!s.ok()) return fail(14, s);
        if (step == run.die_at_step && rank == run.world - 1) ::_exit(0);
      }
    }
    auto stats = z.Step();
    if (!stats.ok()) return fail(16, stats.status());
    record.norms.push_back(stats->grad_norm);
    record.clips.push_back(stats->clip_coef);
  }
  if (run.world == 1 && accumulation == 1 && stage > 1 && in_place == 0) {
    return fail(26, FailedPreconditionError("one rank took no gradient in place"));
  }
  for (int t = 0; t < 4; ++t) {
    if (stage == 3) {  // the optimizer's values; at stages 1-2 the step wrote them here
      const Status s = z.GatherParameter(kNames[t], values[t].data());
      if (!s.ok()) return fail(17, s);
    }
    const void* now = values[t].data();
    const auto* bytes = static_cast<const std::byte*>(now);
    record.values.insert(record.values.end(), bytes, bytes + kSizes[t] * DTypeBytes(dtype));
    std::vector<float> master(kSizes[t]);
    const Status s = z.GatherMaster(kNames[t], master.data());
    if (!s.ok()) return fail(18, s);
    record.masters.insert(record.masters.end(), master.begin(), master.end());
  }
  if (!run.save.empty()) {
    if (Status s = z.Save(run.save); !s.ok()) return fail(24, s);
  }
  WriteRecord(StrCat(run.out, ".rank", rank),
              Record{record.losses, record.norms, record.clips, {}, {}});
  if (rank == 0) WriteRecord(run.out, record);
  return 0;
}

struct Case {
  int stage;
  DType dtype;
  const char* state;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "stage " << c.stage << ", " << ToString(c.dtype) << " parameters, " << c.state << " state";
}

class ZeroWorldTest : public ::testing::TestWithParam<Case> {};

// World size N (one micro-batch per rank) against world size 1 taking the N micro-batches as
// accumulation steps: the same bits, every stage.
// World size `world` (one micro-batch per rank; over NCCL with `nccl`) against world size 1
// (HostComm) taking the micro-batches as accumulation steps: the same bits.
void ExpectWorldGivesTheBitsOfOne(const Case& c, int world, bool nccl) {
  TempDir dir;
  RankRun ref;
  ref.segment = SegmentName(StrCat("ref", world));
  ref.stage = c.stage;
  ref.accumulation = world;
  ref.dtype = c.dtype;
  ref.state = c.state;
  ref.out = dir.File(StrCat("ref", world));
  RankRun got = ref;
  got.segment = nccl ? dir.File("nccl_id") : SegmentName(StrCat("w", world));
  got.nccl = nccl;
  got.world = world;
  got.accumulation = 1;
  got.out = dir.File(StrCat("got", world));
  ASSERT_EQ(RunRanks(1, [&](int r) { return Train(ref, r); }), std::vector<int>{0});
  ASSERT_EQ(RunRanks(world, [&](int r) { return Train(got, r); }), std::vector<int>(world, 0));
  const Record want = ReadRecord(ref.out), have = ReadRecord(got.out);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps * world));
  EXPECT_EQ(have.norms, want.norms) << "world " << world;
  EXPECT_EQ(have.clips, want.clips) << "world " << world;
  EXPECT_TRUE(have.values == want.values) << "world " << world;
  EXPECT_TRUE(have.masters == want.masters) << "world " << world;
  // Every rank's losses are world 1's of the same micro-batches.
  for (int r = 0; r < world; ++r) {
    const Record rank = ReadRecord(StrCat(got.out, ".rank", r));
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_EQ(rank.losses[step], want.losses[step * world + r])
          << "world " << world << " rank " << r << " step " << step;
    }
  }
  // Clipping was on for a part of the run, and training moved the loss.
  EXPECT_LT(*std::min_element(want.clips.begin(), want.clips.end()), 1.0f);
  EXPECT_LT(want.losses.back(), want.losses.front());
}

TEST_P(ZeroWorldTest, WorldSizesGiveTheBitsOfWorldSizeOne) {
  for (int world : {2, 4, 8}) ExpectWorldGivesTheBitsOfOne(GetParam(), world, false);
}

INSTANTIATE_TEST_SUITE_P(
    Stages, ZeroWorldTest,
    ::testing::Values(Case{1, DType::kFp32, "fp32"}, Case{2, DType::kFp32, "fp32"},
                      Case{3, DType::kFp32, "fp32"}, Case{1, DType::kBf16, "bf16"},
                      Case{2, DType::kBf16, "fp32"}, Case{3, DType::kBf16, "bf16"}),
    [](const auto& param_info) {
      return StrCat("stage", param_info.param.stage, "_", ToString(param_info.param.dtype), "_",
                    param_info.param.state, "_state");
    });

// At one rank with one micro-batch, stages 2 and 3 keep each gradient as given (bf16: half the
// memory of fp32 sums) where stage 1 keeps fp32 sums: the same bits, clipping on.
TEST(ZeroOptimizerTest, OneRankKeepsGradientsAsGivenWithTheBitsOfSums) {
  for (DType dtype : {DType::kBf16, DType::kFp32}) {
    TempDir dir;
    RankRun sums;
    sums.dtype = dtype;
    sums.state = "bf16";
    sums.segment = SegmentName(StrCat("sums", ToString(dtype)));
    sums.out = dir.File("sums");
    ASSERT_EQ(RunRanks(1, [&](int r) { return Train(sums, r); }), std::vector<int>{0});
    const Record want = ReadRecord(sums.out);
    EXPECT_LT(*std::min_element(want.clips.begin(), want.clips.end()), 1.0f);
    for (int stage : {2, 3}) {
      RankRun given = sums;
      given.stage = stage;
      given.segment = SegmentName(StrCat("given", stage, ToString(dtype)));
      given.out = dir.File(StrCat("given", stage));
      ASSERT_EQ(RunRanks(1, [&](int r) { return Train(given, r); }), std::vector<int>{0});
      EXPECT_TRUE(ReadRecord(given.out) == want) << "stage " << stage << ", " << ToString(dtype);
    }
  }
}

// Optimizer state on NVMe: each rank swaps into its own subdirectory, with the bits of host state.
TEST(ZeroOptimizerTest, NvmeStateGivesTheBitsOfHostState) {
  TempDir dir;
  RankRun host;
  host.segment = SegmentName("host");
  host.world = 2;
  host.stage = 2;
  host.out = dir.File("host");
  RankRun nvme = host;
  nvme.segment = SegmentName("nvme");
  nvme.nvme = dir.path();
  nvme.out = dir.File("nvme");
  ASSERT_EQ(RunRanks(2, [&](int r) { return Train(host, r); }), (std::vector<int>{0, 0}));
  ASSERT_EQ(RunRanks(2, [&](int r) { return Train(nvme, r); }), (std::vector<int>{0, 0}));
  EXPECT_TRUE(ReadRecord(nvme.out) == ReadRecord(host.out));
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("rank0")));
  EXPECT_TRUE(std::filesystem::is_directory(dir.File("rank1")));
}

// Stage 3 with offload_param nvme: each rank's values live on NVMe behind a host cache of
// max_in_cpu elements (here smaller than the partition, so spans are evicted, written back and
// read again, ahead of use from the second step), with the bits of the values in host memory,
// at world sizes 1 to 4, with optimizer state in host memory or on NVMe too.
TEST(ZeroOptimizerTest, ParametersOnNvmeGiveTheBitsOfHostParameters) {
  for (const bool state_on_nvme : {false, true}) {
    for (int world : {1, 2, 4}) {
      TempDir dir;
      RankRun host;
      host.segment = SegmentName(StrCat("ph", world));
      host.world = world;
      host.stage = 3;
      host.dtype = DType::kBf16;
      host.state = "bf16";
      host.steps = 6;
      host.out = dir.File("host");
      RankRun nvme = host;
      nvme.segment = SegmentName(StrCat("pn", world));
      nvme.param_nvme = dir.path();
      nvme.max_in_cpu = 48;
      if (state_on_nvme) nvme.nvme = dir.path();
      nvme.out = dir.File("nvme");
      ASSERT_EQ(RunRanks(world, [&](int r) { return Train(host, r); }), std::vector<int>(world, 0));
      ASSERT_EQ(RunRanks(world, [&](int r) { return Train(nvme, r); }), std::vector<int>(world, 0));
      EXPECT_TRUE(ReadRecord(nvme.out) == ReadRecord(host.out))
          << "world " << world << (state_on_nvme ? ", state on NVMe" : "");
    }
  }
}

// Rank 2 of 3 dies after its first gradient of step 3: the others fail within the timeout
// with an error that names it (or says another rank gave up), and never hang.
TEST(ZeroOptimizerTest, ARankThatDiesIsAClearErrorNotAHang) {
  TempDir dir;
  for (int stage : {1, 2, 3}) {
    const auto start = std::chrono::steady_clock::now();
    RankRun run;
    run.segment = SegmentName(StrCat("dead", stage));
    run.world = 3;
    run.stage = stage;
    run.die_at_step = 3;
    run.out = dir.File(StrCat("dead", stage));
    const std::vector<int> codes = RunRanks(3, [&](int r) { return Train(run, r); });
    EXPECT_EQ(codes[2], 0) << "stage " << stage;
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(codes[r], 0) << "stage " << stage << " rank " << r;
      std::ifstream in(StrCat(run.out, ".error", r));
      const std::string error{std::istreambuf_iterator<char>(in), {}};
      EXPECT_TRUE(error.find("rank(s) 2 did not reach barrier") != std::string::npos ||
                  error.find("CANCELLED") != std::string::npos)
          << "stage " << stage << " rank " << r << ": " << error;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  }
}

// World size 1 updates as the OffloadEngine does (host mode, no clipping: the engine's float64
// norm and the exact one may differ in their last bits, which only clipping would see).
// ZeroOptimizer at world size 1 (over NCCL with `nccl`) against the OffloadEngine: the same bits.
void ExpectWorldOneEqualsTheEngine(bool nccl) {
  TempDir dir;
  for (int stage : {1, 2, 3}) {
    RankRun zero;
    zero.segment = nccl ? dir.File(StrCat("nccl_id", stage)) : SegmentName(StrCat("one", stage));
    zero.nccl = nccl;
    zero.stage = stage;
    zero.dtype = DType::kBf16;
    zero.state = "bf16";
    zero.clipping = 0;
    zero.out = dir.File(StrCat("zero", stage));
    ASSERT_EQ(RunRanks(1, [&](int r) { return Train(zero, r); }), std::vector<int>{0});
    const std::string engine_out = dir.File("engine");
    const std::vector<int> code = RunRanks(1, [&](int) {
      auto config = ParseConfig(ConfigJson(zero));
      if (!config.ok()) return 1;
      std::vector<std::vector<std::byte>> values = InitialValues(zero.dtype);
      std::vector<ParameterSpec> specs = Specs(values, zero.dtype);
      EngineOptions eo;
      eo.host_params = true;
      auto engine = OffloadEngine::Create(*config, specs, eo);
      if (!engine.ok()) return 2;
      Mlp model{zero.dtype, std::vector<std::vector<float>>(4)};
      Record record;
      for (int step = 0; step < kSteps; ++step) {
        for (int t = 0; t < 4; ++t) model.Load(t, values[t].data());
        std::vector<std::vector<std::byte>> grads;
        record.losses.push_back(model.Backward(step, 0, &grads));
        for (int t = 3; t >= 0; --t) {
          if (!(*engine)->GradientReady(kNames[t], grads[t].data(), kSizes[t], zero.dtype).ok())
            return 3;
        }
        if (!(*engine)->Step().ok()) return 4;
      }
      for (int t = 0; t < 4; ++t) {
        record.values.insert(record.values.end(), values[t].begin(), values[t].end());
        std::vector<float> master(kSizes[t]);
        std::vector<std::byte> m(AdamMomentBytes(StatePrecision::kBf16, kSizes[t])), v(m.size());
        if (!(*engine)->ReadState(kNames[t], master.data(), m.data(), v.data()).ok()) return 5;
        record.masters.insert(record.masters.end(), master.begin(), master.end());
      }
      WriteRecord(engine_out, record);
      return 0;
    });
    ASSERT_EQ(code, std::vector<int>{0});
    const Record want = ReadRecord(engine_out), have = ReadRecord(zero.out);
    EXPECT_EQ(have.losses, want.losses) << "stage " << stage;
    EXPECT_TRUE(have.values == want.values) << "stage " << stage;
    EXPECT_TRUE(have.masters == want.masters) << "stage " << stage;
  }
}

TEST(ZeroOptimizerTest, WorldSizeOneEqualsTheEngine) { ExpectWorldOneEqualsTheEngine(false); }

// zoffload.overlap "backward" and "auto" at two ranks (stage 2, clipping on part of the run):
// the updates run after backward, as "none" makes them: the same record, bit for bit.
TEST(ZeroOptimizerTest, OverlapBackwardAndAutoRunAsNone) {
  TempDir dir;
  RankRun none;
  none.world = 2;
  none.stage = 2;
  std::vector<Record> records;
  for (const char* overlap : {"none", "backward", "auto"}) {
    RankRun run = none;
    run.overlap = overlap;
    run.segment = SegmentName(StrCat("overlap_", overlap));
    run.out = dir.File(overlap);
    ASSERT_EQ(RunRanks(2, [&](int r) { return Train(run, r); }), std::vector<int>(2, 0)) << overlap;
    records.push_back(ReadRecord(run.out));
  }
  EXPECT_LT(*std::min_element(records[0].clips.begin(), records[0].clips.end()), 1.0f);
  EXPECT_TRUE(records[1] == records[0]);
  EXPECT_TRUE(records[2] == records[0]);
}

// Save at world size 2 after 10 steps, load, train 10 more: the bits of 20 steps straight, at
// every stage. The checkpoint is the OffloadEngine's format with whole parameters: world size 3
// and an OffloadEngine load it with the same masters, and world size 1 (accumulation 2) saves
// the same state.bin. A damaged copy is refused on every rank, changing nothing.
TEST(ZeroOptimizerTest, CheckpointsResumeBitIdenticallyAtAnyWorldSize) {
  TempDir dir;
  auto file = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE(StrCat("stage ", stage));
    const std::string tag = StrCat("s", stage);
    RankRun straight;
    straight.segment = SegmentName(tag + "straight");
    straight.world = 2;
    straight.stage = stage;
    straight.dtype = DType::kBf16;
    straight.state = "bf16";
    straight.out = dir.File(tag + "straight");
    RankRun first = straight;
    first.segment = SegmentName(tag + "first");
    first.steps = kSteps / 2;
    first.save = dir.File(tag + "ckpt");
    first.out = dir.File(tag + "first");
    RankRun second = straight;
    second.segment = SegmentName(tag + "second");
    second.load = first.save;
    second.first_step = kSteps / 2;
    second.steps = kSteps - kSteps / 2;
    second.out = dir.File(tag + "second");
    for (const RankRun* run : {&straight, &first, &second}) {
      ASSERT_EQ(RunRanks(2, [&](int r) { return Train(*run, r); }), (std::vector<int>{0, 0}));
    }
    const Record want = ReadRecord(straight.out), got = ReadRecord(second.out);
    EXPECT_TRUE(got.values == want.values);
    EXPECT_TRUE(got.masters == want.masters);
    EXPECT_EQ(got.norms, std::vector<double>(want.norms.begin() + kSteps / 2, want.norms.end()));
    if (stage == 3) {  // loaded into parameters on NVMe (a small cache): the run goes on the same
      RankRun on_nvme = second;
      on_nvme.segment = SegmentName(tag + "nvme");
      on_nvme.param_nvme = dir.File("pnvme");
      std::filesystem::create_directories(on_nvme.param_nvme);
      on_nvme.max_in_cpu = 48;
      on_nvme.out = dir.File(tag + "nvme");
      ASSERT_EQ(RunRanks(2, [&](int r) { return Train(on_nvme, r); }), (std::vector<int>{0, 0}));
      const Record resumed = ReadRecord(on_nvme.out);
      EXPECT_TRUE(resumed.values == want.values);
      EXPECT_TRUE(resumed.masters == want.masters);
    }
    // World size 3 loads it: the masters and values saved.
    RankRun three = first;
    three.segment = SegmentName(tag + "three");
    three.world = 3;
    three.load = first.save;
    three.save.clear();
    three.steps = 0;
    three.out = dir.File(tag + "three");
    ASSERT_EQ(RunRanks(3, [&](int r) { return Train(three, r); }), (std::vector<int>{0, 0, 0}));
    const Record saved = ReadRecord(first.out), loaded = ReadRecord(three.out);
    EXPECT_TRUE(loaded.masters == saved.masters);
    EXPECT_TRUE(loaded.values == saved.values);
    // World size 1 with accumulation 2 saves the same state.
    RankRun one = first;
    one.segment = SegmentName(tag + "one");
    one.world = 1;
    one.accumulation = 2;
    one.save = dir.File(tag + "ckpt1");
    one.out = dir.File(tag + "one");
    ASSERT_EQ(RunRanks(1, [&](int r) { return Train(one, r); }), std::vector<int>{0});
    EXPECT_EQ(file(one.save + "/state.bin"), file(first.save + "/state.bin"));
    // A damaged copy: refused by every rank, which keep their state.
    const std::string damaged = dir.File(tag + "damaged");
    std::filesystem::copy(first.save, damaged);
    {
      std::fstream f(damaged + "/state.bin", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(100);
      f.put('\x5a');
    }
    RankRun bad = three;
    bad.segment = SegmentName(tag + "bad");
    bad.world = 2;
    bad.load = damaged;
    bad.damaged = true;
    bad.out = dir.File(tag + "bad");
    ASSERT_EQ(RunRanks(2, [&](int r) { return Train(bad, r); }), (std::vector<int>{0, 0}));
    for (int r = 0; r < 2; ++r) {
      const std::string error = file(StrCat(bad.out, ".error", r));
      EXPECT_NE(error.find("DATA_LOSS"), std::string::npos) << error;
    }
  }
  // The OffloadEngine loads a ZeRO checkpoint.
  const std::vector<int> code = RunRanks(1, [&](int) {
    RankRun run;
    run.dtype = DType::kBf16;
    run.state = "bf16";
    auto config = ParseConfig(ConfigJson(run));
    if (!config.ok()) return 1;
    std::vector<std::vector<std::byte>> values = InitialValues(run.dtype);
    std::vector<ParameterSpec> specs = Specs(values, run.dtype);
    EngineOptions eo;
    eo.host_params = true;
    auto engine = OffloadEngine::Create(*config, specs, eo);
    if (!engine.ok() || !(*engine)->Load(dir.File("s2ckpt")).ok()) return 2;
    std::vector<float> all;
    for (int t = 0; t < 4; ++t) {
      std::vector<float> master(kSizes[t]);
      std::vector<std::byte> m(AdamMomentBytes(StatePrecision::kBf16, kSizes[t])), v(m.size());
      if (!(*engine)->ReadState(kNames[t], master.data(), m.data(), v.data()).ok()) return 3;
      all.insert(all.end(), master.begin(), master.end());
    }
    return all == ReadRecord(dir.File("s2first")).masters ? 0 : 4;
  });
  EXPECT_EQ(code, std::vector<int>{0});
}

// With zoffload.trace_path, each gather (the time the caller was blocked) and each step is a
// span of the trace, on tracks of their own.
TEST(ZeroOptimizerTest, GathersAndStepsAreOnTheTrace) {
  TempDir dir;
  const std::string path = dir.File("trace.json");
  const std::vector<int> code = RunRanks(1, [&](int) {
    RankRun run;
    run.stage = 3;
    auto config = ParseConfig(ConfigJson(run));
    if (!config.ok()) return 1;
    config->zoffload.trace_path = path;
    auto comm = HostComm::Create({.name = SegmentName("trace")});
    if (!comm.ok()) return 2;
    std::vector<std::vector<std::byte>> values = InitialValues(DType::kFp32);
    std::vector<ParameterSpec> specs = Specs(values, DType::kFp32);
    auto z = ZeroAccess::Create(*config, specs, **comm);
    if (!z.ok()) return 3;
    std::vector<float> buffer(kSizes[0]);
    for (int t = 0; t < 4; ++t) {
      if (!(*z)->GatherParameter(kNames[t], buffer.data()).ok()) return 4;
      std::vector<float> grad(kSizes[t], 0.5f);
      if (!(*z)->GradientReady(kNames[t], grad.data(), kSizes[t], DType::kFp32).ok()) return 5;
    }
    return (*z)->Step().ok() ? 0 : 6;  // the trace is written as the optimizer goes away
  });
  ASSERT_EQ(code, std::vector<int>{0});
  std::ifstream in(path);
  const auto trace = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(trace.is_object()) << path;
  std::map<int, std::string> tracks;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M") tracks[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
  }
  std::vector<std::string> gathered;
  int steps = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const std::string& track = tracks[e["tid"].get<int>()];
    if (track == "parameter gathers") gathered.push_back(e["name"].get<std::string>());
    if (track == "zero" && e["name"] == "step") ++steps;
  }
  EXPECT_EQ(gathered, std::vector<std::string>(kNames.begin(), kNames.end()));
  EXPECT_EQ(steps, 1);
}

// A Config built in code gets the parser's rules in Create: each value the parser refuses is
// refused here with its message (tests/common/bad_configs.h).
TEST(ZeroOptimizerTest, CreateRefusesEveryValueTheParserRefuses) {
  const std::vector<int> code = RunRanks(1, [&](int) {
    auto comm = HostComm::Create({.name = SegmentName("create")});
    if (!comm.ok()) return 100;
    std::vector<std::vector<std::byte>> values = InitialValues(DType::kFp32);
    const std::vector<ParameterSpec> specs = Specs(values, DType::kFp32);
    RankRun run;
    run.stage = 2;
    auto valid = ParseConfig(ConfigJson(run));
    if (!valid.ok() || !ZeroAccess::Create(*valid, specs, **comm).ok()) return 101;
    int failures = 0;
    for (const zoffload::testing::BadConfig& bad : zoffload::testing::BadConfigs()) {
      Config config = *valid;
      bad.change(config);
      const Status s = ZeroAccess::Create(config, specs, **comm).status();
      if (s.code() != StatusCode::kInvalidArgument ||
          s.message().find(bad.key) == std::string::npos) {
        std::fprintf(stderr, "%s: got %s\n", bad.key.c_str(), s.ToString().c_str());
        ++failures;
      }
    }
    return failures;
  });
  EXPECT_EQ(code, std::vector<int>{0});
}

// Bad calls and configs get errors that name what is wrong; nothing is updated by them.
TEST(ZeroOptimizerTest, BadInputIsAClearError) {
  const std::vector<int> code = RunRanks(1, [&](int) {
    int failures = 0;
    auto expect = [&](const Status& s, StatusCode want, const std::string& text) {
      if (s.code() != want || s.message().find(text) == std::string::npos) {
        std::fprintf(stderr, "want %s: got %s\n", text.c_str(), s.ToString().c_str());
        ++failures;
      }
    };
    auto comm = HostComm::Create({.name = SegmentName("bad")});
    if (!comm.ok()) return 100;
    std::vector<std::vector<std::byte>> values = InitialValues(DType::kFp32);
    std::vector<ParameterSpec> specs = Specs(values, DType::kFp32);
    auto with = [&](int stage, const std::string& extra = "") {
      RankRun run;
      run.stage = stage;
      std::string json = ConfigJson(run);
      if (!extra.empty()) json.insert(json.rfind('}'), StrCat(", ", extra));
      return ParseConfig(json);
    };
    auto config = with(0);
    if (config.ok()) {
      config->zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
      expect(ZeroAccess::Create(*config, specs, **comm).status(), StatusCode::kInvalidArgument,
             "zero_optimization.stage must be 1, 2 or 3");
    }
    auto mixed = specs;
    mixed[2].dtype = DType::kBf16;
    expect(ZeroAccess::Create(*with(2), mixed, **comm).status(), StatusCode::kInvalidArgument,
           "parameter 'w2' is bf16 but 'w1' is fp32");
    auto twice = specs;
    twice[3].name = "w1";
    expect(ZeroAccess::Create(*with(2), twice, **comm).status(), StatusCode::kInvalidArgument,
           "parameter 'w1' is given twice");
    auto delayed = with(2, R"("zoffload": {"overlap": "delayed"})");
    if (delayed.ok()) {
      expect(ZeroAccess::Create(*delayed, specs, **comm).status(), StatusCode::kInvalidArgument,
             "not \"delayed\"");
    }
    TempDir nvme;
    RankRun small_cache;
    small_cache.stage = 3;
    small_cache.param_nvme = nvme.path();
    small_cache.max_in_cpu = 10;
    expect(ZeroAccess::Create(*ParseConfig(ConfigJson(small_cache)), specs, **comm).status(),
           StatusCode::kInvalidArgument,
           "offload_param.max_in_cpu (10 elements) cannot hold 'w1' (40 elements of it on this "
           "rank)");
    auto z = ZeroAccess::Create(*with(2), specs, **comm);
    if (!z.ok()) return 101;
    std::vector<float> grad(kSizes[0], 0.5f);
    expect((*z)->GradientReady("w9", grad.data(), kSizes[0], DType::kFp32), StatusCode::kNotFound,
           "no parameter 'w9'");
    expect((*z)->GradientReady("w1", grad.data(), kSizes[0] - 1, DType::kFp32),
           StatusCode::kInvalidArgument, "'w1': 90 fp32 elements");
    expect((*z)->GradientReady("w1", grad.data(), kSizes[0] - 1, DType::kFp32),
           StatusCode::kInvalidArgument, "the parameter has 91 fp32 elements");
    expect((*z)->GradientReady("w1", grad.data(), kSizes[0], DType::kFp32), StatusCode::kOk, "");
    expect((*z)->GradientReady("w1", grad.data(), kSizes[0], DType::kFp32),
           StatusCode::kFailedPrecondition, "already has its 1 gradient(s)");
    expect((*z)->Step().status(), StatusCode::kFailedPrecondition,
           "3 of 4 parameters lack gradients: 'b1' (0 of 1)");
    expect((*z)->GatherParameter("w7", grad.data()), StatusCode::kNotFound, "no parameter 'w7'");
    return failures;
  });
  EXPECT_EQ(code, std::vector<int>{0});
}

// Over NCCL (gpu-labelled): the GPUs are counted in a child process, as every run is, so that
// this process never starts CUDA before forking.
int GpusSeenByAChild() {
#if ZO_HAVE_CUDA
  return RunRanks(1, [](int) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? std::min(n, 100) : 0;
  })[0];
#else
  return 0;
#endif
}

TEST(ZeroNcclTest, WorldSizeOneEqualsTheEngine) {
  if (GpusSeenByAChild() < 1) GTEST_SKIP() << "needs a GPU (NCCL), none usable here";
  ExpectWorldOneEqualsTheEngine(true);
}

// Two GPUs: NCCL's sum of two values is a + b in either order, so the bits of world size 1.
TEST(ZeroNcclTest, TwoGpusGiveTheBitsOfOne) {
  const int gpus = GpusSeenByAChild();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs (NCCL between them); this machine has " << gpus;
  for (const Case c : {Case{1, DType::kFp32, "fp32"}, Case{2, DType::kBf16, "fp32"},
                       Case{3, DType::kBf16, "bf16"}}) {
    ExpectWorldGivesTheBitsOfOne(c, 2, true);
  }
}

}  // namespace
}  // namespace zoffload::internal::zero
