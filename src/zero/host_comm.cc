#include "zero/host_comm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <thread>

#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/log.h"
#include "common/strings.h"
#include "common/unique_fd.h"

namespace zoffload::internal::zero {
namespace {

constexpr uint32_t kMagic = 0x7a6f4843;  // "zoHC": rank 0 finished setting the header up
constexpr int kMaxWorld = 1024;

// A collective's kind, in the top bits of its call word (the size below them).
enum Kind : uint64_t { kAllReduce = 1, kReduceScatter = 2, kAllGather = 3 };
constexpr int kKindShift = 60;

// How often a waiting rank checks that the ranks it waits for are still alive.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);
// Segments of this prefix in /dev/shm are HostComm's (ZeroOptimizer names them so).
constexpr std::string_view kSegmentPrefix = "zoffload-";

// False only when `pid` is known to be gone: no such process (kill(2): ESRCH; EPERM means it
// runs as another user), or a zombie (exited, not yet reaped by its parent). 0: not attached
// yet, so not known to be gone.
bool Alive(int32_t pid) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0) return errno != ESRCH;
  // /proc/PID/stat: "PID (COMM) STATE ..."; COMM may hold spaces and parentheses.
  char stat[512];
  const int fd = ::open(StrCat("/proc/", pid, "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;
  const ssize_t n = ::read(fd, stat, sizeof(stat) - 1);
  ::close(fd);
  if (n <= 0) return true;
  const std::string_view text(stat, static_cast<size_t>(n));
  const size_t close = text.rfind(')');
  return close == std::string_view::npos || close + 2 >= text.size() || text[close + 2] != 'Z';
}

std::string DescribeCall(uint64_t call) {
  const uint64_t size = call & ((uint64_t{1} << kKindShift) - 1);
  switch (call >> kKindShift) {
    case kAllReduce:
      return StrCat("an all-reduce of ", size, " floats");
    case kReduceScatter:
      return StrCat("a reduce-scatter of ", size, " floats per rank");
    case kAllGather:
      return StrCat("an all-gather of ", size, " bytes per rank");
    default:
      return "no collective";
  }
}

}  // namespace

struct HostComm::Header {
  std::atomic<uint32_t> magic;
  std::atomic<uint32_t> world;
  std::atomic<uint32_t> aborted;             // a rank gave up waiting
  std::atomic<uint32_t> count;               // ranks at the current barrier
  std::atomic<uint64_t> generation;          // barriers completed
  std::atomic<uint64_t> arrived[kMaxWorld];  // each rank's barriers reached
  std::atomic<uint64_t> call[kMaxWorld];     // each rank's current collective (Kind, size)
  std::atomic<int32_t> pid[kMaxWorld];       // each rank's process, once it has attached
  std::atomic<uint64_t> pidns[kMaxWorld];    // and its pid namespace (PidNamespace)
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

namespace {

// This process's pid namespace (the inode of /proc/self/ns/pid; 0 when unknown): a pid names
// the same process only within one namespace (ranks in containers of their own may share
// /dev/shm, not pids).
uint64_t PidNamespace() {
  static const uint64_t ns = [] {
    struct stat st {};
    return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
  }();
  return ns;
}

// Rank r's pid as this process can check it (0, "not known to be gone", from another namespace).
int32_t VisiblePid(const HostComm::Header& h, int r) {
  return h.pidns[r].load() == PidNamespace() ? h.pid[r].load() : 0;
}

// Records this process as rank r's.
void Attach(HostComm::Header& h, int r) {
  h.pidns[r].store(PidNamespace());
  h.pid[r].store(static_cast<int32_t>(::getpid()));
}

// Removes the names of segments in /dev/shm whose rank 0 died before every rank joined (a
// joined run's segment has no name left): the one leftover a kill can make, which no process
// of that run remains to remove. A segment too small to hold a header is removed once it is a
// minute old (its creator died between creating and sizing it).
void RemoveAbandonedSegments() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(kSegmentPrefix)) continue;
    UniqueFd fd(::shm_open(("/" + name).c_str(), O_RDONLY, 0));
    struct stat st {};
    if (!fd.valid() || ::fstat(fd.get(), &st) != 0) continue;
    bool abandoned = false;
    if (static_cast<size_t>(st.st_size) < sizeof(HostComm::Header)) {
      abandoned = ::time(nullptr) - st.st_mtime > 60;
    } else {
      void* map = ::mmap(nullptr, sizeof(HostComm::Header), PROT_READ, MAP_SHARED, fd.get(), 0);
      if (map == MAP_FAILED) continue;
      const int32_t creator = VisiblePid(*static_cast<const HostComm::Header*>(map), 0);
      abandoned = creator > 0 && !Alive(creator);
      ::munmap(map, sizeof(HostComm::Header));
    }
    if (abandoned && ::shm_unlink(("/" + name).c_str()) == 0) {
      Log(LogLevel::kWarning, StrCat("host communicator: removed /dev/shm/", name,
                                     ", left by a run whose rank 0 died before every rank joined"));
    }
  }
}

}  // namespace

namespace {

using Deadline = std::chrono::steady_clock::time_point;

// Rank 0: a new segment `path` of `bytes` (a stale one of a run with the same name removed).
Result<UniqueFd> CreateSegment(const std::string& path, size_t bytes) {
  RemoveAbandonedSegments();
  ::shm_unlink(path.c_str());  // a stale segment of a run with the same name
  UniqueFd fd(::shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
  if (!fd.valid()) return StatusFromErrno(errno, StrCat("host communicator: creating ", path));
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::shm_unlink(path.c_str());
    return StatusFromErrno(err,
                           StrCat("host communicator: sizing ", path, " to ", bytes, " bytes"));
  }
  return fd;
}

// The other ranks: rank 0's segment `path`, once it is there at its full size.
Result<UniqueFd> AwaitSegment(const std::string& path, size_t bytes, const HostComm::Options& o,
                              Deadline deadline) {
  while (true) {
    UniqueFd fd(::shm_open(path.c_str(), O_RDWR, 0600));
    struct stat st {};
    if (fd.valid() && ::fstat(fd.get(), &st) == 0 && static_cast<size_t>(st.st_size) == bytes) {
      return fd;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status(StatusCode::kUnavailable,
                    StrCat("host communicator: rank ", o.rank, " found no segment ", path, " of ",
                           bytes, " bytes from rank 0 within ", o.timeout.count(),
                           " ms (is rank 0 running, with the same world and region size?)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The other ranks: until rank 0 has set the segment's header up (UNAVAILABLE if it died first:
// the segment is removed, as rank 0 cannot any more).
Status AwaitSetUp(HostComm::Header& h, const std::string& path, const HostComm::Options& o,
                  Deadline deadline) {
  while (h.magic.load(std::memory_order_acquire) != kMagic) {
    if (!Alive(VisiblePid(h, 0))) {
      ::shm_unlink(path.c_str());
      return Status(StatusCode::kUnavailable,
                    StrCat("host communicator: rank 0 (pid ", h.pid[0].load(), ") of ", path,
                           " died while setting it up; removed the segment"));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status(StatusCode::kUnavailable, StrCat("host communicator: rank 0 did not set ", path,
                                                     " up within ", o.timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<HostComm>> HostComm::Create(const Options& o) {
  const uint64_t unit = 4 * static_cast<uint64_t>(std::max(o.world, 1));
  if (o.world < 1 || o.world > kMaxWorld || o.rank < 0 || o.rank >= o.world || o.name.empty() ||
      o.name.find('/') != std::string::npos || o.region_bytes < unit || o.region_bytes % 4 != 0) {
    return InvalidArgumentError(
        StrCat("host communicator: rank ", o.rank, " of world ", o.world, ", name '", o.name,
               "', regions of ", o.region_bytes, " bytes: needs 0 <= rank < world <= ", kMaxWorld,
               ", a name without '/', and regions of at least 4 x world bytes, a multiple of 4"));
  }
  std::unique_ptr<HostComm> comm(new HostComm(o));
  const std::string path = "/" + o.name;
  comm->map_bytes_ = RoundUp(sizeof(Header), 4096) + static_cast<size_t>(o.region_bytes) * o.world;
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  UniqueFd fd;
  if (o.rank == 0) {
    ZO_ASSIGN_OR_RETURN(fd, CreateSegment(path, comm->map_bytes_));
  } else {
    ZO_ASSIGN_OR_RETURN(fd, AwaitSegment(path, comm->map_bytes_, o, deadline));
  }
  void* map = ::mmap(nullptr, comm->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return StatusFromErrno(errno, StrCat("host communicator: mapping ", path));
  comm->map_ = map;
  comm->header_ = static_cast<Header*>(map);
  Header& h = *comm->header_;
  if (o.rank == 0) {  // the segment starts zeroed
    Attach(h, 0);
    h.world.store(static_cast<uint32_t>(o.world));
    h.magic.store(kMagic, std::memory_order_release);
  } else {
    ZO_RETURN_IF_ERROR(AwaitSetUp(h, path, o, deadline));
    if (h.world.load() != static_cast<uint32_t>(o.world)) {
      return InvalidArgumentError(StrCat("host communicator: rank ", o.rank, " has world size ",
                                         o.world, "; rank 0 has ", h.world.load()));
    }
    Attach(h, o.rank);
  }
  // Everyone is attached before anyone goes on. Then rank 0 removes the name: a run killed
  // later leaves nothing in /dev/shm, and a relaunch under the same name (torchrun restarts
  // keep it) cannot attach to this run's segment.
  if (Status joined = comm->Barrier(); !joined.ok()) {
    // Rank 0 gone before everyone joined: no one else would remove the name.
    if (o.rank != 0 && !Alive(VisiblePid(h, 0))) ::shm_unlink(path.c_str());
    return joined.WithContext("host communicator: joining");
  }
  // Every rank removes the name (the first one does it; ENOENT for the others): a rank 0 killed
  // right after joining cannot leave it behind.
  ::shm_unlink(path.c_str());
  comm->named_ = false;
  return comm;
}

HostComm::~HostComm() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  // Rank 0 failed before everyone joined: the name is still there.
  if (options_.rank == 0 && named_) ::shm_unlink(("/" + options_.name).c_str());
}

std::byte* HostComm::region(int rank) const {
  return static_cast<std::byte*>(map_) + RoundUp(sizeof(Header), 4096) +
         static_cast<size_t>(options_.region_bytes) * rank;
}

Status HostComm::Broken() const {
  if (!broken_.ok()) return broken_;
  if (header_->aborted.load(std::memory_order_acquire) != 0) {
    return Status(StatusCode::kCancelled, StrCat("host communicator '", options_.name,
                                                 "': another rank gave up waiting (a rank died or "
                                                 "did not arrive); this run cannot go on"));
  }
  return Status::Ok();
}

Status HostComm::Barrier() {
  ZO_RETURN_IF_ERROR(Broken());
  Header& h = *header_;
  const uint64_t generation = h.generation.load(std::memory_order_acquire);
  h.arrived[options_.rank].store(++barriers_, std::memory_order_release);
  if (h.count.fetch_add(1, std::memory_order_acq_rel) + 1 ==
      static_cast<uint32_t>(options_.world)) {
    h.count.store(0, std::memory_order_relaxed);
    h.generation.fetch_add(1, std::memory_order_acq_rel);
    return Status::Ok();
  }
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options_.timeout;
  auto next_check = start + kLivenessPeriod;
  for (int spins = 0; h.generation.load(std::memory_order_acquire) == generation; ++spins) {
    ZO_RETURN_IF_ERROR(Broken());
    const auto now = std::chrono::steady_clock::now();
    if (now > next_check) {  // a rank that died will never arrive: no need to wait it out
      next_check = now + kLivenessPeriod;
      for (int r = 0; r < options_.world; ++r) {
        const int32_t pid = VisiblePid(h, r);
        if (h.arrived[r].load() >= barriers_ || Alive(pid)) continue;
        h.aborted.store(1, std::memory_order_release);
        broken_ = Status(StatusCode::kUnavailable,
                         StrCat("host communicator '", options_.name, "': rank(s) ", r,
                                " did not reach barrier ", barriers_, ": rank ", r, " (pid ", pid,
                                ") has died; this run cannot go on"));
        return broken_;
      }
    }
    if (now > deadline) {
      std::string missing;
      for (int r = 0; r < options_.world; ++r) {
        if (h.arrived[r].load() < barriers_) missing += StrCat(missing.empty() ? "" : ", ", r);
      }
      h.aborted.store(1, std::memory_order_release);
      broken_ =
          Status(StatusCode::kUnavailable,
                 StrCat("host communicator '", options_.name, "': rank(s) ", missing,
                        " did not reach barrier ", barriers_, " within ", options_.timeout.count(),
                        " ms (died or stuck); this run cannot go on"));
      return broken_;
    }
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return Status::Ok();
}

// Every rank's call word is stored before the barrier, and none changes before the next one:
// ranks that called different collectives (a bug in the caller's order) all see it, and fail
// instead of mixing each other's data.
Status HostComm::Begin(uint64_t kind, uint64_t size) {
  const uint64_t mine = kind << kKindShift | size;
  header_->call[options_.rank].store(mine, std::memory_order_release);
  ZO_RETURN_IF_ERROR(Barrier());
  for (int q = 0; q < options_.world; ++q) {
    const uint64_t theirs = header_->call[q].load(std::memory_order_acquire);
    if (theirs != mine) {
      broken_ =
          Status(StatusCode::kInternal,
                 StrCat("host communicator '", options_.name, "': rank ", options_.rank, " called ",
                        DescribeCall(mine), ", rank ", q, " ", DescribeCall(theirs),
                        ": every rank must call the same collectives in the same order; "
                        "this run cannot go on"));
      return broken_;
    }
  }
  return Status::Ok();
}

// out[i] = region 0's [at + i], then region 1's added, ... (rank order), i < n: one pass per
// rank, each a loop the compiler vectorizes.
void HostComm::AddInRankOrder(uint64_t at, uint64_t n, float* out) const {
  std::memcpy(out, reinterpret_cast<const float*>(region(0)) + at, 4 * n);
  for (int q = 1; q < options_.world; ++q) {
    const float* in = reinterpret_cast<const float*>(region(q)) + at;
    for (uint64_t i = 0; i < n; ++i) out[i] += in[i];
  }
}

Status HostComm::AllReduceSum(float* data, uint64_t n) {
  const uint64_t chunk = options_.region_bytes / 4;
  auto* mine = reinterpret_cast<float*>(region(options_.rank));
  for (uint64_t first = 0; first < n; first += chunk) {
    const uint64_t len = std::min(chunk, n - first);
    std::memcpy(mine, data + first, len * 4);
    ZO_RETURN_IF_ERROR(first == 0 ? Begin(kAllReduce, n) : Barrier());
    AddInRankOrder(0, len, data + first);
    ZO_RETURN_IF_ERROR(Barrier());
  }
  return Status::Ok();
}

Status HostComm::ReduceScatterSum(const float* send, float* recv, uint64_t count) {
  if (options_.world == 1) {  // the sum of one rank's values: those values
    std::memcpy(recv, send, count * 4);
    return Status::Ok();
  }
  const auto world = static_cast<uint64_t>(options_.world);
  const uint64_t chunk = options_.region_bytes / (4 * world);  // of each rank's part
  auto* mine = reinterpret_cast<float*>(region(options_.rank));
  const auto me = static_cast<uint64_t>(options_.rank);
  for (uint64_t first = 0; first < count; first += chunk) {
    const uint64_t len = std::min(chunk, count - first);
    for (uint64_t k = 0; k < world; ++k)
      std::memcpy(mine + k * len, send + k * count + first, len * 4);
    ZO_RETURN_IF_ERROR(first == 0 ? Begin(kReduceScatter, count) : Barrier());
    AddInRankOrder(me * len, len, recv + first);
    ZO_RETURN_IF_ERROR(Barrier());
  }
  return Status::Ok();
}

Status HostComm::AllGather(const void* send, void* recv, uint64_t bytes) {
  if (options_.world == 1) {
    std::memcpy(recv, send, bytes);
    return Status::Ok();
  }
  const uint64_t chunk = options_.region_bytes;
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  for (uint64_t first = 0; first < bytes; first += chunk) {
    const uint64_t len = std::min(chunk, bytes - first);
    std::memcpy(region(options_.rank), in + first, len);
    ZO_RETURN_IF_ERROR(first == 0 ? Begin(kAllGather, bytes) : Barrier());
    for (int q = 0; q < options_.world; ++q) {
      std::memcpy(out + static_cast<uint64_t>(q) * bytes + first, region(q), len);
    }
    ZO_RETURN_IF_ERROR(Barrier());
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::zero
