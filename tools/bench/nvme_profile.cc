#include "bench/nvme_profile.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "common/unique_fd.h"
#include "swap/io_engine.h"

namespace zoffload::internal::bench {
namespace {

// Whether `dir` is a file system in memory (tmpfs, ramfs), where O_DIRECT may be accepted.
bool InRam(const std::string& dir) {
  struct statfs fs {};
  return ::statfs(dir.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC);
}

// Block j of a pass lives in file j % N at offset (j / N) * block, like the swap space.
std::vector<IoSegment> Layout(const std::vector<int>& files, uint64_t size, uint64_t block,
                              std::byte* buffer, uint64_t buffer_size) {
  std::vector<IoSegment> segments;
  const uint64_t n = files.size();
  for (uint64_t j = 0; j * block < size; ++j) {
    IoSegment s;
    s.file = files[j % n];
    s.file_offset = (j / n) * block;
    s.data = buffer + (j * block) % buffer_size;
    s.length = std::min(block, size - j * block);
    segments.push_back(s);
  }
  return segments;
}

Result<std::vector<int>> OpenAll(IoEngine& engine, const std::vector<std::string>& files) {
  std::vector<int> ids;
  for (const std::string& f : files) {
    ZO_ASSIGN_OR_RETURN(const int id, engine.OpenFile(f, O_RDWR | O_CREAT));
    ids.push_back(id);
  }
  return ids;
}

}  // namespace

Result<std::vector<NvmeRecord>> RunNvmeBench(const NvmeBenchOptions& o) {
  if (o.paths.empty()) return InvalidArgumentError("nvme: no --path given");
  if (!o.file.empty() && o.paths.size() != 1) {
    return InvalidArgumentError("nvme: --file works with one --path only");
  }
  const uint64_t max_block = *std::max_element(o.block_sizes.begin(), o.block_sizes.end());
  for (uint64_t bs : o.block_sizes) {
    if (bs % 4096 != 0 || bs > (uint64_t{1} << 30)) {
      return InvalidArgumentError(
          StrCat("nvme: --block-size ", bs, " must be a multiple of 4096 up to 1 GiB"));
    }
  }
  // Every pass moves the same bytes: round the size up to whole largest blocks per path.
  const uint64_t stripe = max_block * o.paths.size();
  const uint64_t size = (o.size + stripe - 1) / stripe * stripe;
  const uint64_t per_path = size / o.paths.size();

  for (size_t i = 0; i < o.paths.size(); ++i) {  // one file per directory, each written once
    for (size_t j = 0; j < i; ++j) {
      if (NormalDirectory(o.paths[i]) == NormalDirectory(o.paths[j])) {
        return InvalidArgumentError(StrCat("nvme: --path ", o.paths[i], " is --path ", o.paths[j],
                                           " again; give each directory once"));
      }
    }
  }
  Scratch scratch;
  std::vector<std::string> paths;  // one file per directory
  bool in_ram = false;
  for (const std::string& dir : o.paths) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return StatusFromErrno(errno, StrCat("nvme: --path ", dir));
    if (!S_ISDIR(st.st_mode))
      return InvalidArgumentError(StrCat("nvme: --path ", dir, " is not a directory"));
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) == 0) {
      const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      if (free_bytes < per_path) {
        return Status(StatusCode::kResourceExhausted,
                      StrCat("disk full at ", dir, ": needed ", per_path, " bytes, ", free_bytes,
                             " free (use a smaller --size)"),
                      ENOSPC);
      }
    }
    std::string path = StrCat(dir, "/", o.file);
    if (o.file.empty()) {
      ZO_ASSIGN_OR_RETURN(path, scratch.AddFile(dir, "nvme"));
    }
    if (!o.file.empty() && !o.overwrite && ::stat(path.c_str(), &st) == 0) {
      return Status(StatusCode::kAlreadyExists,
                    StrCat("nvme: --file ", path,
                           " exists and the benchmark writes over it; pass --overwrite if that "
                           "is what you want"));
    }
    paths.push_back(path);
    if (InRam(dir)) {
      in_ram = true;
      std::fprintf(stderr,
                   "nvme: WARNING: %s is on tmpfs/ramfs: the figures will be memory speed, not "
                   "a disk's\n",
                   dir.c_str());
    }
  }
  // One working buffer, big enough for every piece in flight in the largest setting.
  const int max_qd = *std::max_element(o.queue_depths.begin(), o.queue_depths.end());
  const int max_threads = *std::max_element(o.threads.begin(), o.threads.end());
  const uint64_t buffer_size =
      std::min<uint64_t>(size, max_block * static_cast<uint64_t>(max_qd) * max_threads);
  ZO_ASSIGN_OR_RETURN(AlignedBuffer buffer,
                      AlignedBuffer::Allocate(buffer_size, 4096, /*prefault=*/true));
  for (uint64_t i = 0; i < buffer_size; i += 8) {
    const uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(buffer.data() + i, &v, std::min<uint64_t>(8, buffer_size - i));
  }

  // Lay the files out fully (untimed): reads must hit written blocks, never holes. A --file
  // that already holds the size is taken as laid out (comparisons reuse one file).
  bool laid_out = !o.file.empty();
  for (const std::string& p : paths) {
    struct stat st {};
    laid_out =
        laid_out && ::stat(p.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) >= per_path;
  }
  if (!laid_out) {
    IoEngineOptions eo;
    eo.aio.block_size = static_cast<int64_t>(std::min<uint64_t>(max_block, 4 << 20));
    eo.aio.queue_depth = 16;
    ZO_ASSIGN_OR_RETURN(auto engine, IoEngine::Create(eo));
    ZO_ASSIGN_OR_RETURN(std::vector<int> files, OpenAll(*engine, paths));
    for (size_t i = 0; i < files.size(); ++i) {
      if (::fallocate(engine->fd(files[i]), 0, 0, static_cast<off_t>(per_path)) != 0 &&
          errno != EOPNOTSUPP) {
        return StatusFromErrno(errno, StrCat("reserve ", per_path, " bytes in ", paths[i]));
      }
    }
    // In batches of 64 blocks, for progress.
    Progress layout("nvme: laying out the file(s)", size, /*bytes=*/true);
    std::vector<IoSegment> all = Layout(files, size, eo.aio.block_size, buffer.data(), buffer_size);
    for (size_t first = 0; first < all.size(); first += 64) {
      std::vector<IoSegment> batch(
          all.begin() + static_cast<ptrdiff_t>(first),
          all.begin() + static_cast<ptrdiff_t>(std::min(first + 64, all.size())));
      uint64_t bytes = 0;
      for (const IoSegment& seg : batch) bytes += seg.length;
      ZO_RETURN_IF_ERROR(
          engine->Submit(IoOp::kWrite, std::move(batch), "nvme bench layout").Wait());
      layout.Advance(bytes);
    }
    for (int f : files) {
      if (::fsync(engine->fd(f)) != 0)
        return StatusFromErrno(errno, StrCat("fsync ", engine->path(f)));
    }
  }

  std::vector<NvmeRecord> records;
  const int total = static_cast<int>(o.block_sizes.size() * o.queue_depths.size() *
                                     o.threads.size() * o.ops.size());
  Progress progress("nvme", total);
  for (uint64_t bs : o.block_sizes) {
    for (int qd : o.queue_depths) {
      for (int t : o.threads) {
        IoEngineOptions eo;
        eo.aio.block_size = static_cast<int64_t>(bs);
        eo.aio.queue_depth = qd;
        eo.aio.intra_op_parallelism = t;
        eo.aio.single_submit = o.single_submit;
        eo.aio.overlap_events = o.overlap_events;
        ZO_ASSIGN_OR_RETURN(auto engine, IoEngine::Create(eo));
        ZO_ASSIGN_OR_RETURN(std::vector<int> files, OpenAll(*engine, paths));
        ZO_RETURN_IF_ERROR(engine->RegisterBuffer(buffer.span()));
        for (const std::string& op : o.ops) {
          const IoOp io_op = op == "read" ? IoOp::kRead : IoOp::kWrite;
          auto segments = Layout(files, size, bs, buffer.data(), buffer_size);
          const auto start = std::chrono::steady_clock::now();
          ZO_RETURN_IF_ERROR(engine->Submit(io_op, std::move(segments), "nvme bench").Wait());
          const double seconds = SecondsSince(start);
          if (io_op == IoOp::kWrite) {
            // Flushed outside the timed region, as fio counts bandwidth up to completion.
            for (int f : files) ::fdatasync(engine->fd(f));
          }
          NvmeRecord r;
          r.op = op;
          r.block_size = bs;
          r.queue_depth = qd;
          r.threads = t;
          r.single_submit = o.single_submit;
          r.overlap_events = o.overlap_events;
          r.bytes = size;
          r.seconds = seconds;
          r.gbps = static_cast<double>(size) / r.seconds / 1e9;
          r.direct = engine->direct(files[0]);
          r.in_ram = in_ram;
          r.backend = std::string(engine->backend_name());
          r.registered = engine->registration();
          records.push_back(r);
          progress.Step(StrCat(op, " bs=", ShortBytes(bs), " qd=", qd, " threads=", t, ": ", r.gbps,
                               " GB/s"));
        }
      }
    }
  }
  return records;
}

AioConfig RecommendAio(const std::vector<NvmeRecord>& records) {
  using Key = std::tuple<uint64_t, int, int>;
  std::map<Key, std::pair<double, double>> speeds;  // read, write
  for (const NvmeRecord& r : records) {
    auto& s = speeds[{r.block_size, r.queue_depth, r.threads}];
    (r.op == "read" ? s.first : s.second) = r.gbps;
  }
  double best = -1;
  Key best_key{1 << 20, 8, 1};
  for (const auto& [key, s] : speeds) {
    const auto [read, write] = s;
    const double score =
        read > 0 && write > 0 ? 2 * read * write / (read + write) : std::max(read, write);
    if (score > best) {
      best = score;
      best_key = key;
    }
  }
  AioConfig aio;
  aio.block_size = static_cast<int64_t>(std::get<0>(best_key));
  aio.queue_depth = std::get<1>(best_key);
  aio.intra_op_parallelism = std::get<2>(best_key);
  for (const NvmeRecord& r : records) {
    if (Key{r.block_size, r.queue_depth, r.threads} == best_key) {
      aio.single_submit = r.single_submit;
      aio.overlap_events = r.overlap_events;
    }
  }
  return aio;
}

std::string AioConfigJson(const AioConfig& aio) {
  // Through the config serializer, so the keys are exactly those the parser reads.
  Config config;
  config.aio = aio;
  const auto full = nlohmann::ordered_json::parse(SerializeConfig(config));
  const nlohmann::ordered_json j = {{"aio", full.at("aio")}};
  return j.dump(2) + "\n";
}

}  // namespace zoffload::internal::bench
