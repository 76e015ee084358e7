#include "swap/io_engine.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/log.h"
#include "common/strings.h"
#include "common/topology.h"
#include "common/unique_fd.h"
#include "swap/crc32c.h"
#include "swap/direct_io.h"

namespace zoffload::internal {

namespace {

constexpr size_t kMaxRegisteredChunk = size_t{1} << 30;  // the kernel's per-buffer limit
constexpr int kMaxRetries = 1000;                        // EINTR/EAGAIN resubmissions per piece

struct FileEntry {
  UniqueFd fd;
  std::string path;
  bool direct = false;
  uint32_t alignment = 1;         // file offsets and O_DIRECT lengths
  uint32_t memory_alignment = 1;  // O_DIRECT buffer addresses
};

}  // namespace

struct Piece;

struct IoRequestState {
  std::mutex mu;
  Status status;
  std::atomic<uint64_t> remaining{0};
  std::string label;
  IoOp op = IoOp::kRead;
  std::vector<Piece> pieces;
  Promise<> finished;

  void Fail(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (status.ok()) status = s;
  }
  void Finish() {
    finished.Set(status);  // every piece is done: no other thread touches status
  }
};

struct Piece {
  // Keeps the request alive while the piece is in flight; dropped when the piece completes.
  std::shared_ptr<IoRequestState> request;
  const FileEntry* file = nullptr;
  int file_slot = -1;
  uint64_t offset = 0;  // in the file
  std::byte* data = nullptr;
  uint32_t len = 0;  // logical bytes
  uint32_t* crc = nullptr;
  uint64_t logical_offset = 0;
  int buf_slot = -1;
  bool bounce = false;
  // I/O-thread state.
  uint32_t done = 0;  // bytes of the I/O already transferred
  int retries = 0;
  int bounce_slot = -1;
  bool started = false;

  uint32_t io_len() const {
    return bounce ? static_cast<uint32_t>(RoundUp(len, file->alignment)) : len;
  }
};

// ---- the engine -------------------------------------------------------------------------

struct IoEngine::Impl {
  struct Worker {
    std::unique_ptr<IoBackend> backend;
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Piece*> queue;  // from Submit
    bool stop = false;
    // Owned by the I/O thread.
    std::deque<Piece*> retry;
    unsigned inflight = 0;
    std::vector<AlignedBuffer> bounce;
    std::vector<int> free_bounce;
  };

  IoEngineOptions options;
  std::vector<std::unique_ptr<Worker>> workers;
  std::optional<Topology> topology;
  std::atomic<uint64_t> next_worker{0};

  mutable std::shared_mutex files_mu;
  std::vector<std::unique_ptr<FileEntry>> files;  // index = registered slot
  std::map<std::string, DirectIoInfo> probed_dirs;

  struct BufferRange {
    std::byte* begin;
    std::byte* end;
    int slot;
  };
  mutable std::shared_mutex buffers_mu;
  std::vector<BufferRange> buffers;
  std::vector<int> free_buffer_slots;
  bool registration = false;

  std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, pieces{0}, resubmitted{0}, bounced{0};

  const FileEntry* File(int id) const {
    std::shared_lock<std::shared_mutex> lock(files_mu);
    if (id < 0 || id >= static_cast<int>(files.size())) return nullptr;
    return files[id].get();
  }

  int BufferSlotFor(const std::byte* p, uint64_t len) const {
    std::shared_lock<std::shared_mutex> lock(buffers_mu);
    for (const BufferRange& r : buffers) {
      if (p >= r.begin && p + len <= r.end) return r.slot;
    }
    return -1;
  }

  void Run(Worker& w, int index);
  void Start(Worker& w, Piece* p);
  void Complete(Worker& w, Piece* p, int32_t res);
  void FinishPiece(Worker& w, Piece* p);
  std::string Describe(const Piece& p) const;
};

std::string IoEngine::Impl::Describe(const Piece& p) const {
  return StrCat(p.request->op == IoOp::kRead ? "read of " : "write of ", p.request->label, " (",
                p.file->path, " at offset ", p.offset + p.done, ", ", p.io_len() - p.done,
                " bytes)");
}

void IoEngine::Impl::Start(Worker& w, Piece* p) {
  if (!p->started) {
    p->started = true;
    if (p->request->op == IoOp::kWrite && p->crc != nullptr) *p->crc = Crc32c(p->data, p->len);
    if (p->bounce) {
      if (w.free_bounce.empty()) {
        // Lazily: at most queue_depth bounce buffers per thread, only if ever needed.
        auto buffer = AlignedBuffer::Allocate(options.aio.block_size, 4096);
        if (!buffer.ok()) {
          p->request->Fail(buffer.status().WithContext(Describe(*p)));
          p->done = p->io_len();  // nothing to transfer; completes below without I/O
          return;
        }
        w.bounce.push_back(std::move(buffer).value());
        w.free_bounce.push_back(static_cast<int>(w.bounce.size()) - 1);
      }
      p->bounce_slot = w.free_bounce.back();
      w.free_bounce.pop_back();
      ++bounced;
      if (p->request->op == IoOp::kWrite) {
        std::byte* b = w.bounce[p->bounce_slot].data();
        std::memcpy(b, p->data, p->len);
        std::memset(b + p->len, 0, p->io_len() - p->len);
      }
    }
  }
  IoPieceDesc desc;
  desc.op = p->request->op;
  desc.fd = p->file->fd.get();
  desc.file_slot = p->file_slot;
  desc.offset = p->offset + p->done;
  desc.buf = (p->bounce ? w.bounce[p->bounce_slot].data() : p->data) + p->done;
  desc.len = p->io_len() - p->done;
  desc.buf_slot = p->bounce ? -1 : p->buf_slot;
  const Status s = w.backend->Prepare(desc, reinterpret_cast<uint64_t>(p));
  if (!s.ok()) {
    p->request->Fail(s.WithContext(Describe(*p)));
    p->done = p->io_len();
    return;
  }
  ++w.inflight;
  ++pieces;
}

void IoEngine::Impl::FinishPiece(Worker& w, Piece* p) {
  if (p->bounce_slot >= 0) {
    w.free_bounce.push_back(p->bounce_slot);
    p->bounce_slot = -1;
  }
  std::shared_ptr<IoRequestState> request = std::move(p->request);
  if (request->remaining.fetch_sub(1) == 1) request->Finish();
}

void IoEngine::Impl::Complete(Worker& w, Piece* p, int32_t res) {
  const bool read = p->request->op == IoOp::kRead;
  if (res < 0) {
    if ((res == -EINTR || res == -EAGAIN) && ++p->retries < kMaxRetries) {
      ++resubmitted;
      w.retry.push_back(p);
      return;
    }
    p->request->Fail(StatusFromUringRes(res, Describe(*p)));
    return FinishPiece(w, p);
  }
  if (res == 0 && p->done < p->io_len()) {
    p->request->Fail(Status(
        StatusCode::kIoError,
        StrCat(Describe(*p), ": ", read ? "unexpected end of file" : "the kernel wrote 0 bytes")));
    return FinishPiece(w, p);
  }
  p->done += static_cast<uint32_t>(res);
  (read ? bytes_read : bytes_written) += static_cast<uint64_t>(res);
  if (p->done < p->io_len()) {  // short transfer: resubmit the rest
    ++resubmitted;
    w.retry.push_back(p);
    return;
  }
  if (read) {
    if (p->bounce) std::memcpy(p->data, w.bounce[p->bounce_slot].data(), p->len);
    if (p->crc != nullptr) {
      const uint32_t actual = Crc32c(p->data, p->len);
      if (actual != *p->crc) {
        char hex[64];
        std::snprintf(hex, sizeof(hex), "stored 0x%08x, read 0x%08x", *p->crc, actual);
        p->request->Fail(DataLossError(StrCat(
            "checksum mismatch in ", p->request->label, " at byte offset ", p->logical_offset, " (",
            p->file->path, " offset ", p->offset, ", ", p->len, " bytes): ", hex)));
      }
    }
  }
  FinishPiece(w, p);
}

void IoEngine::Impl::Run(Worker& w, int index) {
  const std::string name = StrCat("zo-io-", index);
  pthread_setname_np(pthread_self(), name.c_str());
  if (topology.has_value()) {
    const Status s = topology->BindThisThreadToNumaNode(options.numa_node);
    if (!s.ok()) LogOnce(LogLevel::kWarning, "io-bind", s.message());
  }
  const AioConfig& aio = options.aio;
  const auto depth = static_cast<unsigned>(aio.queue_depth);
  std::vector<IoCompletion> completions;
  std::vector<Piece*> batch;
  // The ring's busy span for the timeline: from the first piece in flight until none is.
  const std::string track = StrCat("nvme ring ", index);
  Tracer::Clock::time_point busy_since;
  uint64_t busy_pieces = 0;
  for (;;) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(w.mu);
      if (w.inflight == 0 && w.retry.empty()) {
        w.cv.wait(lock, [&] { return w.stop || !w.queue.empty(); });
        if (w.queue.empty()) return;  // stopped with nothing left
      }
      if (aio.overlap_events || w.inflight == 0) {
        while (w.inflight + batch.size() < depth && !w.retry.empty()) {
          batch.push_back(w.retry.front());
          w.retry.pop_front();
        }
        while (w.inflight + batch.size() < depth && !w.queue.empty()) {
          batch.push_back(w.queue.front());
          w.queue.pop_front();
        }
      }
    }
    if (options.tracer != nullptr && w.inflight == 0 && !batch.empty()) {
      busy_since = Tracer::Clock::now();
      busy_pieces = 0;
    }
    busy_pieces += batch.size();
    bool prepared = false;
    for (Piece* p : batch) {
      const unsigned before = w.inflight;
      Start(w, p);
      if (w.inflight == before) {  // could not start: completes now with its error
        FinishPiece(w, p);
        continue;
      }
      prepared = true;
      if (aio.single_submit) {
        const Status s = w.backend->Submit();
        if (!s.ok()) LogOnce(LogLevel::kError, "io-submit", s.message());
      }
    }
    if (prepared && !aio.single_submit) {
      const Status s = w.backend->Submit();
      if (!s.ok()) LogOnce(LogLevel::kError, "io-submit", s.message());
    }
    if (w.inflight == 0) continue;
    completions.clear();
    const Status s = w.backend->Reap(aio.overlap_events ? 1 : w.inflight, &completions);
    if (!s.ok()) {
      // The ring itself failed; the pieces are still owned by the kernel. Back off and
      // keep reaping: every piece completes (with its error) before its buffer is released.
      LogOnce(LogLevel::kError, "io-reap", s.message());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (const IoCompletion& c : completions) {
      --w.inflight;
      Complete(w, reinterpret_cast<Piece*>(c.tag), c.res);
    }
    if (options.tracer != nullptr && w.inflight == 0) {
      options.tracer->Record(track, "busy", busy_since, Tracer::Clock::now(),
                             StrCat(busy_pieces, " pieces"));
    }
  }
}

IoEngine::IoEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

IoEngine::~IoEngine() {
  for (auto& w : impl_->workers) {
    {
      std::lock_guard<std::mutex> lock(w->mu);
      w->stop = true;
    }
    w->cv.notify_all();
  }
  for (auto& w : impl_->workers) {
    if (w->thread.joinable()) w->thread.join();
  }
}

Result<std::unique_ptr<IoEngine>> IoEngine::Create(IoEngineOptions options) {
  const AioConfig& aio = options.aio;
  if (const std::vector<std::string> problems = AioProblems(aio); !problems.empty()) {
    std::string all;
    for (const std::string& p : problems) all += StrCat(all.empty() ? "" : "; ", p);
    return InvalidArgumentError(all);
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  const auto depth = static_cast<unsigned>(aio.queue_depth);
  IoBackendKind kind = impl->options.backend;
  for (int i = 0; i < aio.intra_op_parallelism; ++i) {
    auto worker = std::make_unique<Impl::Worker>();
    if (kind != IoBackendKind::kPosix) {
      auto uring = MakeUringBackend(depth);
      if (uring.ok()) {
        worker->backend = std::move(uring).value();
      } else if (kind == IoBackendKind::kUring) {
        return uring.status();
      } else {
        LogOnce(LogLevel::kWarning, "io-uring-fallback",
                StrCat("io_uring unavailable (", uring.status().message(),
                       "); using the pread/pwrite thread pool, which is slower"));
        kind = IoBackendKind::kPosix;
      }
    }
    if (kind == IoBackendKind::kPosix) worker->backend = MakePosixBackend(depth);
    if (impl->options.wrap_backend) {
      worker->backend = impl->options.wrap_backend(std::move(worker->backend));
    }
    impl->workers.push_back(std::move(worker));
  }
  impl->registration = impl->workers[0]->backend->SupportsRegistration();
  for (int s = kMaxRegisteredBuffers - 1; s >= 0; --s) impl->free_buffer_slots.push_back(s);
  if (impl->options.numa_node >= 0) {
    auto topology = Topology::Load();
    if (topology.ok()) impl->topology.emplace(std::move(topology).value());
  }
  Impl* raw = impl.get();
  for (size_t i = 0; i < raw->workers.size(); ++i) {
    Impl::Worker* w = raw->workers[i].get();
    w->thread = std::thread([raw, w, i] { raw->Run(*w, static_cast<int>(i)); });
  }
  return std::unique_ptr<IoEngine>(new IoEngine(std::move(impl)));
}

Result<int> IoEngine::OpenFile(const std::string& path, int flags, mode_t mode) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  DirectIoInfo info;
  if (!impl_->options.direct_io) {
    info.refusal = "O_DIRECT switched off by the caller";
  } else {
    std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
    auto it = impl_->probed_dirs.find(dir);
    if (it == impl_->probed_dirs.end()) {
      ZO_ASSIGN_OR_RETURN(DirectIoInfo probed, ProbeDirectIo(dir));
      it = impl_->probed_dirs.emplace(dir, probed).first;
    }
    info = it->second;
  }
  auto entry = std::make_unique<FileEntry>();
  entry->path = path;
  if (info.supported) {
    auto fd = UniqueFd::Open(path, flags | O_DIRECT, mode);
    if (fd.ok()) {
      entry->fd = std::move(fd).value();
      entry->direct = true;
      entry->alignment = info.offset_alignment;
      entry->memory_alignment = std::max<uint32_t>(info.memory_alignment, 1);
    } else if (fd.status().sys_errno() != EINVAL) {
      return fd.status();
    } else {
      info.refusal = StrCat("open(", path, ", O_DIRECT) failed with EINVAL");
    }
  }
  if (!entry->direct) {
    LogOnce(LogLevel::kWarning, StrCat("buffered:", dir),
            StrCat("O_DIRECT is not in use for ", dir, " (", info.refusal,
                   "); using buffered I/O there: measured speeds include the page cache"));
    ZO_ASSIGN_OR_RETURN(entry->fd, UniqueFd::Open(path, flags, mode));
  }
  std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
  int slot = -1;
  for (size_t i = 0; i < impl_->files.size(); ++i) {
    if (!impl_->files[i]) {
      slot = static_cast<int>(i);
      break;
    }
  }
  if (slot < 0) {
    if (impl_->files.size() >= static_cast<size_t>(kMaxRegisteredFiles)) {
      return ResourceExhaustedError(
          StrCat("cannot open ", path, ": ", kMaxRegisteredFiles, " files are already open"));
    }
    slot = static_cast<int>(impl_->files.size());
    impl_->files.emplace_back();
  }
  for (auto& w : impl_->workers) {
    ZO_RETURN_IF_ERROR(w->backend->RegisterFile(slot, entry->fd.get()).WithContext(path));
  }
  impl_->files[slot] = std::move(entry);
  return slot;
}

Status IoEngine::CloseFile(int file) {
  std::unique_lock<std::shared_mutex> lock(impl_->files_mu);
  if (file < 0 || file >= static_cast<int>(impl_->files.size()) || !impl_->files[file]) {
    return InvalidArgumentError(StrCat("CloseFile: no open file ", file));
  }
  for (auto& w : impl_->workers) w->backend->RegisterFile(file, -1).IgnoreError();
  const Status s = impl_->files[file]->fd.Close().WithContext(impl_->files[file]->path);
  impl_->files[file].reset();
  return s;
}

int IoEngine::fd(int file) const { return impl_->File(file)->fd.get(); }
const std::string& IoEngine::path(int file) const { return impl_->File(file)->path; }
bool IoEngine::direct(int file) const { return impl_->File(file)->direct; }
uint32_t IoEngine::alignment(int file) const { return impl_->File(file)->alignment; }

Status IoEngine::RegisterBuffer(std::span<std::byte> memory) {
  if (!impl_->registration) return Status::Ok();
  std::unique_lock<std::shared_mutex> lock(impl_->buffers_mu);
  for (size_t off = 0; off < memory.size(); off += kMaxRegisteredChunk) {
    if (impl_->free_buffer_slots.empty()) {
      LogOnce(LogLevel::kWarning, "io-buffer-slots",
              "all registered-buffer slots are in use; further buffers use plain reads/writes");
      return Status::Ok();
    }
    const int slot = impl_->free_buffer_slots.back();
    const size_t len = std::min(kMaxRegisteredChunk, memory.size() - off);
    std::byte* begin = memory.data() + off;
    Status s;
    for (auto& w : impl_->workers) {
      s = w->backend->RegisterBuffer(slot, begin, len);
      if (!s.ok()) break;
    }
    if (!s.ok()) {
      // Typically RLIMIT_MEMLOCK on older kernels: still correct, only slower.
      for (auto& w : impl_->workers) w->backend->RegisterBuffer(slot, nullptr, 0).IgnoreError();
      LogOnce(LogLevel::kWarning, "io-buffer-register",
              StrCat(s.message(), "; continuing with unregistered buffers (slower)"));
      return Status::Ok();
    }
    impl_->free_buffer_slots.pop_back();
    impl_->buffers.push_back({begin, begin + len, slot});
  }
  return Status::Ok();
}

Status IoEngine::UnregisterBuffer(std::span<std::byte> memory) {
  std::unique_lock<std::shared_mutex> lock(impl_->buffers_mu);
  auto& ranges = impl_->buffers;
  for (auto it = ranges.begin(); it != ranges.end();) {
    if (it->begin >= memory.data() && it->end <= memory.data() + memory.size()) {
      for (auto& w : impl_->workers) w->backend->RegisterBuffer(it->slot, nullptr, 0).IgnoreError();
      impl_->free_buffer_slots.push_back(it->slot);
      it = ranges.erase(it);
    } else {
      ++it;
    }
  }
  return Status::Ok();
}

Future<> IoEngine::Submit(IoOp op, std::vector<IoSegment> segments, std::string label) {
  auto state = std::make_shared<IoRequestState>();
  state->op = op;
  state->label = std::move(label);
  const uint64_t block = static_cast<uint64_t>(impl_->options.aio.block_size);
  auto fail = [](Status s) { return Future<>::Ready(std::move(s)); };
  size_t count = 0;
  for (const IoSegment& seg : segments) {
    const FileEntry* f = impl_->File(seg.file);
    if (f == nullptr)
      return fail(InvalidArgumentError(StrCat(state->label, ": no open file ", seg.file)));
    if (seg.file_offset % f->alignment != 0) {
      return fail(
          InvalidArgumentError(StrCat(state->label, ": offset ", seg.file_offset, " in ", f->path,
                                      " is not a multiple of its alignment ", f->alignment)));
    }
    if (seg.crc != nullptr && seg.length > block) {
      return fail(
          InvalidArgumentError(StrCat(state->label, ": a checksummed segment of ", seg.length,
                                      " bytes exceeds aio.block_size ", block)));
    }
    count += (seg.length + block - 1) / block;
  }
  state->pieces.reserve(count);
  for (const IoSegment& seg : segments) {
    const FileEntry* f = impl_->File(seg.file);
    for (uint64_t off = 0; off < seg.length; off += block) {
      Piece& p = state->pieces.emplace_back();
      p.request = state;
      p.file = f;
      p.file_slot = impl_->registration ? seg.file : -1;
      p.offset = seg.file_offset + off;
      p.data = seg.data + off;
      p.len = static_cast<uint32_t>(std::min(block, seg.length - off));
      p.crc = seg.crc;
      p.logical_offset = seg.logical_offset + off;
      p.bounce = f->direct && (reinterpret_cast<uintptr_t>(p.data) % f->memory_alignment != 0 ||
                               p.len % f->alignment != 0);
      p.buf_slot = p.bounce ? -1 : impl_->BufferSlotFor(p.data, p.len);
    }
  }
  if (state->pieces.empty()) return fail(Status::Ok());
  Future<> future = state->finished.GetFuture();
  state->remaining = state->pieces.size();
  // Round-robin over the I/O threads, one lock per thread.
  const size_t n = impl_->workers.size();
  std::vector<std::vector<Piece*>> per_worker(n);
  const uint64_t first = impl_->next_worker.fetch_add(state->pieces.size());
  for (size_t i = 0; i < state->pieces.size(); ++i) {
    per_worker[(first + i) % n].push_back(&state->pieces[i]);
  }
  for (size_t i = 0; i < n; ++i) {
    if (per_worker[i].empty()) continue;
    auto& w = *impl_->workers[i];
    {
      std::lock_guard<std::mutex> lock(w.mu);
      w.queue.insert(w.queue.end(), per_worker[i].begin(), per_worker[i].end());
    }
    w.cv.notify_one();
  }
  return future;
}

const AioConfig& IoEngine::aio() const { return impl_->options.aio; }
std::string_view IoEngine::backend_name() const { return impl_->workers[0]->backend->name(); }
bool IoEngine::registration() const { return impl_->registration; }

IoEngine::Stats IoEngine::stats() const {
  return {impl_->bytes_read.load(), impl_->bytes_written.load(), impl_->pieces.load(),
          impl_->resubmitted.load(), impl_->bounced.load()};
}

}  // namespace zoffload::internal
