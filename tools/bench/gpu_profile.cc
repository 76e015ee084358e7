#include "bench/gpu_profile.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "bench/bench_util.h"
#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "gpu/copy_engine.h"
#include "gpu/cuda_status.h"
#include "gpu/device_buffer.h"
#include "gpu/kernels.h"
#include "gpu/pinned_pool.h"
#include "gpu/stream.h"

namespace zoffload::internal::bench {
namespace {

// Median wall time of `repeats` runs of `run` (which returns once its work has finished),
// after one untimed warm-up.
Result<double> MedianSeconds(int repeats, const std::function<Status()>& run) {
  ZO_RETURN_IF_ERROR(run());
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ZO_RETURN_IF_ERROR(run());
    times.push_back(SecondsSince(start));
  }
  return Median(std::move(times));
}

GpuRecord Record(std::string profile, std::string test, uint64_t bytes, double seconds,
                 std::string anchor, double anchor_gbps) {
  GpuRecord r;
  r.profile = std::move(profile);
  r.test = std::move(test);
  r.bytes = bytes;
  r.seconds = seconds;
  r.gbps = static_cast<double>(bytes) / seconds / 1e9;
  r.anchor = std::move(anchor);
  r.anchor_gbps = anchor_gbps;
  r.ratio = anchor_gbps > 0 ? r.gbps / anchor_gbps : 0;
  std::fprintf(stderr, "  %-20s %8.2f GB/s  (%s %.2f GB/s: %.3fx)\n", r.test.c_str(), r.gbps,
               r.anchor.c_str(), anchor_gbps, r.ratio);
  return r;
}

}  // namespace

Result<std::vector<GpuRecord>> RunPcieBench(const GpuBenchOptions& o) {
  const size_t n = o.bytes;
  ZO_ASSIGN_OR_RETURN(PinnedPool pool, PinnedPool::Create({.budget_bytes = 2 * n + (256 << 20)}));
  ZO_ASSIGN_OR_RETURN(auto engine, CopyEngine::Create(pool));
  ZO_ASSIGN_OR_RETURN(PinnedBuffer up, pool.Allocate(n));
  ZO_ASSIGN_OR_RETURN(PinnedBuffer down, pool.Allocate(n));
  ZO_ASSIGN_OR_RETURN(DeviceBuffer dev_a, DeviceBuffer::Allocate(n));
  ZO_ASSIGN_OR_RETURN(DeviceBuffer dev_b, DeviceBuffer::Allocate(n));
  std::memset(up.data(), 1, n);
  std::memset(down.data(), 2, n);
  ZO_ASSIGN_OR_RETURN(CudaStream s1, CudaStream::Create());
  ZO_ASSIGN_OR_RETURN(CudaStream s2, CudaStream::Create());
  std::vector<GpuRecord> out;
  std::fprintf(stderr, "pcie: %s per transfer, median of %d\n", HumanBytes(n).c_str(), o.repeats);

  // Anchors: plain cudaMemcpyAsync between the same buffers.
  auto plain = [&](bool h2d, bool d2h) -> Status {
    if (h2d) {
      ZO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dev_a.data(), up.data(), n, cudaMemcpyHostToDevice, s1.get()));
    }
    if (d2h) {
      ZO_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(down.data(), dev_b.data(), n, cudaMemcpyDeviceToHost, s2.get()));
    }
    ZO_RETURN_IF_ERROR(s1.Synchronize());
    return s2.Synchronize();
  };
  ZO_ASSIGN_OR_RETURN(const double peak_h2d_s,
                      MedianSeconds(o.repeats, [&] { return plain(true, false); }));
  ZO_ASSIGN_OR_RETURN(const double peak_d2h_s,
                      MedianSeconds(o.repeats, [&] { return plain(false, true); }));
  ZO_ASSIGN_OR_RETURN(const double peak_both_s,
                      MedianSeconds(o.repeats, [&] { return plain(true, true); }));
  const double peak_h2d = n / peak_h2d_s / 1e9, peak_d2h = n / peak_d2h_s / 1e9,
               peak_both = n / peak_both_s / 1e9;

  auto ours = [&](bool h2d, bool d2h) -> Status {
    Future<> a, b;
    if (h2d) a = engine->HostToDevice(dev_a.data(), up.data(), n);
    if (d2h) b = engine->DeviceToHost(down.data(), dev_b.data(), n);
    ZO_RETURN_IF_ERROR(a.Wait());
    return b.Wait();
  };
  ZO_ASSIGN_OR_RETURN(double s, MedianSeconds(o.repeats, [&] { return ours(true, false); }));
  out.push_back(Record("pcie", "h2d", n, s, "cudaMemcpyAsync H2D", peak_h2d));
  ZO_ASSIGN_OR_RETURN(s, MedianSeconds(o.repeats, [&] { return ours(false, true); }));
  out.push_back(Record("pcie", "d2h", n, s, "cudaMemcpyAsync D2H", peak_d2h));
  ZO_ASSIGN_OR_RETURN(s, MedianSeconds(o.repeats, [&] { return ours(true, true); }));
  out.push_back(Record("pcie", "both_h2d", n, s, "cudaMemcpyAsync both at once", peak_both));
  out.push_back(Record("pcie", "both_d2h", n, s, "cudaMemcpyAsync both at once", peak_both));

  // Pageable caller memory (pre-faulted, as a framework's tensors are).
  ZO_ASSIGN_OR_RETURN(AlignedBuffer pageable, AlignedBuffer::Allocate(n, 4096, true));
  std::memset(pageable.data(), 3, n);
  auto direct = [&](cudaMemcpyKind kind) -> Status {
    void* dst = kind == cudaMemcpyHostToDevice ? dev_a.data() : static_cast<void*>(pageable.data());
    const void* src =
        kind == cudaMemcpyHostToDevice ? static_cast<const void*>(pageable.data()) : dev_b.data();
    ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, s1.get()));
    return s1.Synchronize();
  };
  ZO_ASSIGN_OR_RETURN(const double direct_h2d_s,
                      MedianSeconds(o.repeats, [&] { return direct(cudaMemcpyHostToDevice); }));
  ZO_ASSIGN_OR_RETURN(const double direct_d2h_s,
                      MedianSeconds(o.repeats, [&] { return direct(cudaMemcpyDeviceToHost); }));
  ZO_ASSIGN_OR_RETURN(s, MedianSeconds(o.repeats, [&] {
                        return engine->HostToDeviceStaged(dev_a.data(), pageable.data(), n).Wait();
                      }));
  out.push_back(Record("pcie", "pageable_h2d", n, s, "direct pageable cudaMemcpyAsync",
                       n / direct_h2d_s / 1e9));
  ZO_ASSIGN_OR_RETURN(s, MedianSeconds(o.repeats, [&] {
                        return engine->DeviceToHostStaged(pageable.data(), dev_b.data(), n);
                      }));
  out.push_back(Record("pcie", "pageable_d2h", n, s, "direct pageable cudaMemcpyAsync",
                       n / direct_d2h_s / 1e9));
  return out;
}

Result<std::vector<GpuRecord>> RunKernelBench(const GpuBenchOptions& o) {
  const size_t bytes = o.bytes;
  const size_t n32 = bytes / 4;  // fp32 elements in the input
  ZO_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Allocate(bytes));
  ZO_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(bytes));
  ZO_ASSIGN_OR_RETURN(DeviceBuffer c, DeviceBuffer::Allocate(bytes));
  ZO_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::Allocate(bytes));
  ZO_ASSIGN_OR_RETURN(DeviceBuffer e, DeviceBuffer::Allocate(bytes / 2));
  for (DeviceBuffer* buf : {&a, &b, &c, &d, &e}) {
    ZO_CUDA_RETURN_IF_ERROR(cudaMemset(buf->data(), 0, buf->size()));  // zeros: finite values
  }
  ZO_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  ZO_ASSIGN_OR_RETURN(gpu::GradNormWorkspace workspace, gpu::GradNormWorkspace::Create());
  const cudaStream_t st = stream.get();
  auto timed = [&](const std::function<Status()>& enqueue) {
    return MedianSeconds(o.repeats, [&]() -> Status {
      ZO_RETURN_IF_ERROR(enqueue());
      return stream.Synchronize();
    });
  };
  std::fprintf(stderr, "kernels: %s input, median of %d\n", HumanBytes(bytes).c_str(), o.repeats);
  ZO_ASSIGN_OR_RETURN(const double copy_s, timed([&]() -> Status {
                        ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.data(), a.data(), bytes,
                                                                cudaMemcpyDeviceToDevice, st));
                        return Status::Ok();
                      }));
  const double copy_gbps = 2.0 * bytes / copy_s / 1e9;  // read + write
  const std::string anchor = "cudaMemcpyAsync D2D (read+write)";
  std::vector<GpuRecord> out;
  out.push_back(Record("kernels", "d2d_copy", 2 * bytes, copy_s, anchor, copy_gbps));
  ZO_ASSIGN_OR_RETURN(double s, timed([&] {
                        return gpu::Cast(a.data(), DType::kFp32, e.data(), DType::kBf16, n32, st);
                      }));
  out.push_back(Record("kernels", "cast_fp32_bf16", n32 * 6, s, anchor, copy_gbps));
  ZO_ASSIGN_OR_RETURN(
      s, timed([&] { return gpu::Cast(e.data(), DType::kBf16, a.data(), DType::kFp32, n32, st); }));
  out.push_back(Record("kernels", "cast_bf16_fp32", n32 * 6, s, anchor, copy_gbps));
  ZO_ASSIGN_OR_RETURN(
      s, timed([&] { return gpu::Cast(a.data(), DType::kFp32, e.data(), DType::kFp16, n32, st); }));
  out.push_back(Record("kernels", "cast_fp32_fp16", n32 * 6, s, anchor, copy_gbps));
  ZO_ASSIGN_OR_RETURN(s, timed([&] {
                        return gpu::AccumulateGrad(a.as<float>(), e.data(), DType::kBf16, n32, st);
                      }));
  out.push_back(Record("kernels", "accumulate_bf16", n32 * 10, s, anchor, copy_gbps));
  const gpu::DeviceSpan bf16_grads{b.data(), bytes / 2};  // 1 GiB of bf16
  ZO_ASSIGN_OR_RETURN(
      s, timed([&] {
        return gpu::MultiTensorGradNorm({&bf16_grads, 1}, DType::kBf16, workspace, st);
      }));
  out.push_back(Record("kernels", "norm_bf16", bytes, s, anchor, copy_gbps));
  const gpu::DeviceSpan fp32_grads{a.data(), n32};
  ZO_ASSIGN_OR_RETURN(
      s, timed([&] {
        return gpu::MultiTensorGradNorm({&fp32_grads, 1}, DType::kFp32, workspace, st);
      }));
  out.push_back(Record("kernels", "norm_fp32", bytes, s, anchor, copy_gbps));
  // Adam over n32/4 parameters: p, m, v in a..c quarters, bf16 grads and copy.
  const size_t params = n32;
  const gpu::GpuAdamTensor tensor{a.as<float>(), b.as<float>(), c.as<float>(),
                                  e.data(),      d.data(),      params};
  gpu::GpuAdamStep step;
  step.grad_dtype = DType::kBf16;
  step.copy = ParamCopy::kBf16;
  ZO_ASSIGN_OR_RETURN(s, timed([&] { return gpu::GpuAdam({&tensor, 1}, step, st); }));
  out.push_back(Record("kernels", "adam_bf16_grads_copy", params * 28, s, anchor, copy_gbps));
  return out;
}

}  // namespace zoffload::internal::bench
