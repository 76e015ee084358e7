#include "bench/step_profile.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>

#include "bench/bench_util.h"
#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "common/trace.h"
#include "swap/io_engine.h"

namespace zoffload::internal::bench {
namespace {

// Directories for the swap space, one under each path, removed with their files on return.
// The disk alone, on the step's directory with its aio settings, through the I/O engine
// without the swap space or checksums: a file of two halves, written once (the write
// bandwidth) and read once (the read bandwidth); then mixed passes, each reading one half
// while writing the other as a step does, alternating halves so that reads always find data
// written a pass earlier. With `durable`, writes end with fdatasync as a durable commit does.
class DiskProbe {
 public:
  static Result<std::unique_ptr<DiskProbe>> Create(const std::string& dir, const AioConfig& aio,
                                                   uint64_t bytes, bool durable) {
    std::unique_ptr<DiskProbe> p(new DiskProbe());
    p->durable_ = durable;
    p->half_ = std::max(kRequest, std::min(bytes, uint64_t{4} << 30) / kRequest * kRequest);
    IoEngineOptions eo;
    eo.aio = aio;
    ZO_ASSIGN_OR_RETURN(p->engine_, IoEngine::Create(std::move(eo)));
    p->path_ = dir + "/zoffload-disk-probe";
    ZO_ASSIGN_OR_RETURN(p->file_, p->engine_->OpenFile(p->path_, O_RDWR | O_CREAT | O_TRUNC));
    if (::fallocate(p->engine_->fd(p->file_), 0, 0, static_cast<off_t>(2 * p->half_)) != 0) {
      return StatusFromErrno(errno, StrCat("fallocate ", p->path_));
    }
    ZO_ASSIGN_OR_RETURN(p->buffers_, AlignedBuffer::Allocate(2 * kInFlight * kRequest, 4096, true));
    ZO_RETURN_IF_ERROR(p->engine_->RegisterBuffer(p->buffers_.span()));
    ZO_ASSIGN_OR_RETURN(const double write_s, p->Run({{1, 0, 2 * p->half_, 0}}));
    p->write_gbps_ = 2.0 * p->half_ / write_s / 1e9;
    ZO_ASSIGN_OR_RETURN(const double read_s, p->Run({{0, 0, p->half_, 0}}));
    p->read_gbps_ = p->half_ / read_s / 1e9;
    return p;
  }
  ~DiskProbe() {
    if (engine_ != nullptr) {
      engine_->CloseFile(file_).IgnoreError();
      ::unlink(path_.c_str());
    }
  }

  double read_gbps() const { return read_gbps_; }
  double write_gbps() const { return write_gbps_; }
  /// One mixed pass: bytes of reads and writes together per second.
  Result<double> MixedGbps() {
    const uint64_t r = flip_ ? half_ : 0, w = flip_ ? 0 : half_;
    flip_ = !flip_;
    ZO_ASSIGN_OR_RETURN(const double seconds, Run({{0, r, half_, 0}, {1, w, half_, kInFlight}}));
    return 2.0 * half_ / seconds / 1e9;
  }

 private:
  static constexpr uint64_t kRequest = uint64_t{16} << 20;
  static constexpr size_t kInFlight = 8;  // requests per direction
  DiskProbe() = default;

  // Streams of {op (0 read, 1 write), first byte, bytes, first buffer slot}, kInFlight
  // requests each at a time; the seconds until all are done.
  Result<double> Run(std::initializer_list<std::array<uint64_t, 4>> specs) {
    struct Stream {
      IoOp op;
      uint64_t begin, len, slot0;
      uint64_t next = 0;
      std::vector<Future<>> inflight = {};
    };
    std::vector<Stream> streams;
    for (const auto& [op, begin, len, slot0] : specs) {
      streams.push_back({op == 0 ? IoOp::kRead : IoOp::kWrite, begin, len, slot0});
    }
    const auto start = std::chrono::steady_clock::now();
    for (bool busy = true; busy;) {
      busy = false;
      for (Stream& st : streams) {
        if (st.next >= st.len && st.inflight.empty()) continue;
        busy = true;
        if (st.inflight.size() == kInFlight || st.next >= st.len) {
          ZO_RETURN_IF_ERROR(st.inflight.front().Wait());
          st.inflight.erase(st.inflight.begin());
          continue;
        }
        const uint64_t slot = st.slot0 + (st.next / kRequest) % kInFlight;
        IoSegment seg;
        seg.file = file_;
        seg.file_offset = st.begin + st.next;
        seg.data = buffers_.data() + slot * kRequest;
        seg.length = kRequest;
        st.inflight.push_back(engine_->Submit(st.op, {seg}, path_));
        st.next += kRequest;
      }
    }
    for (const Stream& st : streams) {
      if (durable_ && st.op == IoOp::kWrite && ::fdatasync(engine_->fd(file_)) != 0) {
        return StatusFromErrno(errno, StrCat("fdatasync ", path_));
      }
    }
    return SecondsSince(start);
  }

  std::unique_ptr<IoEngine> engine_;
  std::string path_;
  int file_ = -1;
  AlignedBuffer buffers_;
  uint64_t half_ = 0;
  bool durable_ = false, flip_ = false;
  double read_gbps_ = 0, write_gbps_ = 0;
};

}  // namespace

Result<StepRecord> RunStepBench(const StepBenchOptions& o) {
  if (o.tensors < 1 || o.params < static_cast<uint64_t>(o.tensors)) {
    return InvalidArgumentError(
        StrCat("step: ", o.params, " params cannot fill ", o.tensors, " tensors"));
  }
  StepRecord rec;
  rec.params = o.params;
  rec.tensors = o.tensors;
  rec.state_on = o.state_on == StateHome::kNvme ? "nvme" : "host";
  rec.state = std::string(ToString(o.state));
  Scratch temp;
  OptimizerStateOptions so;
  so.home = o.state_on;
  so.precision = o.state;
  so.threads = o.threads;
  so.pipeline.buffers = o.buffers;
  so.pipeline.chunk_elements = o.chunk_elements;
  RuntimeOptions ro;
  ro.trace_path = o.trace_path;
  if (o.state_on == StateHome::kNvme) {
    ZO_RETURN_IF_ERROR(temp.MakeDirs(o.paths, "step"));
    ro.nvme_paths = temp.dirs();
    ro.aio = o.aio;
    ro.checksums = o.checksums;
    ro.durable = o.durable;
  }
  std::vector<OptimizerTensor> tensors;
  const uint64_t per = o.params / o.tensors;
  for (int t = 0; t < o.tensors; ++t) {
    tensors.push_back({StrCat("layer", t, ".weight"),
                       t + 1 == o.tensors ? o.params - per * (o.tensors - 1) : per});
  }
  ZO_ASSIGN_OR_RETURN(auto context, RuntimeContext::Create(std::move(ro)));
  ZO_ASSIGN_OR_RETURN(auto state, OptimizerState::Create(tensors, *context, so));
  rec.chunk_elements = state->chunk_elements();
  rec.buffers = o.buffers;
  rec.host_bytes = state->host_bytes();

  // Parameters, gradients and the copy buffer: host memory of the size of the largest tensor
  // (gradients are shared by every tensor: the step reads them, it does not care whose).
  const uint64_t largest = tensors.back().n;
  const size_t gb = DTypeBytes(o.grad_dtype);
  ZO_ASSIGN_OR_RETURN(AlignedBuffer init, AlignedBuffer::Allocate(4 * largest, 64, true));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer grads, AlignedBuffer::Allocate(gb * largest, 64, true));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer copy, AlignedBuffer::Allocate(2 * largest, 64, true));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (uint64_t i = 0; i < largest; ++i) {
    const float x = normal(rng);
    init.as<float>()[i] = x;
    if (o.grad_dtype == DType::kFp32) {
      grads.as<float>()[i] = x * 1e-3f;
    } else {  // bf16 and fp16 bit patterns of small values are both plausible gradients
      grads.as<uint16_t>()[i] = static_cast<uint16_t>(0x3000 + (i * 2654435761u >> 20) % 0x800);
    }
  }
  {
    Progress init_progress("step: writing the initial state", o.params * 12, /*bytes=*/true);
    for (int t = 0; t < o.tensors; ++t) {
      ZO_RETURN_IF_ERROR(state->Write(t, init.as<float>()));
      init_progress.Advance(tensors[t].n * 12, tensors[t].name);
    }
  }
  std::vector<TensorGrads> tg(o.tensors,
                              TensorGrads{grads.data(), o.grad_dtype, copy.data(), o.copy});

  // The steps, one warm-up then the timed ones; with NVMe state each step is followed by an
  // I/O-only pass over the same bytes, so both see the disk in the same state.
  std::unique_ptr<DiskProbe> disk;
  if (o.state_on == StateHome::kNvme) {
    ZO_ASSIGN_OR_RETURN(disk, DiskProbe::Create(temp.dirs().front(), o.aio,
                                                state->swap()->reserved_bytes(), o.durable));
  }
  AdamHyper hyper;
  hyper.lr = 1e-4f;
  std::vector<double> times, io, mixed;
  Progress progress("step: timing steps", o.steps + 1);
  for (int s = 0; s <= o.steps; ++s) {
    hyper.step = s + 1;
    ZO_ASSIGN_OR_RETURN(const AdamStepResult r, state->Step(tg, hyper));
    if (r.skipped) return InternalError("step: the benchmark's gradients overflowed");
    const double seconds = state->last_step().seconds;
    std::string what = StrCat("step ", s, ": ", seconds, " s", s == 0 ? " (warm-up)" : "");
    if (s > 0) times.push_back(seconds);
    if (s > 0 && o.state_on == StateHome::kNvme) {
      ZO_ASSIGN_OR_RETURN(const StepStats pass, state->IoOnlyPass());
      io.push_back(pass.seconds);
      ZO_ASSIGN_OR_RETURN(const double gbps, disk->MixedGbps());
      mixed.push_back(gbps);
      what += StrCat("; I/O-only pass ", pass.seconds, " s");
    }
    progress.Step(what);
  }
  rec.step_seconds = Median(times);
  rec.bytes_read = state->last_step().bytes_read;
  rec.bytes_written = state->last_step().bytes_written;

  // CPU Adam alone on the same amount of data: norm + update over one tensor's worth of
  // in-memory state, scaled to all tensors.
  {
    ZO_ASSIGN_OR_RETURN(AlignedBuffer m,
                        AlignedBuffer::Allocate(AdamMomentBytes(o.state, largest), 64, true));
    ZO_ASSIGN_OR_RETURN(AlignedBuffer v,
                        AlignedBuffer::Allocate(AdamMomentBytes(o.state, largest), 64, true));
    std::memset(m.data(), 0, m.size());
    std::memset(v.data(), 0, v.size());
    AdamShard shard;
    shard.params = init.as<float>();
    shard.n = largest;
    shard.state = o.state;
    shard.m = m.data();
    shard.v = v.data();
    shard.grads = grads.data();
    shard.grad_dtype = o.grad_dtype;
    shard.param_copy = copy.data();
    shard.copy = o.copy;
    std::vector<double> adam;
    for (int s = 0; s <= o.steps; ++s) {
      hyper.step = s + 1;
      const auto start = std::chrono::steady_clock::now();
      ZO_RETURN_IF_ERROR(AdamStep({&shard, 1}, hyper, 1.0f, 0.0f, o.threads).status());
      if (s > 0) adam.push_back(SecondsSince(start));
    }
    rec.adam_bound_seconds = Median(adam) * static_cast<double>(o.params) / largest;
  }
  rec.adam_ratio = rec.step_seconds / rec.adam_bound_seconds;

  if (o.state_on == StateHome::kNvme) {
    rec.read_gbps = disk->read_gbps();
    rec.write_gbps = disk->write_gbps();
    rec.mixed_gbps = Median(mixed);
    rec.io_serial_seconds =
        rec.bytes_read / (rec.read_gbps * 1e9) + rec.bytes_written / (rec.write_gbps * 1e9);
    rec.io_bound_seconds = (rec.bytes_read + rec.bytes_written) / (rec.mixed_gbps * 1e9);
    rec.io_ratio = rec.step_seconds / rec.io_bound_seconds;
    rec.io_ratio_best = *std::min_element(times.begin(), times.end()) /
                        ((rec.bytes_read + rec.bytes_written) /
                         (*std::max_element(mixed.begin(), mixed.end()) * 1e9));
    rec.io_pass_seconds = Median(io);
  }
  if (Tracer* tracer = context->impl().tracer()) ZO_RETURN_IF_ERROR(tracer->Write());
  return rec;
}

}  // namespace zoffload::internal::bench
