// DiskProbe: the disk alone under a directory, through the I/O engine with given aio settings
// (no swap space, no checksums): the anchor the step profile and the parameter-fetch bench set
// their NVMe traffic against.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "swap/io_engine.h"
#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal::bench {

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

}  // namespace zoffload::internal::bench
