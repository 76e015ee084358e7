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
#include "bench/disk_probe.h"
#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "common/trace.h"
#include "swap/io_engine.h"

namespace zoffload::internal::bench {

Result<StepRecord> RunStepBench(const StepBenchOptions& o) {
  if (o.tensors < 1 || o.params < static_cast<uint64_t>(o.tensors)) {
    return InvalidArgumentError(
        StrCat("step: ", o.params, " params cannot fill ", o.tensors, " tensors"));
  }
  if (o.state_on == StateHome::kHost && o.nvme_ratio < 1) {
    return InvalidArgumentError(StrCat("step: a share of ", o.nvme_ratio,
                                       " on NVMe (--nvme-ratio, or the config's "
                                       "offload_optimizer.ratio) needs --state-on nvme"));
  }
  {
    // Host memory up front: the host share of the state (whole pages per tensor and array),
    // the NVMe pipeline's slots, and the gradient, copy and initial-value buffers.
    const uint64_t per = o.params / static_cast<uint64_t>(o.tensors);
    const uint64_t largest = o.params - per * static_cast<uint64_t>(o.tensors - 1);
    const double share = o.state_on == StateHome::kNvme ? 1.0 - o.nvme_ratio : 1.0;
    const auto host_tensors = static_cast<uint64_t>(share * o.tensors);
    const uint64_t state =
        host_tensors * (PageBytes(4 * per) + 2 * PageBytes(AdamMomentBytes(o.state, per)));
    // A slot holds one chunk, or a whole tensor when that is smaller.
    const uint64_t chunk =
        std::min(o.chunk_elements > 0 ? o.chunk_elements : uint64_t{4} << 20, largest);
    const uint64_t slots =
        o.state_on == StateHome::kNvme
            ? static_cast<uint64_t>(o.buffers) * (4 * chunk + 2 * AdamMomentBytes(o.state, chunk))
            : 0;
    const uint64_t buffers = largest * (4 + DTypeBytes(o.grad_dtype) + 2 + 4 + 2 * 4);
    ZO_RETURN_IF_ERROR(CheckHostMemory(
        "step", state + slots + buffers,
        StrCat(o.params, " params in ", o.tensors, " tensors (", host_tensors,
               " of them in host memory) and ", o.state_on == StateHome::kNvme ? o.buffers : 0,
               " pipeline buffers")));
  }
  StepRecord rec;
  rec.params = o.params;
  rec.tensors = o.tensors;
  rec.state_on = o.state_on == StateHome::kNvme ? "nvme" : "host";
  rec.nvme_ratio = o.state_on == StateHome::kNvme ? o.nvme_ratio : 0.0;
  rec.state = std::string(ToString(o.state));
  Scratch temp;
  OptimizerStateOptions so;
  so.home = o.state_on;
  so.offload_ratio = o.nvme_ratio;
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
  if (o.state_on == StateHome::kNvme && state->swap() == nullptr) {
    return InvalidArgumentError(StrCat("step: a share of ", o.nvme_ratio,
                                       " on NVMe (--nvme-ratio, or the config's "
                                       "offload_optimizer.ratio) holds none of the ",
                                       o.tensors,
                                       " tensors (whole tensors go "
                                       "there; each has about ",
                                       o.params / static_cast<uint64_t>(o.tensors),
                                       " elements): raise the ratio, or use --state-on host"));
  }
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
    rec.bound_seconds = std::max(rec.io_bound_seconds, rec.adam_bound_seconds);
    rec.bound_ratio = rec.step_seconds / rec.bound_seconds;
  }
  if (Tracer* tracer = internal::RuntimeAccess::Of(*context).tracer())
    ZO_RETURN_IF_ERROR(tracer->Write());
  return rec;
}

}  // namespace zoffload::internal::bench
