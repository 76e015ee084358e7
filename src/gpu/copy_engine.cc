#include "gpu/copy_engine.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "common/strings.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal {

Result<std::unique_ptr<CopyEngine>> CopyEngine::Create(PinnedPool& pool,
                                                       const CopyEngineOptions& options) {
  if (options.chunk_bytes < 4096 || options.staging_buffers < 2 || options.staging_threads < 1) {
    return InvalidArgumentError(StrCat("CopyEngine: chunk_bytes must be >= 4096 (got ",
                                       options.chunk_bytes, "), staging_buffers >= 2 (got ",
                                       options.staging_buffers, "), staging_threads >= 1 (got ",
                                       options.staging_threads, ")"));
  }
  std::unique_ptr<CopyEngine> engine(new CopyEngine());
  engine->options_ = options;
  for (Lane* lane : {&engine->h2d_, &engine->d2h_}) {
    ZO_ASSIGN_OR_RETURN(lane->stream, CudaStream::Create());
    for (int i = 0; i < options.staging_buffers; ++i) {
      Slot slot;
      ZO_ASSIGN_OR_RETURN(slot.buffer, pool.Allocate(options.chunk_bytes));
      ZO_ASSIGN_OR_RETURN(slot.dma_done, CudaEvent::Create());
      lane->slots.push_back(std::move(slot));
    }
  }
  return engine;
}

Status CopyEngine::StartAfter(Lane& lane, cudaStream_t after) {
  if (after == nullptr) return Status::Ok();
  ZO_ASSIGN_OR_RETURN(CudaEvent event, CudaEvent::Create());
  return OrderAfter(lane.stream.get(), after, event);
}

Future<> CopyEngine::Enqueue(Lane& lane, void* dst, const void* src, size_t bytes,
                             cudaMemcpyKind kind, cudaStream_t after) {
  if (bytes == 0) return Future<>::Ready(Status::Ok());
  if (Status s = EnqueueCopy(lane, dst, src, bytes, kind, after); !s.ok()) {
    return Future<>::Ready(s);
  }
  return FutureAfterWork(lane.stream.get());
}

Status CopyEngine::EnqueueCopy(Lane& lane, void* dst, const void* src, size_t bytes,
                               cudaMemcpyKind kind, cudaStream_t after) {
  ZO_RETURN_IF_ERROR(StartAfter(lane, after));
  ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, lane.stream.get()));
  return Status::Ok();
}

Future<> CopyEngine::HostToDevice(void* device_dst, const void* host_src, size_t bytes,
                                  cudaStream_t after) {
  return Enqueue(h2d_, device_dst, host_src, bytes, cudaMemcpyHostToDevice, after);
}

Future<> CopyEngine::DeviceToHost(void* host_dst, const void* device_src, size_t bytes,
                                  cudaStream_t after) {
  return Enqueue(d2h_, host_dst, device_src, bytes, cudaMemcpyDeviceToHost, after);
}

void CopyEngine::ParallelCopy(void* dst, const void* src, size_t bytes) const {
  constexpr size_t kPerThreadMin = size_t{1} << 20;
  const int threads = static_cast<int>(
      std::clamp<size_t>(bytes / kPerThreadMin, 1, static_cast<size_t>(options_.staging_threads)));
  if (threads == 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const size_t piece = (bytes / threads + 63) & ~size_t{63};
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const size_t begin = std::min(bytes, piece * t);
    const size_t end = std::min(bytes, begin + piece);
    std::memcpy(static_cast<std::byte*>(dst) + begin, static_cast<const std::byte*>(src) + begin,
                end - begin);
  }
}

Future<> CopyEngine::HostToDeviceStaged(void* device_dst, const void* host_src, size_t bytes,
                                        cudaStream_t after) {
  if (bytes == 0) return Future<>::Ready(Status::Ok());
  std::lock_guard lock(h2d_.staging);
  if (Status s = StageToDevice(device_dst, host_src, bytes, after); !s.ok()) {
    return Future<>::Ready(s);
  }
  return FutureAfterWork(h2d_.stream.get());
}

// The staged upload's loop (h2d_.staging held).
Status CopyEngine::StageToDevice(void* device_dst, const void* host_src, size_t bytes,
                                 cudaStream_t after) {
  ZO_RETURN_IF_ERROR(StartAfter(h2d_, after));
  const size_t chunk = options_.chunk_bytes;
  for (size_t offset = 0, c = 0; offset < bytes; offset += chunk, ++c) {
    Slot& slot = h2d_.slots[c % h2d_.slots.size()];
    const size_t len = std::min(chunk, bytes - offset);
    ZO_RETURN_IF_ERROR(slot.dma_done.Synchronize());  // the slot's previous DMA has read it
    ParallelCopy(slot.buffer.data(), static_cast<const std::byte*>(host_src) + offset, len);
    ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<std::byte*>(device_dst) + offset,
                                            slot.buffer.data(), len, cudaMemcpyHostToDevice,
                                            h2d_.stream.get()));
    ZO_RETURN_IF_ERROR(slot.dma_done.Record(h2d_.stream.get()));
  }
  return Status::Ok();
}

Status CopyEngine::DeviceToHostStaged(void* host_dst, const void* device_src, size_t bytes,
                                      cudaStream_t after) {
  if (bytes == 0) return Status::Ok();
  std::lock_guard lock(d2h_.staging);
  ZO_RETURN_IF_ERROR(StartAfter(d2h_, after));
  const size_t chunk = options_.chunk_bytes;
  const size_t chunks = (bytes + chunk - 1) / chunk;
  const size_t slots = d2h_.slots.size();
  auto start_dma = [&](size_t c) -> Status {
    Slot& slot = d2h_.slots[c % slots];
    const size_t offset = c * chunk;
    ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        slot.buffer.data(), static_cast<const std::byte*>(device_src) + offset,
        std::min(chunk, bytes - offset), cudaMemcpyDeviceToHost, d2h_.stream.get()));
    return slot.dma_done.Record(d2h_.stream.get());
  };
  // Every slot's DMA in flight first; then drain chunk c and refill its slot with c + slots.
  Status status;
  for (size_t c = 0; c < std::min(chunks, slots) && status.ok(); ++c) status = start_dma(c);
  for (size_t c = 0; c < chunks && status.ok(); ++c) {
    Slot& slot = d2h_.slots[c % slots];
    status = slot.dma_done.Synchronize();
    if (!status.ok()) break;
    const size_t offset = c * chunk;
    ParallelCopy(static_cast<std::byte*>(host_dst) + offset, slot.buffer.data(),
                 std::min(chunk, bytes - offset));
    if (c + slots < chunks) status = start_dma(c + slots);
  }
  if (!status.ok()) {
    // Nothing may still write the staging buffers when the next staged copy starts.
    d2h_.stream.Synchronize().IgnoreError();
  }
  return status;
}

}  // namespace zoffload::internal
