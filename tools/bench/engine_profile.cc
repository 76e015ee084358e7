#include "bench/engine_profile.h"

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "bench/bench_util.h"
#include "build_info.h"
#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/engine.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "bench/engine_kernels.h"
#include "gpu/cuda_status.h"
#include "gpu/gpu_info.h"
#endif

namespace zoffload::internal::bench {
namespace {

using Clock = std::chrono::steady_clock;

// A Llama layer's tensors, relative to hidden^2: q, k, v, o; gate, up, down (11008/4096);
// two norms. Tensor k of the bench takes the weight of entry k mod 9.
constexpr double kLayerShape[] = {1, 1, 1, 1, 2.6875, 2.6875, 2.6875, 1.0 / 4096, 1.0 / 4096};

std::vector<uint64_t> TensorSizes(uint64_t params, int tensors) {
  std::vector<double> w(tensors);
  double sum = 0;
  for (int k = 0; k < tensors; ++k) sum += (w[k] = kLayerShape[k % 9]);
  std::vector<uint64_t> sizes(tensors);
  uint64_t used = 0;
  for (int k = 0; k < tensors; ++k) {
    sizes[k] =
        std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(params) * w[k] / sum));
    used += sizes[k];
  }
  // The rest (or the excess) goes to the largest tensor.
  auto largest = std::max_element(sizes.begin(), sizes.end());
  *largest = *largest + params - used;
  return sizes;
}

uint64_t RssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Host-mode gradient stand-in: plausible bf16 values.
void FillHost(uint16_t* g, uint64_t n, uint32_t seed) {
  const auto count = static_cast<int64_t>(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    g[i] = static_cast<uint16_t>(0x3A00u | (h & 0x807Fu) | ((h >> 8) & 0x0080u));
  }
}

// Zeroes `bytes` at `data` on every core (the first touch of each page, done in parallel).
void ParallelZero(std::byte* data, uint64_t bytes) {
  constexpr int64_t kPiece = int64_t{1} << 24;
  const auto pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < pieces; ++k) {
    const uint64_t begin = static_cast<uint64_t>(k) * kPiece;
    std::memset(data + begin, 0, std::min<uint64_t>(kPiece, bytes - begin));
  }
}

// CPU Adam alone on the same data as the engine's step: state of every tensor (the state's
// precision), bf16 gradients, the norm pass over all of them, then each tensor updated chunk
// by chunk with its bf16 copy written into one chunk-sized buffer, as the engine does. The
// median of two timed passes after a warm-up; the memory is freed before the engine is made.
Result<double> AdamAloneSeconds(const std::vector<uint64_t>& sizes, StatePrecision state,
                                uint64_t chunk, int threads) {
  uint64_t total = 0, moments = 0;
  for (uint64_t n : sizes) {
    total += n;
    moments += AdamMomentBytes(state, n);
  }
  ZO_ASSIGN_OR_RETURN(AlignedBuffer p, AlignedBuffer::Allocate(4 * total, 64));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer m, AlignedBuffer::Allocate(moments, 64));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer v, AlignedBuffer::Allocate(moments, 64));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer g, AlignedBuffer::Allocate(2 * total, 64));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer copy, AlignedBuffer::Allocate(2 * chunk, 64, true));
  for (AlignedBuffer* b : {&p, &m, &v}) ParallelZero(b->data(), b->size());
  FillHost(g.as<uint16_t>(), total, 7);
  std::vector<AdamShard> shards;
  uint64_t first = 0, moment = 0;
  for (uint64_t n : sizes) {
    shards.push_back({p.as<float>() + first, n, state, m.data() + moment, v.data() + moment,
                      g.as<uint16_t>() + first, DType::kBf16, nullptr, ParamCopy::kNone, 0});
    first += n;
    moment += AdamMomentBytes(state, n);
  }
  AdamHyper hyper;
  std::vector<double> times;
  for (int r = 0; r < 3; ++r) {
    hyper.step = r + 1;
    const auto start = Clock::now();
    const GradNorm norm = GradientNorm(shards, threads);
    if (!norm.finite) return InternalError("engine bench: the stand-in gradients are not finite");
    for (const AdamShard& whole : shards) {
      for (uint64_t at = 0; at < whole.n; at += chunk) {
        AdamShard piece = whole;
        piece.params += at;
        piece.n = std::min(chunk, whole.n - at);
        piece.m = static_cast<std::byte*>(whole.m) + AdamMomentBytes(state, at);
        piece.v = static_cast<std::byte*>(whole.v) + AdamMomentBytes(state, at);
        piece.grads = static_cast<const uint16_t*>(whole.grads) + at;
        piece.param_copy = copy.data();
        piece.copy = ParamCopy::kBf16;
        piece.index_offset = at;
        ZO_RETURN_IF_ERROR(AdamUpdate(piece, hyper, 1.0f, threads));
      }
    }
    if (r > 0) times.push_back(SecondsSince(start));
  }
  return Median(times);
}

}  // namespace

Result<EngineRecord> RunEngineBench(const EngineBenchOptions& o) {
  if (o.tensors < 1 || o.params < static_cast<uint64_t>(o.tensors)) {
    return InvalidArgumentError(
        StrCat("engine: ", o.params, " params cannot fill ", o.tensors, " tensors"));
  }
  EngineRecord rec;
  rec.params = o.params;
  rec.tensors = o.tensors;
  rec.state = std::string(ToString(o.state));
  rec.state_on = o.state_on == StateHome::kNvme ? "nvme" : "host";
  rec.threads = o.threads > 0 ? o.threads : DefaultAdamThreads();
  const std::vector<uint64_t> sizes = TensorSizes(o.params, o.tensors);
  const uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
  bool gpu = false;
#if ZO_HAVE_CUDA
  gpu = !o.host_mode && UsableGpuCount().ok();
#endif
  rec.mode = gpu ? "gpu" : "host";
  rec.overlap = std::string(ToString(o.overlap));

  {
    // Host memory up front: the state (whole pages per tensor and array) twice (the engine's
    // and CPU Adam's alone, measured first), the gradients and the parameters.
    uint64_t state = 0;
    for (uint64_t n : sizes) state += PageBytes(4 * n) + 2 * PageBytes(AdamMomentBytes(o.state, n));
    ZO_RETURN_IF_ERROR(CheckHostMemory("engine", state + 2 * o.params + 2 * o.params,
                                       StrCat(o.params, " params in ", o.tensors,
                                              " tensors (their state, gradients and values)")));
  }
  // Anchors first, while memory is free.
  Progress progress("engine", o.steps + 4);
  rec.chunk_elements = o.state == StatePrecision::kInt8 ? uint64_t{16} << 20 : uint64_t{4} << 20;
  ZO_ASSIGN_OR_RETURN(rec.adam_alone_seconds,
                      AdamAloneSeconds(sizes, o.state, rec.chunk_elements, o.threads));
  rec.adam_alone_gparams = static_cast<double>(o.params) / rec.adam_alone_seconds * 1e-9;
  progress.Step(StrCat("CPU Adam alone on the same data: ", rec.adam_alone_gparams, " Gparam/s"));

  // The model's parameters (bf16) and a gradient buffer the size of the largest tensor.
  std::vector<uint64_t> offsets;
  uint64_t total_bytes = 0;
  for (uint64_t n : sizes) {
    offsets.push_back(total_bytes);
    total_bytes += RoundUp(2 * n, 256);
  }
  std::byte* params = nullptr;
  void* grads = nullptr;
  AlignedBuffer host_params, host_grads;
  void* stream = nullptr;
#if ZO_HAVE_CUDA
  struct DeviceMemory {
    void* p = nullptr;
    ~DeviceMemory() {
      if (p != nullptr) cudaFree(p);
    }
  } device_params, device_grads;
  struct Stream {
    cudaStream_t s = nullptr;
    ~Stream() {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  } owned_stream;
  if (gpu) {
    ZO_CUDA_RETURN_IF_ERROR(cudaMalloc(&device_params.p, total_bytes));
    ZO_CUDA_RETURN_IF_ERROR(cudaMemset(device_params.p, 0x3C, total_bytes));
    ZO_CUDA_RETURN_IF_ERROR(cudaMalloc(&device_grads.p, 2 * largest));
    ZO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&owned_stream.s, cudaStreamNonBlocking));
    params = static_cast<std::byte*>(device_params.p);
    grads = device_grads.p;
    stream = owned_stream.s;
    // Pinned H2D rate (256 MiB), for one chunk's upload.
    const size_t bytes = size_t{256} << 20;
    void* pinned = nullptr;
    void* dst = nullptr;
    ZO_CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinned, bytes));
    Status st;
    if (cudaMalloc(&dst, bytes) != cudaSuccess)
      st = ResourceExhaustedError("engine bench: 256 MiB of GPU memory");
    std::vector<double> times;
    for (int r = 0; r < 4 && st.ok(); ++r) {
      const auto start = Clock::now();
      if (cudaMemcpyAsync(dst, pinned, bytes, cudaMemcpyHostToDevice, owned_stream.s) !=
              cudaSuccess ||
          cudaStreamSynchronize(owned_stream.s) != cudaSuccess) {
        st = InternalError("engine bench: H2D copy failed");
      }
      if (r > 0) times.push_back(SecondsSince(start));
    }
    cudaFreeHost(pinned);
    if (dst != nullptr) cudaFree(dst);
    ZO_RETURN_IF_ERROR(st);
    rec.h2d_gbps = static_cast<double>(bytes) / Median(times) / 1e9;
  }
#endif
  if (!gpu) {
    ZO_ASSIGN_OR_RETURN(host_params, AlignedBuffer::Allocate(total_bytes, 4096, true));
    std::memset(host_params.data(), 0x3C, total_bytes);
    ZO_ASSIGN_OR_RETURN(host_grads, AlignedBuffer::Allocate(2 * largest, 4096, true));
    params = host_params.data();
    grads = host_grads.data();
  }
  const uint64_t spin_ns = static_cast<uint64_t>(o.grad_ms * 1e6);
  // One backward: every gradient, last tensor first, made at into[t] (`grads`, reused, unless
  // the engine takes it in place); `ready` hands each one over.
  std::vector<void*> into(sizes.size(), grads);
  auto backward = [&](uint32_t seed, const std::function<Status(size_t)>& ready) -> Status {
    for (size_t t = sizes.size(); t-- > 0;) {
#if ZO_HAVE_CUDA
      if (gpu) {
        const auto share =
            static_cast<uint64_t>(static_cast<double>(spin_ns) * static_cast<double>(sizes[t]) /
                                  static_cast<double>(o.params));
        ZO_RETURN_IF_ERROR(ProduceGradients(into[t], sizes[t], seed + t, share, stream));
      }
#endif
      if (!gpu) {
        // A CPU backward: this tensor's share of --grad-ms, spent on this thread.
        const auto until =
            Clock::now() + std::chrono::nanoseconds(static_cast<uint64_t>(
                               static_cast<double>(spin_ns) * static_cast<double>(sizes[t]) /
                               static_cast<double>(o.params)));
        FillHost(static_cast<uint16_t*>(into[t]), sizes[t], seed + static_cast<uint32_t>(t));
        while (Clock::now() < until) {
        }
      }
      ZO_RETURN_IF_ERROR(ready(t));
    }
    return Status::Ok();
  };
  auto sync = [&]() -> Status {
#if ZO_HAVE_CUDA
    if (gpu) ZO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
#endif
    return Status::Ok();
  };
  {
    std::vector<double> times;
    for (int r = 0; r < 3; ++r) {
      const auto start = Clock::now();
      ZO_RETURN_IF_ERROR(backward(r, [](size_t) { return Status::Ok(); }));
      ZO_RETURN_IF_ERROR(sync());
      times.push_back(SecondsSince(start));
    }
    rec.grad_alone_seconds = Median(times);
    progress.Step(StrCat("gradients alone: ", rec.grad_alone_seconds, " s"));
  }

  // The engine.
  Config config;
  config.bf16.enabled = true;
  config.gradient_accumulation_steps = 1;
  config.aio = o.aio;
  ZeroConfig& zero = config.zero_optimization;
  zero.stage = 2;
  if (o.bucket_elements > 0) zero.reduce_bucket_size = static_cast<int64_t>(o.bucket_elements);
  Scratch temp;
  if (o.state_on == StateHome::kNvme) {
    zero.offload_optimizer.device = OffloadDevice::kNvme;
    ZO_RETURN_IF_ERROR(temp.MakeDirs(o.paths, "engine"));
    config.zoffload.nvme_paths = temp.dirs();
  } else {
    zero.offload_optimizer.device = OffloadDevice::kCpu;
  }
  config.zoffload.optimizer_state = o.state;
  config.zoffload.cpu_adam_threads = o.threads;
  config.zoffload.trace_path = o.trace_path;
  config.zoffload.overlap = o.overlap;
  ZO_RETURN_IF_ERROR(ValidateConfig(config));
  std::vector<ParameterSpec> specs;
  for (size_t t = 0; t < sizes.size(); ++t) {
    specs.push_back({StrCat("t", t), params + offsets[t], sizes[t], DType::kBf16});
  }
  EngineOptions eo;
  eo.host_params = !gpu;
  const uint64_t rss_before = RssBytes();
  size_t free_before = 0, free_after = 0, total_gpu = 0;
#if ZO_HAVE_CUDA
  if (gpu) ZO_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total_gpu));
#endif
  const auto create_start = Clock::now();
  ZO_ASSIGN_OR_RETURN(auto engine, OffloadEngine::Create(config, specs, eo));
  rec.create_seconds = SecondsSince(create_start);
#if ZO_HAVE_CUDA
  if (gpu) ZO_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total_gpu));
#endif
  rec.gpu_bytes = free_before > free_after ? free_before - free_after : 0;
  rec.bucket_bytes = engine->gpu_bytes();
  progress.Step(StrCat("engine created in ", rec.create_seconds,
                       " s: ", HumanBytes(engine->host_bytes()), " host"));

  // Host mode: each gradient is made where the engine takes it in place, where it offers that.
  for (size_t t = 0; t < sizes.size() && !gpu; ++t) {
    ZO_ASSIGN_OR_RETURN(void* buffer, engine->GradientBuffer(specs[t].name));
    if (buffer != nullptr) into[t] = buffer;
  }
  std::vector<double> steps, grads_times, updates;
  for (int r = 0; r <= o.steps; ++r) {
    const auto start = Clock::now();
    ZO_RETURN_IF_ERROR(backward(100 + r, [&](size_t t) {
      return engine->GradientReady(specs[t].name, into[t], sizes[t], DType::kBf16, stream);
    }));
    const double issued = SecondsSince(start);
    ZO_ASSIGN_OR_RETURN(const EngineStepStats stats, engine->Step());
    ZO_RETURN_IF_ERROR(engine->WaitParameters(stream));
    ZO_RETURN_IF_ERROR(sync());
    const double seconds = SecondsSince(start);
    if (r == 0) {
      progress.Step(StrCat("warm-up step: ", seconds, " s"));
      continue;
    }
    steps.push_back(seconds);
    grads_times.push_back(issued + stats.wait_grads_seconds);
    updates.push_back(stats.update_seconds);
    rec.bytes_to_host = stats.bytes_to_host;
    rec.bytes_to_gpu = stats.bytes_to_gpu;
    progress.Step(StrCat("step ", r, ": ", seconds, " s"));
  }
  ZO_RETURN_IF_ERROR(engine->Flush(stream));  // overlap "delayed": the last update
  rec.step_seconds = Median(steps);
  rec.grads_seconds = Median(grads_times);
  rec.update_seconds = Median(updates);
  rec.d2h_overhead = rec.grads_seconds / rec.grad_alone_seconds - 1;
  rec.chunk_upload_seconds =
      gpu ? static_cast<double>(2 * std::min(rec.chunk_elements, largest)) / (rec.h2d_gbps * 1e9)
          : 0;
  switch (o.overlap) {
    case Overlap::kNone:
      rec.bound_seconds =
          rec.grad_alone_seconds + rec.adam_alone_seconds + rec.chunk_upload_seconds;
      break;
    case Overlap::kAuto:  // --overlap names one of the three
    case Overlap::kBackward:
      rec.bound_seconds =
          std::max(rec.grad_alone_seconds, rec.adam_alone_seconds) + rec.chunk_upload_seconds;
      break;
    case Overlap::kDelayed:
      rec.bound_seconds = std::max(rec.grad_alone_seconds, rec.adam_alone_seconds);
      break;
  }
  rec.ratio = rec.step_seconds / rec.bound_seconds;
  rec.host_rss_bytes = RssBytes() - rss_before;
  rec.engine_host_bytes = engine->host_bytes();
  const uint64_t state_per_param = 4 + 2 * AdamMomentBytes(o.state, 256) / 256;
  rec.state_bytes = o.params * ((o.state_on == StateHome::kHost ? state_per_param : 0) + 2);
  rec.host_ratio = static_cast<double>(rec.host_rss_bytes) / static_cast<double>(rec.state_bytes);
  return rec;
}

}  // namespace zoffload::internal::bench
