// zoffload-plan: will this model fit here, with which config, and how fast — memory per tier
// for every candidate config, the step time from this machine's measured speeds, and the
// fastest config that fits, as a ds_config the parser accepts (tools/plan/plan.h has the model).
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/adam_profile.h"
#include "bench/bench_util.h"
#include "bench/nvme_profile.h"
#include "build_info.h"
#include "common/config_rules.h"
#include "common/strings.h"
#include "plan/plan.h"
#include "zoffload/config.h"
#if ZO_HAVE_CUDA  // (from build_info.h)
#include "bench/gpu_profile.h"
#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal::plan {
namespace {

constexpr uint64_t kMaxPlanSize = uint64_t{1} << 50;
// bf16 FLOPs a second an H100 ran the 7B model's forward+backward at (checkpointing, 4 x 2048
// tokens: 8 x 6.74e9 x 8192 FLOPs in 0.931 s, docs/PERF.md run of 2026-12-07).
constexpr double kModelledGpuFlops = 474e12;

constexpr const char* kUsage =
    "usage: zoffload-plan (--model NAME|CONFIG.json | --params N) [--gpu-mem SIZE]\n"
    "                     [--host-mem SIZE] [--nvme DIR ...] [--batch B] [--seq S]\n"
    "                     [--accumulation N] [--no-checkpointing | --cpu-checkpointing]\n"
    "                     [--world N] [--stage S]\n"
    "                     [--offload-param [--param-nvme]] [--bench-json FILE ...]\n"
    "                     [--measure | --no-measure]\n"
    "                     [--config DS.json] [--json OUT]\n"
    "  --model        llama-7b, llama-13b, llama-70b, llama3-8b, or a HuggingFace config.json\n"
    "  --gpu-mem      the GPU memory the run may use (e.g. 24GiB; default: GPU 0's)\n"
    "  --host-mem     host memory it may use (default: this machine's)\n"
    "  --nvme DIR     NVMe directories for optimizer state (their free space counts)\n"
    "  --cpu-checkpointing  the checkpointed layers' inputs in pinned host memory\n"
    "                 (activation_checkpointing.cpu_checkpointing): layers x 2 x batch x seq x\n"
    "                 hidden bytes move from the GPU to the host\n"
    "  --world N      data-parallel ranks on this machine, one GPU each (memory per GPU, the\n"
    "                 machine's host memory; step times for one rank only)\n"
    "  --stage S      zero_optimization.stage 1, 2 (default) or 3; --offload-param: stage 3\n"
    "                 with the parameters in host memory, fetched per module (zoffload.torch with\n"
    "                 model=; step time for overlap none, from the GPU's forward+backward,\n"
    "                 CPU Adam, PCIe and (state on NVMe) the disk's speeds); --param-nvme: the\n"
    "                 parameters on the first --nvme directory instead (offload_param nvme)\n"
    "  --bench-json   speeds: zoffload-bench adam/nvme/engine JSON, bench/finetune_7b.py JSON\n"
    "                 (its fwd_bwd system gives the GPU's forward+backward time)\n"
    "  --measure      measure CPU Adam (each state precision), the --nvme disks and PCIe (with\n"
    "                 a GPU) here, in short runs (a few seconds), also with --bench-json; the\n"
    "                 default without --bench-json. --no-measure: only --bench-json's speeds\n"
    "                 (rows without them have no step time). Without a forward+backward time\n"
    "                 from --bench-json, the GPU's is modelled: 8 (6 with --no-checkpointing)\n"
    "                 x params x tokens at 474 TFLOPS, an H100's rate at 7B (docs/PERF.md)\n"
    "  --config FILE  also estimate this config (its workload, offload target, overlap, state)\n"
    "  --json OUT     every estimate and the advice as JSON\n";

struct Row {
  Estimate e;
  bool fits = false;
  std::string why;  // what does not fit
};

std::string Gib(uint64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", static_cast<double>(bytes) / (1 << 30));
  return text;
}

std::string ConfigJson(const Candidate& c, const std::vector<std::string>& nvme,
                       const Workload& w) {
  nlohmann::ordered_json offload = {{"device", c.nvme_ratio > 0 ? "nvme" : "cpu"}};
  if (c.nvme_ratio > 0) {
    offload["nvme_path"] = nvme.front();
    offload["ratio"] = c.nvme_ratio;
  }
  nlohmann::ordered_json zero = {{"stage", w.stage},
                                 {"reduce_bucket_size", w.bucket_elements},
                                 {"offload_optimizer", offload}};
  if (w.param_nvme) {
    zero["offload_param"] = {{"device", "nvme"},
                             {"nvme_path", nvme.front()},
                             {"pin_memory", true},
                             {"max_in_cpu", w.max_in_cpu}};
  } else if (w.offload_param) {
    zero["offload_param"] = {{"device", "cpu"}, {"pin_memory", true}};
  }
  nlohmann::ordered_json j = {
      {"gradient_accumulation_steps", w.accumulation},
      {"bf16", {{"enabled", true}}},
      {"zero_optimization", std::move(zero)},
      {"zoffload", {{"overlap", ToString(c.overlap)}, {"optimizer_state", ToString(c.state)}}}};
  if (w.cpu_checkpointing) j["activation_checkpointing"] = {{"cpu_checkpointing", true}};
  return j.dump(2);
}

// Short runs of zoffload-bench's profiles: CPU Adam for each state precision (bf16 gradients
// and parameter copy, as the engine updates), and the NVMe directories (1 GiB, 1 MiB blocks).
Status Measure(const std::vector<std::string>& nvme, Speeds* speeds) {
  std::fprintf(stderr,
               "measuring CPU Adam (fp32, bf16, int8 state)%s, and PCIe if there is a GPU...\n",
               nvme.empty() ? "" : ", the NVMe directories");
  bench::AdamBenchOptions adam;
  adam.params = uint64_t{64} << 20;
  adam.grad_dtypes = {DType::kBf16};
  adam.states = {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8};
  adam.copies = {ParamCopy::kBf16};
  ZO_ASSIGN_OR_RETURN(const std::vector<bench::AdamRecord> records, bench::RunAdamBench(adam));
  for (const bench::AdamRecord& r : records) {
    speeds->adam(r.state) = r.gparams_per_s;
  }
  if (!nvme.empty()) {
    bench::NvmeBenchOptions o;
    o.paths = nvme;
    o.size = uint64_t{1} << 30;
    o.block_sizes = {1 << 20};
    o.queue_depths = {32};
    o.threads = {2};
    ZO_ASSIGN_OR_RETURN(const std::vector<bench::NvmeRecord> disk, bench::RunNvmeBench(o));
    for (const bench::NvmeRecord& r : disk) {
      (r.op == "read" ? speeds->nvme_read_gbps : speeds->nvme_write_gbps) = r.gbps;
    }
  }
#if ZO_HAVE_CUDA
  // PCIe, pinned, each way alone and both at once (256 MiB transfers): on a machine with a GPU.
  bench::GpuBenchOptions pcie;
  pcie.bytes = uint64_t{256} << 20;
  pcie.repeats = 3;
  if (auto link = bench::RunPcieBench(pcie); link.ok()) {
    for (const bench::GpuRecord& r : *link) speeds->SetPcie(r.test, r.gbps);
  } else {
    std::fprintf(stderr, "PCIe not measured (%s)\n", std::string(link.status().message()).c_str());
  }
#endif
  return Status::Ok();
}

std::string Describe(const Candidate& c) {
  return StrCat("overlap ", ToString(c.overlap), ", ", ToString(c.state), " state",
                c.nvme_ratio > 0 ? StrCat(", ", c.nvme_ratio, " on NVMe") : ", in host memory");
}

int Fail(const std::string& message, int code = 1) {
  std::fprintf(stderr, "zoffload-plan: %s\n", message.c_str());
  return code;
}

int Main(int argc, char** argv) {
  std::string model_arg, json_out, config_path;
  std::optional<bool> measure;  // unset: measure when no --bench-json is given
  uint64_t params = 0, gpu_mem = 0, host_mem = 0;
  std::vector<std::string> nvme, bench;
  Workload w;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "zoffload-plan: %s needs a value\n%s", a.c_str(), kUsage);
        std::exit(2);  // NOLINT(concurrency-mt-unsafe): argument parsing
      }
      return argv[++i];
    };
    auto size = [&](uint64_t* out) -> bool {
      const std::string v = value();
      if (!ParseByteSize(v, out) || *out == 0) {
        std::fprintf(stderr, "zoffload-plan: %s: '%s' is not a size such as 24GiB\n", a.c_str(),
                     v.c_str());
        return false;
      }
      // Past 2^50 (1 PiB, 1.1e15 parameters) nothing is real, and the estimates' byte counts
      // (16 and more a parameter) would wrap.
      if (*out > kMaxPlanSize) {
        std::fprintf(stderr,
                     "zoffload-plan: %s: '%s' is more than 2^50 (1 PiB, 1.1e15 "
                     "parameters): no machine or model of that size\n",
                     a.c_str(), v.c_str());
        return false;
      }
      return true;
    };
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--model") {
      model_arg = value();
    } else if (a == "--params") {
      if (!size(&params)) return 2;
    } else if (a == "--gpu-mem") {
      if (!size(&gpu_mem)) return 2;
    } else if (a == "--host-mem") {
      if (!size(&host_mem)) return 2;
    } else if (a == "--nvme") {
      nvme.push_back(value());
    } else if (a == "--bench-json") {
      bench.push_back(value());
    } else if (a == "--json") {
      json_out = value();
    } else if (a == "--config") {
      config_path = value();
    } else if (a == "--measure" || a == "--no-measure") {
      if (measure.has_value() && *measure != (a == "--measure")) {
        return Fail("give --measure or --no-measure, not both", 2);
      }
      measure = a == "--measure";
    } else if (a == "--batch") {
      if (!size(&w.batch)) return 2;
    } else if (a == "--seq") {
      if (!size(&w.sequence)) return 2;
    } else if (a == "--accumulation") {
      uint64_t n = 0;
      if (!size(&n)) return 2;
      w.accumulation = static_cast<int>(std::min<uint64_t>(n, 1 << 20));
    } else if (a == "--no-checkpointing") {
      w.checkpointing = false;
    } else if (a == "--cpu-checkpointing") {
      w.cpu_checkpointing = true;
    } else if (a == "--world" || a == "--stage") {
      const std::string v = value();
      const int limit = a == "--world" ? 1024 : 3;
      int n = 0;
      const auto [end, err] = std::from_chars(v.data(), v.data() + v.size(), n);
      if (err != std::errc() || end != v.data() + v.size() || n < 1 || n > limit) {
        std::fprintf(stderr, "zoffload-plan: %s: '%s' is not an integer from 1 to %d\n", a.c_str(),
                     v.c_str(), limit);
        return 2;
      }
      (a == "--world" ? w.world : w.stage) = n;
    } else if (a == "--offload-param") {
      w.offload_param = true;
    } else if (a == "--param-nvme") {
      w.param_nvme = true;
    } else {
      std::fprintf(stderr, "zoffload-plan: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
  }
  if (w.offload_param && w.stage != 3) {
    return Fail("--offload-param needs --stage 3 (parameters are partitioned only there)", 2);
  }
  if (w.param_nvme && (!w.offload_param || nvme.empty())) {
    return Fail("--param-nvme needs --offload-param and --nvme DIR (where the parameters go)", 2);
  }
  if (model_arg.empty() == (params == 0)) {
    return Fail(StrCat("give --model or --params (one of them)\n", kUsage), 2);
  }
  if (gpu_mem == 0) {
#if ZO_HAVE_CUDA
    if (auto gpus = ProbeGpus(); gpus.ok() && !gpus->devices.empty()) {
      gpu_mem = gpus->devices.front().total_bytes;
    }
#endif
    if (gpu_mem == 0) {
      return Fail(StrCat("no usable GPU here to take the capacity from: give --gpu-mem\n", kUsage),
                  2);
    }
  }
  ModelShape model;
  if (params > 0) {
    model = ModelOfParams(params);
  } else {
    auto named = ModelNamed(model_arg);
    if (!named.ok()) return Fail(named.status().message());
    model = *named;
  }
  if (host_mem == 0) {
    host_mem = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
               static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  }
  // A given config: its workload settings, and its own candidate estimated first.
  std::optional<Candidate> given;
  if (!config_path.empty()) {
    auto config = LoadConfigFile(config_path);
    if (!config.ok()) return Fail(config.status().message());
    w.accumulation = static_cast<int>(config->gradient_accumulation_steps.value_or(1));
    w.cpu_checkpointing = config->activation_checkpointing.cpu_checkpointing;
    const ZeroConfig& zero = config->zero_optimization;
    w.bucket_elements = static_cast<uint64_t>(zero.reduce_bucket_size);
    w.stage = std::max(1, zero.stage);
    w.offload_param = zero.stage == 3 && zero.offload_param.device != OffloadDevice::kNone;
    w.param_nvme = w.offload_param && zero.offload_param.device == OffloadDevice::kNvme;
    w.max_in_cpu = static_cast<uint64_t>(zero.offload_param.max_in_cpu);
    w.prefetch_elements = static_cast<uint64_t>(zero.stage3_prefetch_bucket_size);
    w.live_elements = static_cast<uint64_t>(zero.stage3_max_live_parameters);
    w.reuse_distance = static_cast<uint64_t>(zero.stage3_max_reuse_distance);
    const auto& oo = config->zero_optimization.offload_optimizer;
    if (oo.device != OffloadDevice::kCpu && oo.device != OffloadDevice::kNvme) {
      return Fail(StrCat(config_path,
                         ": zero_optimization.offload_optimizer.device is not cpu or nvme; "
                         "zoffload-plan estimates offloaded optimizers only"));
    }
    given = Candidate{ChosenOverlap(*config, w.world > 1 || w.param_nvme),
                      config->zoffload.optimizer_state,
                      oo.device == OffloadDevice::kNvme ? oo.ratio : 0.0};
    if ((given->nvme_ratio > 0 || w.param_nvme) && nvme.empty()) {
      nvme = !config->zoffload.nvme_paths.empty() ? config->zoffload.nvme_paths
             : given->nvme_ratio > 0              ? std::vector<std::string>{oo.nvme_path}
                                     : std::vector<std::string>{zero.offload_param.nvme_path};
    }
  }
  uint64_t nvme_free = 0;
  for (const std::string& dir : nvme) {
    struct statvfs st {};
    if (::statvfs(dir.c_str(), &st) != 0)
      return Fail(StrCat("NVMe directory ", dir, ": cannot be read"));
    nvme_free += static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  }
  auto speeds = SpeedsFromJson(bench);
  if (!speeds.ok()) return Fail(speeds.status().message());
  if (measure.value_or(bench.empty())) {
    if (Status s = Measure(nvme, &*speeds); !s.ok()) return Fail(s.message());
    if (speeds->fwd_bwd_seconds == 0) {
      // The GPU's forward+backward, modelled (FLOPs: 2 forward, 4 backward, 2 the checkpointed
      // recompute, per parameter and token) at the rate an H100 reached on the 7B model.
      const double tokens = static_cast<double>(w.batch * w.sequence);
      speeds->fwd_bwd_seconds = (w.checkpointing ? 8.0 : 6.0) * static_cast<double>(model.params) *
                                tokens / kModelledGpuFlops;
      speeds->fwd_bwd_params = model.params;
      std::fprintf(stderr,
                   "the GPU's forward+backward modelled at %.0f TFLOPS (an H100's rate at 7B): "
                   "%.3f s a micro-batch; --bench-json with bench/finetune_7b.py's JSON gives "
                   "your GPU's\n",
                   kModelledGpuFlops / 1e12, speeds->fwd_bwd_seconds);
    }
  }

  auto row_of = [&](const Candidate& c) {
    Row r;
    r.e = EstimateRun(model, w, c, *speeds);
    std::vector<std::string> short_of;
    if (r.e.gpu_bytes > gpu_mem) {
      short_of.push_back(StrCat("GPU ", Gib(r.e.gpu_bytes), " > ", Gib(gpu_mem), " GiB"));
    }
    if (r.e.host_bytes > host_mem) {
      short_of.push_back(StrCat("host ", Gib(r.e.host_bytes), " > ", Gib(host_mem), " GiB"));
    }
    if (r.e.nvme_bytes > nvme_free) {
      short_of.push_back(StrCat("NVMe ", Gib(r.e.nvme_bytes), " > ", Gib(nvme_free), " GiB"));
    }
    r.fits = short_of.empty();
    for (const std::string& s : short_of) r.why += StrCat(r.why.empty() ? "" : ", ", s);
    return r;
  };
  std::vector<Row> rows;
  for (Overlap overlap : {Overlap::kNone, Overlap::kBackward, Overlap::kDelayed}) {
    for (StatePrecision state :
         {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
      // The config refuses delayed with offload_param (the update would write the values
      // being fetched); offload_param nvme runs as ZeRO, whose step is overlap none's.
      if (overlap == Overlap::kDelayed && w.offload_param) continue;
      if (overlap != Overlap::kNone && w.param_nvme) continue;
      rows.push_back(row_of({overlap, state, 0.0}));
      if (nvme.empty() || overlap != Overlap::kNone) continue;
      // The least share of the state on NVMe (in steps of 0.05) that fits host memory, when
      // all of it in host memory does not: the host's state shrinks by the share moved.
      const Estimate& host = rows.back().e;
      std::vector<double> ratios = {0.5, 1.0};
      if (host.host_bytes > host_mem && host.host_state > 0) {
        const double least =
            static_cast<double>(host.host_bytes - host_mem) / static_cast<double>(host.host_state);
        const double ratio = std::ceil(least * 20 - 1e-9) / 20;
        if (ratio < 1 && ratio != 0.5) ratios.insert(ratios.begin(), ratio);
      }
      for (double ratio : ratios) rows.push_back(row_of({overlap, state, ratio}));
    }
  }
  // Fitting first, then by step time (unknown last), exact modes and wider state first on ties.
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.fits != b.fits) return a.fits;
    const double ta = a.e.step_seconds > 0 ? a.e.step_seconds : 1e30;
    const double tb = b.e.step_seconds > 0 ? b.e.step_seconds : 1e30;
    return ta < tb;
  });
  std::printf("%s: %.2fB parameters; batch %llu x %llu tokens, accumulation %d, checkpointing %s\n",
              model.name.c_str(), static_cast<double>(model.params) / 1e9,
              static_cast<unsigned long long>(w.batch), static_cast<unsigned long long>(w.sequence),
              w.accumulation, w.checkpointing ? "on" : "off");
  std::printf("ZeRO stage %d%s, %d rank%s (GPU memory per rank, host and NVMe for the machine)\n",
              w.stage,
              !w.offload_param ? ""
              : w.param_nvme   ? " with offload_param nvme"
                               : " with offload_param cpu",
              w.world, w.world == 1 ? "" : "s");
  std::printf("capacity: GPU %s GiB, host %s GiB, NVMe %s GiB free\n\n", Gib(gpu_mem).c_str(),
              Gib(host_mem).c_str(), Gib(nvme_free).c_str());
  std::printf("%-9s %-5s %5s %8s %8s %8s %8s %8s  %s\n", "overlap", "state", "nvme", "GPU GiB",
              "host GiB", "pinned", "NVMe GiB", "s/step", "bound / what does not fit");
  for (const Row& r : rows) {
    const Candidate& c = r.e.candidate;
    std::printf(
        "%-9s %-5s %5.2f %8s %8s %8s %8s %8s  %s\n", std::string(ToString(c.overlap)).c_str(),
        std::string(ToString(c.state)).c_str(), c.nvme_ratio, Gib(r.e.gpu_bytes).c_str(),
        Gib(r.e.host_bytes).c_str(), Gib(r.e.host_pinned).c_str(), Gib(r.e.nvme_bytes).c_str(),
        r.e.step_seconds > 0 ? StrCat(static_cast<int>(r.e.step_seconds * 1000) / 1000.0).c_str()
                             : "?",
        r.fits ? r.e.bound.c_str() : StrCat("does not fit: ", r.why).c_str());
  }
  nlohmann::ordered_json out = {{"model", model.name}, {"params", model.params}};
  if (given) {
    const Row r = row_of(*given);
    std::printf(
        "\n%s: overlap %s, %s state%s: GPU %s GiB, host %s GiB, NVMe %s GiB, %s; %s\n",
        config_path.c_str(), std::string(ToString(given->overlap)).c_str(),
        std::string(ToString(given->state)).c_str(),
        given->nvme_ratio > 0 ? StrCat(", ", given->nvme_ratio, " on NVMe").c_str() : "",
        Gib(r.e.gpu_bytes).c_str(), Gib(r.e.host_bytes).c_str(), Gib(r.e.nvme_bytes).c_str(),
        r.e.step_seconds > 0 ? StrCat(r.e.step_seconds, " s/step").c_str() : "step time unknown",
        r.fits ? "fits" : StrCat("does not fit: ", r.why).c_str());
    if (!r.fits && rows.front().fits) {
      std::printf("  it fits with %s (the advice below)\n",
                  Describe(rows.front().e.candidate).c_str());
    }
    out["config"] = {{"path", config_path},
                     {"gpu_bytes", r.e.gpu_bytes},
                     {"host_bytes", r.e.host_bytes},
                     {"nvme_bytes", r.e.nvme_bytes},
                     {"step_seconds", r.e.step_seconds},
                     {"fits", r.fits},
                     {"does_not_fit", r.why}};
  }
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const Row& r : rows) {
    list.push_back({{"overlap", ToString(r.e.candidate.overlap)},
                    {"optimizer_state", ToString(r.e.candidate.state)},
                    {"nvme_ratio", r.e.candidate.nvme_ratio},
                    {"gpu_bytes", r.e.gpu_bytes},
                    {"host_bytes", r.e.host_bytes},
                    {"host_pinned_bytes", r.e.host_pinned},
                    {"nvme_bytes", r.e.nvme_bytes},
                    {"step_seconds", r.e.step_seconds},
                    {"bound", r.e.bound},
                    {"fits", r.fits},
                    {"does_not_fit", r.why}});
  }
  out["candidates"] = std::move(list);
  int rc = 0;
  if (!rows.front().fits) {
    // Nothing fits: say by how much the smallest is short, and what would help.
    const Row* least = &rows.front();
    for (const Row& r : rows) {
      if (r.e.host_bytes + r.e.gpu_bytes < least->e.host_bytes + least->e.gpu_bytes) least = &r;
    }
    std::string help;
    if (least->e.gpu_params > gpu_mem && !w.offload_param) {
      Workload infinity = w;
      infinity.stage = 3;
      infinity.offload_param = true;
      const Estimate e = EstimateRun(model, infinity, least->e.candidate, *speeds);
      help = StrCat("; the bf16 parameters alone take ", Gib(least->e.gpu_params),
                    " GiB of GPU memory: with ZeRO-3 parameter offload (--stage 3 "
                    "--offload-param; zoffload.torch with model=) it would take GPU ",
                    Gib(e.gpu_bytes), " GiB, host ", Gib(e.host_bytes), " GiB");
    } else if (least->e.gpu_bytes > gpu_mem && w.checkpointing && !w.cpu_checkpointing) {
      Workload offloaded = w;
      offloaded.cpu_checkpointing = true;
      const Estimate e = EstimateRun(model, offloaded, least->e.candidate, *speeds);
      help = StrCat("; the layers' checkpointed inputs take ", Gib(e.host_activations),
                    " GiB of GPU memory: in host memory (--cpu-checkpointing; "
                    "activation_checkpointing.cpu_checkpointing) it would take GPU ",
                    Gib(e.gpu_bytes), " GiB, host ", Gib(e.host_bytes), " GiB");
    } else if (least->e.gpu_bytes > gpu_mem) {
      help = "; less GPU memory: a smaller --batch or --seq, or gradient checkpointing";
    } else if (nvme.empty()) {
      help = "; give --nvme DIR to put the optimizer state on NVMe";
    }
    std::printf("\nnothing fits: the smallest (%s state%s) needs %s%s\n",
                std::string(ToString(least->e.candidate.state)).c_str(),
                least->e.candidate.nvme_ratio > 0 ? ", all on NVMe" : "", least->why.c_str(),
                help.c_str());
    out["advice"] = nullptr;
    rc = 1;
  } else {
    const Row& best = rows.front();
    const std::string config = ConfigJson(best.e.candidate, nvme, w);
    if (auto parsed = ParseConfig(config); !parsed.ok()) {
      return Fail(
          StrCat("internal: the advised config does not parse: ", parsed.status().message()));
    }
    std::printf("\nadvice: %s%s\n%s\n", Describe(best.e.candidate).c_str(),
                best.e.step_seconds > 0 || w.world > 1 || w.stage == 3
                    ? ""
                    : " (its step time is unknown: --bench-json with a zoffload-bench adam run "
                      "for this state precision)",
                config.c_str());
    out["advice"] = nlohmann::ordered_json::parse(config);
    if (w.world > 1) {
      std::printf(
          "(memory only: ZeRO across ranks is not measured yet; its ranks communicate "
          "through host memory, not NCCL)\n");
    } else if (w.stage == 3 && best.e.step_seconds == 0) {
      std::printf("(%s; stage 3 runs through zoffload.torch with model=)\n", best.e.bound.c_str());
    }
    // Pinned buffers come from cudaHostAlloc; where the locked-memory limit applies to them,
    // pinning would fail above it.
    struct rlimit memlock {};
    if (::getrlimit(RLIMIT_MEMLOCK, &memlock) == 0 && memlock.rlim_cur != RLIM_INFINITY &&
        best.e.host_pinned > memlock.rlim_cur) {
      std::printf(
          "note: it pins %s GiB of host memory and ulimit -l is %s GiB; if pinning "
          "fails (zoffload-report says), raise ulimit -l\n",
          Gib(best.e.host_pinned).c_str(), Gib(static_cast<uint64_t>(memlock.rlim_cur)).c_str());
    }
    // The next best, and why each is slower or does not fit.
    nlohmann::ordered_json alternatives = nlohmann::ordered_json::array();
    std::printf("\nalternatives:\n");
    for (size_t k = 1; k < rows.size() && k <= 3; ++k) {
      const Row& r = rows[k];
      std::string why;
      if (!r.fits) {
        why = StrCat("does not fit: ", r.why);
      } else if (r.e.step_seconds > 0 && best.e.step_seconds > 0) {
        const double slower = r.e.step_seconds - best.e.step_seconds;
        char text[96];
        std::snprintf(text, sizeof(text),
                      "%.3f s/step, %.3f s (%.0f %%) slower; bound: ", r.e.step_seconds, slower,
                      100 * slower / best.e.step_seconds);
        why = StrCat(text, r.e.bound);
      } else {  // EstimateRun says why, or lacked a CPU Adam figure
        why = r.e.bound.empty() ? "step time unknown (no CPU Adam figure for this state precision)"
                                : r.e.bound;
      }
      std::printf("  %s: %s\n", Describe(r.e.candidate).c_str(), why.c_str());
      alternatives.push_back({{"overlap", ToString(r.e.candidate.overlap)},
                              {"optimizer_state", ToString(r.e.candidate.state)},
                              {"nvme_ratio", r.e.candidate.nvme_ratio},
                              {"why", why}});
    }
    out["alternatives"] = std::move(alternatives);
  }
  if (!json_out.empty()) {
    std::ofstream f(json_out);
    f << out.dump(2) << "\n";
    if (!f) return Fail(StrCat("--json ", json_out, ": cannot be written"));
  }
  return rc;
}

}  // namespace
}  // namespace zoffload::internal::plan

int main(int argc, char** argv) {
  zoffload::internal::bench::CatchStopSignals();  // --measure's scratch goes on Ctrl-C too
  return zoffload::internal::plan::Main(argc, argv);
}
