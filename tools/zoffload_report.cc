// zoffload-report: what this machine and this build can do, every line checked by doing it.
//
//   zoffload-report [--json] [--path DIR ...]      verdicts, then the environment report
//   zoffload-report --config FILE [--world-size N] config linter: exit 1 on errors
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "build_info.h"
#include "common/cpu_features.h"
#include "common/strings.h"
#include "common/topology.h"
#include "report_verdicts.h"
#include "swap/direct_io.h"
#include "swap/io_ring.h"
#include "zoffload/config.h"
#if ZO_HAVE_CUDA
#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kUsage =
    "usage: zoffload-report [--json] [--path DIR ...]\n"
    "       zoffload-report --config FILE [--world-size N]\n"
    "  --json          machine-readable output\n"
    "  --path DIR      report O_DIRECT, block size and NUMA node of DIR (default: .)\n"
    "  --config FILE   validate a zoffload/DeepSpeed JSON config; every error with its path\n"
    "  --world-size N  ranks sharing the batch, for the batch-size check (default 1)\n";

Json BuildSection() {
  return {{"version", ZO_VERSION},
          {"compiler", ZO_CXX_COMPILER},
          {"build_type", ZO_BUILD_TYPE},
          {"flags", ZO_BUILD_FLAGS},
          {"cuda_enabled", static_cast<bool>(ZO_HAVE_CUDA)},
          {"cuda_compiler", ZO_HAVE_CUDA ? ZO_CUDA_COMPILER : "not built with CUDA"},
          {"cuda_architectures", ZO_HAVE_CUDA ? ZO_CUDA_ARCHITECTURES : ""},
          {"liburing", ZO_LIBURING_VERSION},
          {"hwloc", ZO_HWLOC_VERSION},
          {"highway", ZO_HWY_VERSION}};
}

Json SimdSection() {
  Json targets = Json::array();
  for (const SimdTarget& t : SimdTargets()) {
    targets.push_back({{"name", t.name}, {"cpu_supports", t.supported}});
  }
  return {{"dispatch_target", BestSimdTarget()}, {"compiled_targets", targets}};
}

Json OpenMpSection() {
  return {{"max_threads", omp_get_max_threads()}, {"processors", omp_get_num_procs()}};
}

Json TopologySection(const Result<Topology>& topology) {
  if (!topology.ok()) return {{"ok", false}, {"error", topology.status().ToString()}};
  return {{"ok", true},
          {"packages", topology->Packages()},
          {"physical_cores", topology->PhysicalCores()},
          {"hardware_threads", topology->HardwareThreads()},
          {"numa_nodes", topology->NumaNodes()}};
}

Json IoUringSection() {
  const IoUringSupport s = ProbeIoUring();
  return {{"usable", s.usable},
          {"registered_buffers", s.registered_buffers},
          {"io_uring_disabled_sysctl", s.disabled_sysctl},
          {"detail", s.detail}};
}

Json MemlockSection() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return {{"error", "getrlimit failed"}};
  auto show = [](rlim_t v) -> Json {
    if (v == RLIM_INFINITY) return "unlimited";
    return HumanBytes(v);
  };
  return {{"soft", show(lim.rlim_cur)},
          {"hard", show(lim.rlim_max)},
          {"note",
           "limit on mlock'd memory (and io_uring registered buffers on kernels "
           "before 5.12); CUDA pinned memory is accounted by the driver"}};
}

Json PathSection(const std::string& path, const Result<Topology>& topology) {
  Json out = {{"path", path}};
  auto block = Topology::BlockDeviceOfPath(path);
  out["block_device"] = block.ok() ? *block : block.status().message();
  if (topology.ok()) {
    auto node = topology->NumaNodeOfPath(path);
    out["numa_node"] = node.ok() ? Json(*node) : Json(node.status().message());
  }
  auto dio = ProbeDirectIo(path);
  if (!dio.ok()) {
    out["error"] = dio.status().ToString();
    return out;
  }
  out["o_direct"] = dio->supported;
  if (dio->supported) {
    out["logical_block_size"] = dio->offset_alignment;
    out["memory_alignment"] = dio->memory_alignment;
    out["alignment_from"] = dio->source;
  } else {
    out["refusal"] = dio->refusal;
  }
  return out;
}

Json CudaSection(const Result<Topology>& topology) {
#if ZO_HAVE_CUDA
  Json out = {{"built", true}, {"runtime_version", CudaRuntimeVersion()}};
  auto nccl = NcclVersion();
  out["nccl_version"] = nccl.ok() ? *nccl : nccl.status().message();
  auto gpus = ProbeGpus();
  if (!gpus.ok()) {
    out["gpus"] = Json::array();
    out["error"] = gpus.status().message();
    return out;
  }
  out["driver_version"] = gpus->driver_version;
  Json list = Json::array();
  for (const GpuDeviceInfo& d : gpus->devices) {
    Json g = {{"index", d.index},
              {"name", d.name},
              {"compute_capability", StrCat(d.compute_major, ".", d.compute_minor)},
              {"memory", HumanBytes(d.total_bytes)},
              {"memory_free", HumanBytes(d.free_bytes)},
              {"pci_bus_id", d.pci_bus_id},
              {"pcie_link", d.pcie_link}};
    if (topology.ok()) {
      auto node = topology->NumaNodeOfPciDevice(d.pci_bus_id);
      g["numa_node"] = node.ok() ? Json(*node) : Json(node.status().message());
    }
    list.push_back(std::move(g));
  }
  out["gpus"] = std::move(list);
  return out;
#else
  (void)topology;
  return {{"built", false},
          {"gpus", Json::array()},
          {"error", "zoffload was built without CUDA: CPU-only (no GPU tier, kernels or NCCL)"}};
#endif
}

// Prints nested JSON as an aligned two-column table ("section.key  value").
void Flatten(const Json& node, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>* rows) {
  if (node.is_object()) {
    for (const auto& [key, value] : node.items()) {
      Flatten(value, prefix.empty() ? key : StrCat(prefix, ".", key), rows);
    }
  } else if (node.is_array() && !node.empty() && node[0].is_object()) {
    for (size_t i = 0; i < node.size(); ++i) Flatten(node[i], StrCat(prefix, "[", i, "]"), rows);
  } else if (node.is_array() && node.empty()) {
    rows->emplace_back(prefix, "(none)");
  } else {
    rows->emplace_back(prefix, node.is_string() ? node.get<std::string>() : node.dump());
  }
}

void PrintTable(const Json& report) {
  std::vector<std::pair<std::string, std::string>> rows;
  Flatten(report, "", &rows);
  size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  for (const auto& [key, value] : rows) {
    std::printf("%-*s  %s\n", static_cast<int>(width), key.c_str(), value.c_str());
  }
}

int LintConfig(const std::vector<std::string>& files, int world_size) {
  int errors = 0;
  for (const std::string& file : files) {
    auto config = LoadConfigFile(file, world_size);
    if (config.ok()) {
      std::printf("%s: valid\n", file.c_str());
    } else {
      std::fprintf(stderr, "%s\n", config.status().message().c_str());
      ++errors;
    }
  }
  return errors == 0 ? 0 : 1;
}

int Main(int argc, char** argv) {
  bool json = false;
  int world_size = 1;
  std::vector<std::string> paths, configs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "zoffload-report: %s needs a value\n%s", arg.c_str(), kUsage);
        std::exit(2);  // NOLINT(concurrency-mt-unsafe): single-threaded argument parsing
      }
      return argv[++i];
    };
    if (arg == "--json") {
      json = true;
    } else if (arg == "--path") {
      paths.push_back(next());
    } else if (arg == "--config") {
      configs.push_back(next());
    } else if (arg == "--world-size") {
      const std::string v = next();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n < 1 || n > 1 << 20) {
        std::fprintf(stderr, "zoffload-report: --world-size must be a positive integer, got '%s'\n",
                     v.c_str());
        return 2;
      }
      world_size = static_cast<int>(n);
    } else if (arg == "-h" || arg == "--help") {
      std::printf("%s", kUsage);
      return 0;
    } else {
      std::fprintf(stderr, "zoffload-report: unknown argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
  }
  if (!configs.empty()) return LintConfig(configs, world_size);
  if (paths.empty()) paths.push_back(".");

  const Result<Topology> topology = Topology::Load();
  Json report = Json::object();
  report["build"] = BuildSection();
  report["simd"] = SimdSection();
  report["openmp"] = OpenMpSection();
  report["topology"] = TopologySection(topology);
  report["io_uring"] = IoUringSection();
  report["memlock"] = MemlockSection();
  Json path_list = Json::array();
  for (const std::string& p : paths) path_list.push_back(PathSection(p, topology));
  report["paths"] = std::move(path_list);
  report["cuda"] = CudaSection(topology);
  const std::vector<Verdict> verdicts = Verdicts(report);
  if (json) {
    Json out = {{"verdicts", ToJson(verdicts)}};
    out.update(report);
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  // NOLINTNEXTLINE(concurrency-mt-unsafe): single-threaded here
  const bool color = ::isatty(STDOUT_FILENO) != 0 && std::getenv("NO_COLOR") == nullptr;
  std::printf("zoffload on this machine:\n");
  for (const Verdict& v : verdicts) std::printf("%s\n", FormatVerdict(v, color).c_str());
  std::printf("\ndetails (--json for a machine-readable report):\n");
  PrintTable(report);
  return 0;
}

}  // namespace
}  // namespace zoffload::internal

int main(int argc, char** argv) { return zoffload::internal::Main(argc, argv); }
