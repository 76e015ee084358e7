// zoffload-bench: what this machine's disks (and, as they land, CPU and PCIe) can sustain,
// with the settings that get there.
//
//   zoffload-bench                 every profile this machine supports, short defaults
//   zoffload-bench nvme [options]  NVMe sweep; --help lists the options
//   zoffload-bench adam [options]  CPU Adam against the memory-bandwidth ceiling
//   zoffload-bench pcie [options]  host<->GPU copies against plain cudaMemcpyAsync
//   zoffload-bench kernels [opts]  GPU kernels against a device-to-device copy
//   zoffload-bench step [options]  optimizer steps with state in host memory or on NVMe
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/adam_profile.h"
#include "bench/bench_util.h"
#include "bench/engine_profile.h"
#include "bench/nvme_profile.h"
#include "bench/step_profile.h"
#include "build_info.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "cpu_adam/adam_kernels.h"
#include "zoffload/config.h"
#include "zoffload/runtime.h"
#if ZO_HAVE_CUDA
#include "bench/gpu_profile.h"
#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal::bench {
namespace {

constexpr const char* kUsage =
    R"(usage: zoffload-bench [nvme|adam|step|engine|pcie|kernels] [options]

With no subcommand: every profile this machine supports, with short defaults (a 1 GiB
temporary file in the current directory; 32M-parameter Adam steps; a 32M-parameter optimizer
step streamed from NVMe in the current directory; 32M-parameter engine steps; 256 MiB GPU
transfers when a GPU is present), then tables.

zoffload-bench nvme [--path DIR ...] [--size 4GiB] [--block-size 1M,4M] [--queue-depth 8,32]
                    [--threads 1,2] [--op write,read] [--single-submit] [--no-overlap-events]
                    [--file NAME [--overwrite]] [--json FILE] [--config ds.json]
                    [--write-aio-config FILE]
  --path DIR             directory to test; repeat to stripe over several disks (default: .)
  --size N               bytes moved per pass, all paths together (default 4GiB)
  --block-size LIST      aio.block_size values to sweep
  --queue-depth LIST     aio.queue_depth values to sweep
  --threads LIST         aio.intra_op_parallelism values to sweep
  --op LIST              write and/or read (a write pass runs before reads of the same setting)
  --file NAME            use DIR/NAME and keep it (default: a temporary file, removed); an
                         existing DIR/NAME is refused unless --overwrite is given (its data is
                         written over; one of at least the size is used as already laid out)
  --json FILE            write every measurement as a JSON list
  --config FILE          take aio settings and NVMe paths from a zoffload/DeepSpeed config
  --write-aio-config F   write the recommended {"aio": {...}} block to F
Speeds are O_DIRECT (never the page cache); 1 GB/s = 1e9 bytes/s.

zoffload-bench adam [--params 256M] [--threads N] [--grad-dtype fp32,bf16,fp16]
                    [--state fp32,bf16,int8] [--param-copy none,bf16,fp16] [--steps 5]
                    [--rule adam,adagrad,lion] [--bind] [--json FILE]
  Times optimizer steps (median) and a kernel moving the same bytes per parameter over the
  same buffers in the same process; prints Gparam/s, GB/s and their ratio (bandwidth_ratio).
  --rule: Adam/AdamW (default), Adagrad (v only), Lion (m only); int8 state is Adam's only.
  --bind binds worker thread k to physical core k (zoffload.cpu_adam_bind_cores).

zoffload-bench step [--params 128M] [--tensors 16] [--state-on host|nvme] [--path DIR ...]
                    [--state fp32|bf16|int8] [--grad-dtype bf16] [--buffers 4] [--chunk 4M]
                    [--nvme-ratio 1] [--threads N]
                    [--steps 3] [--no-checksums] [--durable] [--config ds.json] [--json FILE] [--trace FILE]
  Real optimizer steps (gradient norm + Adam; bf16 grads and a bf16 parameter copy by
  default) over state in host memory or streamed from NVMe through --buffers chunk slots.
  Prints step_seconds against the I/O bound (the step's bytes at the disk's bandwidth for
  reads and writes at once, measured alone on the same path with the same aio settings and
  durability) and against CPU Adam alone on the same data.
  --config takes aio, NVMe paths, buffer_count and zoffload.optimizer_state from a config.
  --trace writes a Chrome trace-event timeline (open it in Perfetto or chrome://tracing).
  --chunk sets the elements per pipeline chunk (default 4M; 16M for int8 state).
  --nvme-ratio R keeps the share R of the state on NVMe, whole tensors in host memory for
  the rest (offload_optimizer.ratio); the step is then held against the larger of the two
  bounds (bound_seconds), CPU Adam running on the host share while the disk works.
  --no-checksums turns off the CRC32C of every swap block (on by default); --durable flushes
  every step's writes to the device (the disk bound then flushes too).

zoffload-bench engine [--params 256M] [--tensors 64] [--grad-ms T] [--state fp32|bf16|int8]
                      [--state-on host|nvme] [--path DIR ...] [--threads N] [--bucket 500M]
                      [--overlap none|backward|delayed] [--steps 3] [--host] [--json FILE]
                      [--trace FILE]
  Whole OffloadEngine steps: a GPU kernel writes each tensor's bf16 gradient (sizes in a Llama
  layer's proportions; production spread over --grad-ms), GradientReady hands it over as it
  appears, then Step and WaitParameters. Prints step_seconds against the bound measured in
  the same run (gradient production alone + CPU Adam alone on the same layout + one chunk's
  upload at the measured H2D rate; target ratio <= 1.10), the D2H overhead on gradient
  production (target <= 5 %), host RSS against the state's bytes and GPU memory against two
  buckets. Without a GPU (or with --host) the engine runs in host mode, and --grad-ms is
  spent on the calling thread (a CPU backward). --overlap sets zoffload.overlap; its bound is
  max(gradients, CPU Adam) (+ one chunk's upload for backward).

zoffload-bench pcie [--size 1GiB] [--repeats 5] [--json FILE]
  Host<->GPU copies through the copy engine: H2D, D2H, both at once (pinned), each against
  plain cudaMemcpyAsync between the same buffers measured just before; pageable memory
  through pinned staging against CUDA's direct pageable copy.
zoffload-bench kernels [--size 1GiB] [--repeats 5] [--json FILE]
  Casts, gradient accumulation, gradient norm and GPU Adam over --size of input, as bytes
  moved per second against a device-to-device cudaMemcpyAsync (read + write).
)";

int Fail(const Status& s) {
  std::fprintf(stderr, "zoffload-bench: %s\n", s.message().c_str());
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

int PrintUsage() {
  std::printf("%s", kUsage);
  return 0;
}

// Checks at once that `path` (the value of `flag`) can be written, so that a bad path fails
// before a long run rather than after it; a file made only for the check is removed.
Result<std::string> WritablePath(const std::string& flag, const std::string& path) {
  struct stat st {};
  const bool existed = ::stat(path.c_str(), &st) == 0;
  if (existed && S_ISDIR(st.st_mode)) {
    return InvalidArgumentError(StrCat(flag, " ", path, ": is a directory"));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return StatusFromErrno(errno, StrCat(flag, " ", path, ": cannot write"));
  ::close(fd);
  if (!existed) ::unlink(path.c_str());
  return path;
}

// Every option the usage text names.
const std::vector<std::string>& KnownOptions() {
  static const std::vector<std::string> known = [] {
    std::vector<std::string> flags;
    const std::string_view text = kUsage;
    for (size_t at = text.find("--"); at != std::string_view::npos; at = text.find("--", at)) {
      size_t end = at + 2;
      while (end < text.size() &&
             (std::isalnum(static_cast<unsigned char>(text[end])) || text[end] == '-')) {
        ++end;
      }
      const std::string flag(text.substr(at, end - at));
      if (flag.size() > 2 && std::find(flags.begin(), flags.end(), flag) == flags.end()) {
        flags.push_back(flag);
      }
      at = end;
    }
    return flags;
  }();
  return known;
}

Status UnknownOption(const std::string& flag) {
  std::string nearest;
  size_t best = std::numeric_limits<size_t>::max();
  for (const std::string& known : KnownOptions()) {
    const size_t d = EditDistance(flag, known);
    if (known != flag && d < best) {
      best = d;
      nearest = known;
    }
  }
  const bool close = !nearest.empty() && best <= std::max<size_t>(2, flag.size() / 3);
  return InvalidArgumentError(StrCat("unknown option '", flag, "'",
                                     close ? StrCat("; did you mean '", nearest, "'?") : "",
                                     "; see --help"));
}

// Walks a profile's options: the `switches` take no value, every other flag takes the next
// argument; `option(flag, value)` handles each. "-h"/"--help" sets *help and stops. The
// first error (a missing value, or the one `option` returns) is returned.
Status ForEachOption(const std::vector<std::string>& args, const std::vector<std::string>& switches,
                     bool* help,
                     const std::function<Status(const std::string&, const std::string&)>& option) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      *help = true;
      return Status::Ok();
    }
    if (std::find(switches.begin(), switches.end(), a) != switches.end()) {
      ZO_RETURN_IF_ERROR(option(a, ""));
      continue;
    }
    if (std::find(KnownOptions().begin(), KnownOptions().end(), a) == KnownOptions().end()) {
      return UnknownOption(a);
    }
    if (i + 1 >= args.size()) return InvalidArgumentError(StrCat(a, " needs a value"));
    ZO_RETURN_IF_ERROR(option(a, args[++i]));
  }
  return Status::Ok();
}

Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return Status(StatusCode::kIoError, StrCat("cannot write ", path), errno);
  return Status::Ok();
}

void PrintNvmeTable(const std::vector<NvmeRecord>& records) {
  std::printf("\n%-6s %10s %5s %8s %10s %9s\n", "op", "block", "qd", "threads", "GB/s", "seconds");
  for (const NvmeRecord& r : records) {
    std::printf("%-6s %10s %5d %8d %10.3f %9.2f\n", r.op.c_str(), ShortBytes(r.block_size).c_str(),
                r.queue_depth, r.threads, r.gbps, r.seconds);
  }
  if (!records.empty()) {
    std::printf("backend: %s%s, %s\n", records[0].backend.c_str(),
                records[0].registered ? " (registered buffers and files)" : "",
                records[0].direct ? "O_DIRECT" : "BUFFERED");
    if (records[0].in_ram) {
      std::printf(
          "WARNING: the files are on tmpfs/ramfs: these figures are memory speed, NOT disk "
          "speeds\n");
    }
    if (!records[0].direct) {
      std::printf(
          "WARNING: O_DIRECT was refused: these figures include the page cache and are NOT "
          "disk speeds\n");
    }
  }
  for (const char* op : {"read", "write"}) {
    const NvmeRecord* best = nullptr;
    for (const NvmeRecord& r : records) {
      if (r.op == op && (best == nullptr || r.gbps > best->gbps)) best = &r;
    }
    if (best != nullptr) {
      std::printf("best %-5s %.3f GB/s at block %s, queue depth %d, %d thread(s)\n", op, best->gbps,
                  ShortBytes(best->block_size).c_str(), best->queue_depth, best->threads);
    }
  }
}

// Each record, with "recommended" marking the setting of the recommended aio block.
Status WriteJson(const std::string& path, const std::vector<NvmeRecord>& records,
                 const AioConfig& aio) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const NvmeRecord& r : records) {
    list.push_back({{"profile", "nvme"},
                    {"op", r.op},
                    {"block_size", r.block_size},
                    {"queue_depth", r.queue_depth},
                    {"threads", r.threads},
                    {"single_submit", r.single_submit},
                    {"overlap_events", r.overlap_events},
                    {"bytes", r.bytes},
                    {"seconds", r.seconds},
                    {"GBps", r.gbps},
                    {"direct", r.direct},
                    {"in_ram", r.in_ram},
                    {"backend", r.backend},
                    {"registered", r.registered},
                    {"recommended", static_cast<int64_t>(r.block_size) == aio.block_size &&
                                        r.queue_depth == aio.queue_depth &&
                                        r.threads == aio.intra_op_parallelism}});
  }
  return WriteTextFile(path, list.dump(2) + "\n");
}

int NvmeMain(const std::vector<std::string>& args, bool short_defaults) {
  NvmeBenchOptions o;
  if (short_defaults) {
    o.size = uint64_t{1} << 30;
    o.block_sizes = {1 << 20};
    o.queue_depths = {32};
    o.threads = {1};
  }
  std::vector<std::string> paths;
  std::string json_path, aio_out, config_path;
  bool sweep_given = false;
  bool help = false;
  const Status parsed = ForEachOption(
      args, {"--single-submit", "--no-overlap-events", "--overwrite"}, &help,
      [&](const std::string& a, const std::string& v) -> Status {
        if (a == "--single-submit") {
          o.single_submit = true;
        } else if (a == "--overwrite") {
          o.overwrite = true;
        } else if (a == "--no-overlap-events") {
          o.overlap_events = false;
        } else if (a == "--path") {
          paths.push_back(v);
        } else if (a == "--size") {
          if (!ParseByteSize(v, &o.size) || o.size == 0) {
            return InvalidArgumentError(StrCat("--size: '", v, "' is not a size such as 4GiB"));
          }
        } else if (a == "--block-size") {
          ZO_ASSIGN_OR_RETURN(o.block_sizes, ParseSizeList(a, v));
          sweep_given = true;
        } else if (a == "--queue-depth") {
          ZO_ASSIGN_OR_RETURN(o.queue_depths, ParseIntList(a, v, 1, 4096));
          sweep_given = true;
        } else if (a == "--threads") {
          ZO_ASSIGN_OR_RETURN(o.threads, ParseIntList(a, v, 1, 256));
          sweep_given = true;
        } else if (a == "--op") {
          ZO_ASSIGN_OR_RETURN(o.ops, ParseWordList(a, v, {"write", "read"}));
        } else if (a == "--file") {
          o.file = v;
        } else if (a == "--json") {
          ZO_ASSIGN_OR_RETURN(json_path, WritablePath(a, v));
        } else if (a == "--config") {
          config_path = v;
        } else if (a == "--write-aio-config") {
          ZO_ASSIGN_OR_RETURN(aio_out, WritablePath(a, v));
        } else {
          return UnknownOption(a);
        }
        return Status::Ok();
      });
  if (help) return PrintUsage();
  if (!parsed.ok()) return Fail(parsed);
  if (!config_path.empty()) {
    auto config = LoadConfigFile(config_path);
    if (!config.ok()) return Fail(config.status());
    if (!sweep_given) {
      o.block_sizes = {static_cast<uint64_t>(config->aio.block_size)};
      o.queue_depths = {config->aio.queue_depth};
      o.threads = {config->aio.intra_op_parallelism};
      o.single_submit = config->aio.single_submit;
      o.overlap_events = config->aio.overlap_events;
    }
    if (paths.empty()) {
      paths = config->zoffload.nvme_paths;
      const auto& oo = config->zero_optimization.offload_optimizer;
      if (paths.empty() && !oo.nvme_path.empty()) paths.push_back(oo.nvme_path);
    }
  }
  if (!paths.empty()) o.paths = paths;
  auto records = RunNvmeBench(o);
  if (!records.ok()) return Fail(records.status());
  PrintNvmeTable(*records);
  const AioConfig aio = RecommendAio(*records);
  std::printf("recommended aio config: %s\n",
              nlohmann::json::parse(AioConfigJson(aio)).dump().c_str());
  if (!json_path.empty()) {
    if (Status s = WriteJson(json_path, *records, aio); !s.ok()) return Fail(s);
  }
  if (!aio_out.empty()) {
    if (Status s = WriteTextFile(aio_out, AioConfigJson(aio)); !s.ok()) return Fail(s);
    std::printf("wrote %s\n", aio_out.c_str());
  }
  return 0;
}

Status WriteAdamJson(const std::string& path, const std::vector<AdamRecord>& records) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const AdamRecord& r : records) {
    list.push_back({{"profile", "adam"},
                    {"params", r.params},
                    {"threads", r.threads},
                    {"grad_dtype", ToString(r.grad_dtype)},
                    {"state", ToString(r.state)},
                    {"param_copy", ToString(r.copy)},
                    {"rule", ToString(r.rule)},
                    {"bytes_per_param", r.bytes_per_param},
                    {"seconds_per_step", r.seconds_per_step},
                    {"Gparams_per_s", r.gparams_per_s},
                    {"GBps", r.gbps},
                    {"ceiling_seconds", r.ceiling_seconds},
                    {"bandwidth_ratio", r.bandwidth_ratio},
                    {"spread", r.spread},
                    {"attempts", r.attempts},
                    {"noisy", r.noisy},
                    {"target", r.target}});
  }
  return WriteTextFile(path, list.dump(2) + "\n");
}

template <typename T>
Result<std::vector<T>> ParseEnumList(std::string_view flag, std::string_view text,
                                     const std::vector<std::pair<std::string, T>>& names) {
  std::vector<std::string> allowed;
  for (const auto& [name, value] : names) allowed.push_back(name);
  ZO_ASSIGN_OR_RETURN(auto words, ParseWordList(flag, text, allowed));
  std::vector<T> out;
  for (const std::string& w : words) {
    for (const auto& [name, value] : names) {
      if (name == w) out.push_back(value);
    }
  }
  return out;
}

const std::vector<std::pair<std::string, DType>> kDTypeNames = {
    {"fp32", DType::kFp32}, {"bf16", DType::kBf16}, {"fp16", DType::kFp16}};
const std::vector<std::pair<std::string, StatePrecision>> kStateNames = {
    {"fp32", StatePrecision::kFp32},
    {"bf16", StatePrecision::kBf16},
    {"int8", StatePrecision::kInt8}};
const std::vector<std::pair<std::string, UpdateRule>> kRuleNames = {
    {"adam", UpdateRule::kAdam}, {"adagrad", UpdateRule::kAdagrad}, {"lion", UpdateRule::kLion}};
const std::vector<std::pair<std::string, ParamCopy>> kCopyNames = {
    {"none", ParamCopy::kNone}, {"bf16", ParamCopy::kBf16}, {"fp16", ParamCopy::kFp16}};

int AdamMain(const std::vector<std::string>& args, bool short_defaults) {
  AdamBenchOptions o;
  if (short_defaults) {
    o.params = uint64_t{32} << 20;
    o.grad_dtypes = {DType::kFp32, DType::kBf16};
    o.copies = {ParamCopy::kNone, ParamCopy::kBf16};
  }
  std::string json_path;
  bool help = false;
  const Status parsed = ForEachOption(
      args, {"--bind"}, &help, [&](const std::string& a, const std::string& v) -> Status {
        if (a == "--params") {
          if (!ParseByteSize(v, &o.params) || o.params == 0) {
            return InvalidArgumentError(StrCat("--params: '", v, "' is not a count such as 256M"));
          }
        } else if (a == "--threads") {
          ZO_ASSIGN_OR_RETURN(auto l, ParseIntList(a, v, 1, 4096));
          o.threads = l.front();
        } else if (a == "--steps") {
          ZO_ASSIGN_OR_RETURN(auto l, ParseIntList(a, v, 1, 1000));
          o.steps = l.front();
        } else if (a == "--grad-dtype") {
          ZO_ASSIGN_OR_RETURN(o.grad_dtypes, ParseEnumList(a, v, kDTypeNames));
        } else if (a == "--state") {
          ZO_ASSIGN_OR_RETURN(o.states, ParseEnumList(a, v, kStateNames));
        } else if (a == "--rule") {
          ZO_ASSIGN_OR_RETURN(o.rules, ParseEnumList(a, v, kRuleNames));
        } else if (a == "--param-copy") {
          ZO_ASSIGN_OR_RETURN(o.copies, ParseEnumList(a, v, kCopyNames));
        } else if (a == "--bind") {
          SetCpuAdamCoreBinding(true);
        } else if (a == "--json") {
          ZO_ASSIGN_OR_RETURN(json_path, WritablePath(a, v));
        } else {
          return UnknownOption(a);
        }
        return Status::Ok();
      });
  if (help) return PrintUsage();
  if (!parsed.ok()) return Fail(parsed);
  auto records = RunAdamBench(o);
  if (!records.ok()) return Fail(records.status());
  std::printf("\n%-8s %-6s %-6s %-6s %7s %10s %9s %9s %11s %8s\n", "rule", "grads", "state", "copy",
              "B/param", "s/step", "Gparam/s", "GB/s", "ceiling s", "ratio");
  for (const AdamRecord& r : *records) {
    std::printf("%-8s %-6s %-6s %-6s %7.2f %10.4f %9.3f %9.1f %11.4f %8.3f%s\n",
                std::string(ToString(r.rule)).c_str(), std::string(ToString(r.grad_dtype)).c_str(),
                std::string(ToString(r.state)).c_str(), std::string(ToString(r.copy)).c_str(),
                r.bytes_per_param, r.seconds_per_step, r.gparams_per_s, r.gbps, r.ceiling_seconds,
                r.bandwidth_ratio,
                r.noisy ? StrCat("  noisy: spread ", static_cast<int>(100 * r.spread + 0.5),
                                 "% after ", r.attempts, " measurements")
                              .c_str()
                        : "");
  }
  for (const AdamRecord& r : *records) {
    if (r.noisy) {
      std::printf(
          "noisy figures were disturbed (another process, frequency changes) even after %d "
          "measurements: take them as rough, or rerun on a quiet machine\n",
          kAdamAttempts);
      break;
    }
  }
  if (!records->empty()) {
    std::printf(
        "%llu params, %d threads, SIMD target %s; ratio = bandwidth-kernel time / Adam time\n",
        static_cast<unsigned long long>((*records)[0].params), (*records)[0].threads,
        (*records)[0].target.c_str());
  }
  if (!json_path.empty()) {
    if (Status s = WriteAdamJson(json_path, *records); !s.ok()) return Fail(s);
  }
  return 0;
}

Status WriteStepJson(const std::string& path, const StepRecord& r) {
  nlohmann::ordered_json j = {{"profile", "step"},
                              {"params", r.params},
                              {"tensors", r.tensors},
                              {"state_on", r.state_on},
                              {"state", r.state},
                              {"step_seconds", r.step_seconds},
                              {"bytes_read", r.bytes_read},
                              {"bytes_written", r.bytes_written},
                              {"read_GBps", r.read_gbps},
                              {"write_GBps", r.write_gbps},
                              {"mixed_GBps", r.mixed_gbps},
                              {"io_bound_seconds", r.io_bound_seconds},
                              {"io_serial_seconds", r.io_serial_seconds},
                              {"io_pass_seconds", r.io_pass_seconds},
                              {"adam_bound_seconds", r.adam_bound_seconds},
                              {"io_ratio", r.io_ratio},
                              {"io_ratio_best", r.io_ratio_best},
                              {"adam_ratio", r.adam_ratio},
                              {"nvme_ratio", r.nvme_ratio},
                              {"bound_seconds", r.bound_seconds},
                              {"bound_ratio", r.bound_ratio},
                              {"host_bytes", r.host_bytes},
                              {"chunk_elements", r.chunk_elements},
                              {"buffers", r.buffers}};
  return WriteTextFile(path, nlohmann::ordered_json::array({j}).dump(2) + "\n");
}

// The options the step and engine profiles share, and where they go.
struct StateProfileArgs {
  uint64_t& params;
  int &tensors, &threads, &steps;
  StateHome& state_on;
  StatePrecision& state;
  std::vector<std::string>& paths;
  std::string &json_path, &trace_path;
};

// The number `v` spells in full (strtod's syntax), or nothing.
std::optional<double> ParseNumber(const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0') return std::nullopt;
  return x;
}

// Takes option `a` (value `v`) when it is one of StateProfileArgs'; false when it is not.
Result<bool> TakeStateProfileOption(const std::string& a, const std::string& v,
                                    const StateProfileArgs& out) {
  if (a == "--params") {
    if (!ParseByteSize(v, &out.params) || out.params == 0) {
      return InvalidArgumentError(StrCat("--params: '", v, "' is not a count such as 128M"));
    }
  } else if (a == "--threads") {
    // As zoffload.cpu_adam_threads: 100000 OpenMP threads overflowed libgomp's stack.
    ZO_ASSIGN_OR_RETURN(auto l, ParseIntList(a, v, 1, 4096));
    out.threads = l.front();
  } else if (a == "--tensors" || a == "--steps") {
    ZO_ASSIGN_OR_RETURN(auto l, ParseIntList(a, v, 1, 1 << 20));
    (a == "--tensors" ? out.tensors : out.steps) = l.front();
  } else if (a == "--state-on") {
    ZO_ASSIGN_OR_RETURN(
        auto l,
        ParseEnumList<StateHome>(a, v, {{"host", StateHome::kHost}, {"nvme", StateHome::kNvme}}));
    out.state_on = l.front();
  } else if (a == "--path") {
    out.paths.push_back(v);
  } else if (a == "--state") {
    ZO_ASSIGN_OR_RETURN(auto l, ParseEnumList(a, v, kStateNames));
    out.state = l.front();
  } else if (a == "--json") {
    ZO_ASSIGN_OR_RETURN(out.json_path, WritablePath(a, v));
  } else if (a == "--trace") {
    ZO_ASSIGN_OR_RETURN(out.trace_path, WritablePath(a, v));
  } else {
    return false;
  }
  return true;
}

int StepMain(const std::vector<std::string>& args, bool short_defaults) {
  StepBenchOptions o;
  if (short_defaults) o.params = uint64_t{32} << 20;
  std::string json_path;
  std::vector<std::string> paths;
  bool help = false;
  const StateProfileArgs shared{o.params, o.tensors, o.threads, o.steps,     o.state_on,
                                o.state,  paths,     json_path, o.trace_path};
  const Status parsed = ForEachOption(
      args, {"--no-checksums", "--durable"}, &help,
      [&](const std::string& a, const std::string& v) -> Status {
        ZO_ASSIGN_OR_RETURN(const bool taken, TakeStateProfileOption(a, v, shared));
        if (taken) return Status::Ok();
        if (a == "--no-checksums") {
          o.checksums = false;
        } else if (a == "--durable") {
          o.durable = true;
        } else if (a == "--buffers") {
          ZO_ASSIGN_OR_RETURN(auto l, ParseIntList(a, v, 2, 1 << 20));
          o.buffers = l.front();
        } else if (a == "--nvme-ratio") {
          o.nvme_ratio = ParseNumber(v).value_or(0);
          if (!(o.nvme_ratio > 0 && o.nvme_ratio <= 1)) {
            return InvalidArgumentError(
                StrCat("--nvme-ratio: '", v, "' is not a share in (0, 1] such as 0.25"));
          }
        } else if (a == "--chunk") {
          if (!ParseByteSize(v, &o.chunk_elements) || o.chunk_elements % 256 != 0 ||
              o.chunk_elements == 0) {
            return InvalidArgumentError(
                StrCat("--chunk: '", v, "' is not a positive multiple of 256 elements such as 4M"));
          }
        } else if (a == "--grad-dtype") {
          ZO_ASSIGN_OR_RETURN(auto l, ParseEnumList(a, v, kDTypeNames));
          o.grad_dtype = l.front();
          o.copy = o.grad_dtype == DType::kFp16 ? ParamCopy::kFp16 : ParamCopy::kBf16;
        } else if (a == "--config") {
          ZO_ASSIGN_OR_RETURN(const Config config, LoadConfigFile(v));
          o.aio = config.aio;
          o.buffers = config.zero_optimization.offload_optimizer.buffer_count;
          if (config.zero_optimization.offload_optimizer.device == OffloadDevice::kNvme) {
            o.nvme_ratio = config.zero_optimization.offload_optimizer.ratio;
          }
          o.state = config.zoffload.optimizer_state;
          if (config.zoffload.cpu_adam_threads > 0) o.threads = config.zoffload.cpu_adam_threads;
          SetCpuAdamCoreBinding(config.zoffload.cpu_adam_bind_cores);
          if (paths.empty()) paths = RuntimeOptions::FromConfig(config).nvme_paths;
        } else {
          return UnknownOption(a);
        }
        return Status::Ok();
      });
  if (help) return PrintUsage();
  if (!parsed.ok()) return Fail(parsed);
  if (!paths.empty()) o.paths = paths;
  auto r = RunStepBench(o);
  if (!r.ok()) return Fail(r.status());
  std::printf("\nstep: %llu params in %d tensors, %s state on %s, %s host memory held\n",
              static_cast<unsigned long long>(r->params), r->tensors, r->state.c_str(),
              r->state_on.c_str(), HumanBytes(r->host_bytes).c_str());
  std::printf("step_seconds        %8.3f\n", r->step_seconds);
  std::printf("adam_bound_seconds  %8.3f   (CPU Adam alone on the same data)   ratio %.3f\n",
              r->adam_bound_seconds, r->adam_ratio);
  if (r->state_on == "nvme") {
    std::printf("bytes read/written  %s / %s\n", HumanBytes(r->bytes_read).c_str(),
                HumanBytes(r->bytes_written).c_str());
    std::printf(
        "io_bound_seconds    %8.3f   (the disk alone, reads and writes at once: %.2f GB/s)"
        "   ratio %.3f\n",
        r->io_bound_seconds, r->mixed_gbps, r->io_ratio);
    std::printf("io_serial_seconds   %8.3f   (read %.2f GB/s, then write %.2f GB/s)\n",
                r->io_serial_seconds, r->read_gbps, r->write_gbps);
    std::printf("io_pass_seconds     %8.3f   (our pipeline moving the same bytes, no update)\n",
                r->io_pass_seconds);
    if (r->nvme_ratio < 1) {
      std::printf(
          "bound_seconds       %8.3f   (%.2f of the state on NVMe: the larger of the two bounds,"
          " the host share's Adam under the disk's work)   ratio %.3f\n",
          r->bound_seconds, r->nvme_ratio, r->bound_ratio);
    }
  }
  if (!o.trace_path.empty()) std::printf("trace written to %s\n", o.trace_path.c_str());
  if (!json_path.empty()) {
    if (Status s = WriteStepJson(json_path, *r); !s.ok()) return Fail(s);
  }
  return 0;
}

Status WriteEngineJson(const std::string& path, const EngineRecord& r) {
  nlohmann::ordered_json j = {{"profile", "engine"},
                              {"mode", r.mode},
                              {"overlap", r.overlap},
                              {"params", r.params},
                              {"tensors", r.tensors},
                              {"state", r.state},
                              {"state_on", r.state_on},
                              {"threads", r.threads},
                              {"step_seconds", r.step_seconds},
                              {"bound_seconds", r.bound_seconds},
                              {"ratio", r.ratio},
                              {"grads_seconds", r.grads_seconds},
                              {"grad_alone_seconds", r.grad_alone_seconds},
                              {"d2h_overhead", r.d2h_overhead},
                              {"update_seconds", r.update_seconds},
                              {"adam_alone_seconds", r.adam_alone_seconds},
                              {"adam_alone_gparams", r.adam_alone_gparams},
                              {"h2d_gbps", r.h2d_gbps},
                              {"chunk_upload_seconds", r.chunk_upload_seconds},
                              {"host_rss_bytes", r.host_rss_bytes},
                              {"engine_host_bytes", r.engine_host_bytes},
                              {"state_bytes", r.state_bytes},
                              {"host_ratio", r.host_ratio},
                              {"create_seconds", r.create_seconds},
                              {"gpu_bytes", r.gpu_bytes},
                              {"bucket_bytes", r.bucket_bytes},
                              {"bytes_to_host", r.bytes_to_host},
                              {"bytes_to_gpu", r.bytes_to_gpu}};
  return WriteTextFile(path, nlohmann::ordered_json::array({j}).dump(2) + "\n");
}

int EngineMain(const std::vector<std::string>& args, bool short_defaults) {
  EngineBenchOptions o;
  if (short_defaults) o.params = uint64_t{32} << 20;
  std::string json_path;
  std::vector<std::string> paths;
  bool help = false;
  const StateProfileArgs shared{o.params, o.tensors, o.threads, o.steps,     o.state_on,
                                o.state,  paths,     json_path, o.trace_path};
  const Status parsed = ForEachOption(
      args, {"--host"}, &help, [&](const std::string& a, const std::string& v) -> Status {
        ZO_ASSIGN_OR_RETURN(const bool taken, TakeStateProfileOption(a, v, shared));
        if (taken) return Status::Ok();
        if (a == "--host") {
          o.host_mode = true;
        } else if (a == "--bucket") {
          if (!ParseByteSize(v, &o.bucket_elements) || o.bucket_elements == 0) {
            return InvalidArgumentError(StrCat(a, ": '", v, "' is not a count such as 500M"));
          }
        } else if (a == "--overlap") {
          bool known = false;
          for (Overlap mode : {Overlap::kNone, Overlap::kBackward, Overlap::kDelayed}) {
            if (v == ToString(mode)) o.overlap = mode, known = true;
          }
          if (!known) {
            return InvalidArgumentError(
                StrCat("--overlap: '", v, "' is not none, backward or delayed"));
          }
        } else if (a == "--grad-ms") {
          o.grad_ms = ParseNumber(v).value_or(-1);
          if (!(o.grad_ms >= 0) || o.grad_ms > 1e6) {
            return InvalidArgumentError(StrCat("--grad-ms: '", v, "' is not milliseconds >= 0"));
          }
        } else {
          return UnknownOption(a);
        }
        return Status::Ok();
      });
  if (help) return PrintUsage();
  if (!parsed.ok()) return Fail(parsed);
  if (!paths.empty()) o.paths = paths;
  auto r = RunEngineBench(o);
  if (!r.ok()) return Fail(r.status());
  std::printf(
      "\nengine (%s mode, overlap %s): %llu params in %d tensors, %s state in %s, %d threads\n",
      r->mode.c_str(), r->overlap.c_str(), static_cast<unsigned long long>(r->params), r->tensors,
      r->state.c_str(), r->state_on.c_str(), r->threads);
  std::printf(
      "step_seconds          %8.3f   bound %.3f from gradients %.3f, CPU Adam %.3f, one "
      "chunk's upload %.4f   ratio %.3f (target <= 1.10)\n",
      r->step_seconds, r->bound_seconds, r->grad_alone_seconds, r->adam_alone_seconds,
      r->chunk_upload_seconds, r->ratio);
  std::printf(
      "gradients_seconds     %8.3f   (produced and in host memory) against %.3f "
      "produced alone: D2H adds %+.1f %% (target <= 5 %%)\n",
      r->grads_seconds, r->grad_alone_seconds, 100 * r->d2h_overhead);
  std::printf("update_seconds        %8.3f   (CPU Adam alone %.2f Gparam/s; H2D %.1f GB/s)\n",
              r->update_seconds, r->adam_alone_gparams, r->h2d_gbps);
  std::printf("host RSS              %s   (state + gradients %s: %.3fx; engine's count %s)\n",
              HumanBytes(r->host_rss_bytes).c_str(), HumanBytes(r->state_bytes).c_str(),
              r->host_ratio, HumanBytes(r->engine_host_bytes).c_str());
  if (r->state_on == "nvme") {
    std::printf(
        "(state on NVMe: the bound leaves the disk out; zoffload-bench step measures it)\n");
  }
  if (r->mode == "gpu") {
    std::printf("GPU memory            %s   (two buckets: %s)\n", HumanBytes(r->gpu_bytes).c_str(),
                HumanBytes(r->bucket_bytes).c_str());
  }
  if (!o.trace_path.empty()) std::printf("trace written to %s\n", o.trace_path.c_str());
  if (!json_path.empty()) {
    if (Status s = WriteEngineJson(json_path, *r); !s.ok()) return Fail(s);
  }
  return 0;
}

int GpuMain(const std::string& profile, const std::vector<std::string>& args, bool short_defaults) {
#if ZO_HAVE_CUDA
  GpuBenchOptions o;
  if (short_defaults) o.bytes = uint64_t{256} << 20;
  std::string json_path;
  bool help = false;
  const Status parsed =
      ForEachOption(args, {}, &help, [&](const std::string& a, const std::string& v) -> Status {
        if (a == "--size") {
          if (!ParseByteSize(v, &o.bytes) || o.bytes < 4096) {
            return InvalidArgumentError(
                StrCat("--size: '", v, "' is not a byte count of at least 4096 such as 1GiB"));
          }
          o.bytes &= ~uint64_t{4095};
        } else if (a == "--repeats") {
          ZO_ASSIGN_OR_RETURN(auto l, ParseIntList(a, v, 1, 1000));
          o.repeats = l.front();
        } else if (a == "--json") {
          ZO_ASSIGN_OR_RETURN(json_path, WritablePath(a, v));
        } else {
          return UnknownOption(a);
        }
        return Status::Ok();
      });
  if (help) return PrintUsage();
  if (!parsed.ok()) return Fail(parsed);
  if (auto gpus = UsableGpuCount(); !gpus.ok()) return Fail(gpus.status());
  auto records = profile == "pcie" ? RunPcieBench(o) : RunKernelBench(o);
  if (!records.ok()) return Fail(records.status());
  std::printf("\n%-22s %10s %9s %10s %8s  %s\n", "test", "bytes", "GB/s", "anchor", "ratio",
              "anchor is");
  for (const GpuRecord& r : *records) {
    std::printf("%-22s %10s %9.2f %10.2f %8.3f  %s\n", r.test.c_str(), ShortBytes(r.bytes).c_str(),
                r.gbps, r.anchor_gbps, r.ratio, r.anchor.c_str());
  }
  if (!json_path.empty()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const GpuRecord& r : *records) {
      list.push_back({{"profile", r.profile},
                      {"test", r.test},
                      {"bytes", r.bytes},
                      {"seconds", r.seconds},
                      {"GBps", r.gbps},
                      {"anchor", r.anchor},
                      {"anchor_GBps", r.anchor_gbps},
                      {"ratio", r.ratio}});
    }
    if (Status s = WriteTextFile(json_path, list.dump(2) + "\n"); !s.ok()) return Fail(s);
  }
  return 0;
#else
  (void)args;
  (void)short_defaults;
  return Fail(FailedPreconditionError(
      StrCat("zoffload-bench ", profile, ": this build has no CUDA (CPU-only)")));
#endif
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "-h" || args[0] == "--help")) return PrintUsage();
  if (!args.empty() && args[0] == "nvme") {
    return NvmeMain(std::vector<std::string>(args.begin() + 1, args.end()), false);
  }
  if (!args.empty() && args[0] == "adam") {
    return AdamMain(std::vector<std::string>(args.begin() + 1, args.end()), false);
  }
  if (!args.empty() && args[0] == "step") {
    return StepMain(std::vector<std::string>(args.begin() + 1, args.end()), false);
  }
  if (!args.empty() && args[0] == "engine") {
    return EngineMain(std::vector<std::string>(args.begin() + 1, args.end()), false);
  }
  if (!args.empty() && (args[0] == "pcie" || args[0] == "kernels")) {
    return GpuMain(args[0], std::vector<std::string>(args.begin() + 1, args.end()), false);
  }
  if (!args.empty() && args[0].rfind("--", 0) != 0) {
    std::fprintf(stderr,
                 "zoffload-bench: unknown profile '%s' (available: nvme, adam, step, engine, pcie, "
                 "kernels)\n%s",
                 args[0].c_str(), kUsage);
    return 2;
  }
  // Every profile this machine supports, short defaults.
  if (!args.empty()) {
    std::fprintf(stderr,
                 "zoffload-bench: options go after a profile name (nvme, adam, step, engine, pcie, "
                 "kernels)\n%s",
                 kUsage);
    return 2;
  }
  std::printf("== nvme (1 GiB temporary file in the current directory) ==\n");
  const int nvme = NvmeMain({}, true);
  std::printf("\n== adam (32M parameters, all physical cores) ==\n");
  const int adam = AdamMain({}, true);
  std::printf(
      "\n== step (32M parameters, fp32 state streamed from NVMe in the current directory) ==\n");
  const int step = StepMain({}, true);
  std::printf("\n== engine (32M parameters, fp32 state in host memory) ==\n");
  const int engine = EngineMain({}, true);
  int gpu = 0;
#if ZO_HAVE_CUDA
  if (auto gpus = UsableGpuCount(); gpus.ok()) {
    std::printf("\n== pcie (256 MiB transfers) ==\n");
    gpu = GpuMain("pcie", {}, true);
    std::printf("\n== kernels (256 MiB inputs) ==\n");
    gpu = std::max(gpu, GpuMain("kernels", {}, true));
  } else {
    std::printf("\n== pcie, kernels: skipped (%s) ==\n", gpus.status().message().c_str());
  }
#else
  std::printf("\n== pcie, kernels: skipped (this build has no CUDA) ==\n");
#endif
  for (int rc : {nvme, adam, step, engine, gpu}) {
    if (rc != 0) return rc;
  }
  return 0;
}

}  // namespace
}  // namespace zoffload::internal::bench

int main(int argc, char** argv) {
  // Line-buffered even into a pipe, so tables and stderr progress lines appear in order.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  zoffload::internal::bench::CatchStopSignals();
  return zoffload::internal::bench::Main(argc, argv);
}
