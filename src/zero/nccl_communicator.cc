#include "zero/nccl_communicator.h"

#include <algorithm>
#include <thread>

#include "common/strings.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal::zero {

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(NcclComm comm,
                                                                   const Options& options) {
  const uint64_t unit = 4 * static_cast<uint64_t>(std::max(comm.world_size(), 1));
  if (comm.get() == nullptr || options.chunk_bytes < unit || options.chunk_bytes % unit != 0) {
    return InvalidArgumentError(StrCat("NCCL communicator: chunks of ", options.chunk_bytes,
                                       " bytes at world size ", comm.world_size(),
                                       ": needs an initialized communicator and chunks that are a "
                                       "multiple of 4 x world bytes"));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(comm), options));
  ZO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&c->device_));
  ZO_ASSIGN_OR_RETURN(c->stream_, CudaStream::Create());
  ZO_ASSIGN_OR_RETURN(c->staging_, DeviceBuffer::Allocate(options.chunk_bytes));
  return c;
}

Status NcclCommunicator::Enter() {
  ZO_RETURN_IF_ERROR(broken_);
  ZO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return Status::Ok();
}

Status NcclCommunicator::Copy(void* to, const void* from, uint64_t bytes, cudaMemcpyKind kind) {
  ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, from, bytes, kind, stream_.get()));
  return Status::Ok();
}

Status NcclCommunicator::Wait(std::string_view what) {
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  for (int spins = 0;; ++spins) {
    const cudaError_t done = cudaStreamQuery(stream_.get());
    if (done == cudaSuccess) return Status::Ok();
    Status failure;
    if (done != cudaErrorNotReady) {
      failure = CudaStatus(done, "cudaStreamQuery", __FILE__, __LINE__);
    } else if (Status async = comm_.CheckAsyncError(); !async.ok()) {
      failure = async;
    } else if (std::chrono::steady_clock::now() > deadline) {
      failure =
          Status(StatusCode::kUnavailable, StrCat("not finished within ", options_.timeout.count(),
                                                  " ms (a rank died or is stuck)"));
    }
    if (!failure.ok()) {
      comm_.Abort();
      broken_ = Status(failure.code(),
                       StrCat("NCCL communicator, rank ", comm_.rank(), " of ", comm_.world_size(),
                              ": ", what, ": ", failure.message(), "; this run cannot go on"));
      return broken_;
    }
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

Status NcclCommunicator::Barrier() {
  ZO_RETURN_IF_ERROR(Enter());
  auto* one = staging_.as<float>();
  ZO_RETURN_IF_ERROR(comm_.AllReduce(one, one, 1, DType::kFp32, ReduceOp::kSum, stream_.get()));
  return Wait("barrier");
}

Status NcclCommunicator::AllReduceSum(float* data, uint64_t n) {
  ZO_RETURN_IF_ERROR(Enter());
  const uint64_t chunk = options_.chunk_bytes / 4;
  auto* dev = staging_.as<float>();
  for (uint64_t first = 0; first < n; first += chunk) {
    const uint64_t len = std::min(chunk, n - first);
    ZO_RETURN_IF_ERROR(Copy(dev, data + first, 4 * len, cudaMemcpyHostToDevice));
    ZO_RETURN_IF_ERROR(comm_.AllReduce(dev, dev, len, DType::kFp32, ReduceOp::kSum, stream_.get()));
    ZO_RETURN_IF_ERROR(Wait(StrCat("all-reduce of ", n, " floats")));
    ZO_RETURN_IF_ERROR(Copy(data + first, dev, 4 * len, cudaMemcpyDeviceToHost));
    ZO_RETURN_IF_ERROR(Wait("all-reduce: copying the sums back"));
  }
  return Status::Ok();
}

Status NcclCommunicator::ReduceScatterSum(const float* send, float* recv, uint64_t count) {
  ZO_RETURN_IF_ERROR(Enter());
  const auto world = static_cast<uint64_t>(comm_.world_size());
  const uint64_t chunk = options_.chunk_bytes / (4 * world);  // of each rank's part
  auto* dev = staging_.as<float>();
  for (uint64_t first = 0; first < count; first += chunk) {
    const uint64_t len = std::min(chunk, count - first);
    for (uint64_t k = 0; k < world; ++k) {  // rank k's part of this chunk at dev + k x len
      ZO_RETURN_IF_ERROR(
          Copy(dev + k * len, send + k * count + first, 4 * len, cudaMemcpyHostToDevice));
    }
    // In place: this rank's result lands where its own part of the input was.
    float* mine = dev + static_cast<uint64_t>(comm_.rank()) * len;
    ZO_RETURN_IF_ERROR(
        comm_.ReduceScatter(dev, mine, len, DType::kFp32, ReduceOp::kSum, stream_.get()));
    ZO_RETURN_IF_ERROR(Wait(StrCat("reduce-scatter of ", count, " floats per rank")));
    ZO_RETURN_IF_ERROR(Copy(recv + first, mine, 4 * len, cudaMemcpyDeviceToHost));
    ZO_RETURN_IF_ERROR(Wait("reduce-scatter: copying the sums back"));
  }
  return Status::Ok();
}

Status NcclCommunicator::AllGather(const void* send, void* recv, uint64_t bytes) {
  ZO_RETURN_IF_ERROR(Enter());
  const auto world = static_cast<uint64_t>(comm_.world_size());
  const uint64_t chunk = options_.chunk_bytes / world;  // of each rank's bytes
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  auto* dev = staging_.as<std::byte>();
  for (uint64_t first = 0; first < bytes; first += chunk) {
    const uint64_t len = std::min(chunk, bytes - first);
    std::byte* mine = dev + static_cast<uint64_t>(comm_.rank()) * len;  // in place
    ZO_RETURN_IF_ERROR(Copy(mine, in + first, len, cudaMemcpyHostToDevice));
    ZO_RETURN_IF_ERROR(comm_.AllGatherBytes(mine, dev, len, stream_.get()));
    ZO_RETURN_IF_ERROR(Wait(StrCat("all-gather of ", bytes, " bytes per rank")));
    for (uint64_t q = 0; q < world; ++q) {
      ZO_RETURN_IF_ERROR(Copy(out + q * bytes + first, dev + q * len, len, cudaMemcpyDeviceToHost));
    }
    ZO_RETURN_IF_ERROR(Wait("all-gather: copying the values back"));
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::zero
