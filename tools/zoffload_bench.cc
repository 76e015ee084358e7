// zoffload-bench: what this machine's disks (and, as they land, CPU and PCIe) can sustain,
// with the settings that get there.
//
//   zoffload-bench                 every profile this machine supports, short defaults
//   zoffload-bench nvme [options]  NVMe sweep; --help lists the options
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "bench/nvme_profile.h"
#include "common/strings.h"
#include "zoffload/config.h"

namespace zoffload::bench {
namespace {

constexpr const char* kUsage = R"(usage: zoffload-bench [nvme] [options]

With no subcommand: every profile this machine supports, with short defaults (a 1 GiB
temporary file in the current directory), then a table.

zoffload-bench nvme [--path DIR ...] [--size 4GiB] [--block-size 1M,4M] [--queue-depth 8,32]
                    [--threads 1,2] [--op write,read] [--single-submit] [--no-overlap-events]
                    [--file NAME] [--json FILE] [--config ds.json] [--write-aio-config FILE]
  --path DIR             directory to test; repeat to stripe over several disks (default: .)
  --size N               bytes moved per pass, all paths together (default 4GiB)
  --block-size LIST      aio.block_size values to sweep
  --queue-depth LIST     aio.queue_depth values to sweep
  --threads LIST         aio.intra_op_parallelism values to sweep
  --op LIST              write and/or read (a write pass runs before reads of the same setting)
  --file NAME            use DIR/NAME and keep it (default: a temporary file, removed); an
                         existing DIR/NAME of at least the size is used as already written
  --json FILE            write every measurement as a JSON list
  --config FILE          take aio settings and NVMe paths from a zoffload/DeepSpeed config
  --write-aio-config F   write the recommended {"aio": {...}} block to F
Speeds are O_DIRECT (never the page cache); 1 GB/s = 1e9 bytes/s.
)";

int Fail(const Status& s) {
  std::fprintf(stderr, "zoffload-bench: %s\n", s.message().c_str());
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
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

Status WriteJson(const std::string& path, const std::vector<NvmeRecord>& records) {
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
                    {"backend", r.backend},
                    {"registered", r.registered}});
  }
  std::ofstream out(path);
  out << list.dump(2) << "\n";
  out.close();
  if (!out) return Status(StatusCode::kIoError, StrCat("cannot write ", path), errno);
  return Status::Ok();
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
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= args.size()) return InvalidArgumentError(StrCat(a, " needs a value"));
      return args[++i];
    };
    Status s;
    if (a == "-h" || a == "--help") {
      std::printf("%s", kUsage);
      return 0;
    } else if (a == "--single-submit") {
      o.single_submit = true;
    } else if (a == "--no-overlap-events") {
      o.overlap_events = false;
    } else {
      auto v = value();
      if (!v.ok()) return Fail(v.status());
      if (a == "--path") {
        paths.push_back(*v);
      } else if (a == "--size") {
        if (!ParseByteSize(*v, &o.size) || o.size == 0) {
          return Fail(
              InvalidArgumentError(StrCat("--size: '", *v, "' is not a size such as 4GiB")));
        }
      } else if (a == "--block-size") {
        auto l = ParseSizeList(a, *v);
        if (!l.ok()) return Fail(l.status());
        o.block_sizes = *l;
        sweep_given = true;
      } else if (a == "--queue-depth") {
        auto l = ParseIntList(a, *v, 1, 4096);
        if (!l.ok()) return Fail(l.status());
        o.queue_depths = *l;
        sweep_given = true;
      } else if (a == "--threads") {
        auto l = ParseIntList(a, *v, 1, 256);
        if (!l.ok()) return Fail(l.status());
        o.threads = *l;
        sweep_given = true;
      } else if (a == "--op") {
        auto l = ParseWordList(a, *v, {"write", "read"});
        if (!l.ok()) return Fail(l.status());
        o.ops = *l;
      } else if (a == "--file") {
        o.file = *v;
      } else if (a == "--json") {
        json_path = *v;
      } else if (a == "--config") {
        config_path = *v;
      } else if (a == "--write-aio-config") {
        aio_out = *v;
      } else {
        return Fail(InvalidArgumentError(StrCat("unknown option '", a, "'; see --help")));
      }
    }
  }
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
  std::printf("recommended aio config:\n%s", AioConfigJson(aio).c_str());
  if (!json_path.empty()) {
    if (Status s = WriteJson(json_path, *records); !s.ok()) return Fail(s);
  }
  if (!aio_out.empty()) {
    std::ofstream out(aio_out);
    out << AioConfigJson(aio);
    out.close();
    if (!out) return Fail(Status(StatusCode::kIoError, StrCat("cannot write ", aio_out), errno));
    std::printf("wrote %s\n", aio_out.c_str());
  }
  return 0;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "-h" || args[0] == "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  if (!args.empty() && args[0] == "nvme") {
    return NvmeMain(std::vector<std::string>(args.begin() + 1, args.end()), false);
  }
  if (!args.empty() && args[0].rfind("--", 0) != 0) {
    std::fprintf(stderr, "zoffload-bench: unknown profile '%s' (available: nvme)\n%s",
                 args[0].c_str(), kUsage);
    return 2;
  }
  // Every profile this machine supports, short defaults.
  std::printf("== nvme (1 GiB temporary file in the current directory) ==\n");
  return NvmeMain(args, true);
}

}  // namespace
}  // namespace zoffload::bench

int main(int argc, char** argv) { return zoffload::bench::Main(argc, argv); }
