#include "engine/device_path.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>

#include "common/strings.h"
#include "gpu/copy_engine.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal {
namespace {

constexpr uint64_t kPieceAlign = 256;  // each piece starts 256-byte aligned in its bucket

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// What a flush's host function gets: the callback and the flushed pieces.
struct LandedCall {
  DevicePath::Landed* landed;
  std::vector<DevicePath::Piece> pieces;
};

void CUDART_CB RunLanded(void* data) {
  std::unique_ptr<LandedCall> call(static_cast<LandedCall*>(data));
  (*call->landed)(std::move(call->pieces));
}

}  // namespace

struct DevicePath::Bucket {
  DeviceMemory memory;
  uint64_t used = 0;
  std::vector<Piece> pieces;
  CopyToken landed;  // the bucket's last D2H
};

struct DevicePath::Slot {
  HostMemory memory;
  CopyToken uploaded;
};

Result<std::unique_ptr<DevicePath>> DevicePath::Create(RuntimeContext::Impl& rt,
                                                       uint64_t bucket_bytes, int slots,
                                                       uint64_t slot_bytes, Landed landed) {
  std::unique_ptr<DevicePath> path(new DevicePath());
  path->rt_ = &rt;
  path->device_ = rt.options().device;
  path->bucket_bytes_ = RoundUp(bucket_bytes, kPieceAlign);
  path->landed_ = std::move(landed);
  ZO_CUDA_RETURN_IF_ERROR(cudaSetDevice(path->device_));
  ZO_RETURN_IF_ERROR(rt.Copies().status());
  for (int b = 0; b < 2; ++b) {
    auto bucket = std::make_unique<Bucket>();
    ZO_ASSIGN_OR_RETURN(
        bucket->memory,
        rt.AllocateDevice(path->bucket_bytes_,
                          "a gradient bucket (zero_optimization.reduce_bucket_size)"));
    path->buckets_.push_back(std::move(bucket));
  }
  for (int s = 0; s < slots; ++s) {
    auto slot = std::make_unique<Slot>();
    ZO_ASSIGN_OR_RETURN(slot->memory, rt.AllocateHost(slot_bytes, "an upload staging slot", true));
    path->slots_.push_back(std::move(slot));
  }
  return path;
}

DevicePath::~DevicePath() {
  // Nothing may still read or write our buffers, nor call back into this object.
  WaitLanded().IgnoreError();
  for (auto& slot : slots_) slot->uploaded.Wait().IgnoreError();
  // The host functions behind the last D2H copies too.
  if (auto copies = rt_->Copies(); copies.ok()) {
    const cudaError_t err =
        cudaStreamSynchronize((*copies)->stream(CopyEngine::Direction::kDeviceToHost));
    if (err != cudaSuccess) cudaGetLastError();  // sticky errors were reported by the copies
  }
}

Result<int> DevicePath::DeviceOf(const void* ptr) {
  cudaPointerAttributes attributes{};
  ZO_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, ptr));
  const bool device =
      attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  return device ? attributes.device : -1;
}

Status DevicePath::Add(const void* grad, uint64_t bytes, std::byte* host, uint32_t tag,
                       void* stream) {
  const auto* src = static_cast<const std::byte*>(grad);
  while (bytes > 0) {
    Bucket& b = *buckets_[current_];
    if (b.used >= bucket_bytes_) {
      ZO_RETURN_IF_ERROR(Flush(stream));
      continue;
    }
    // The bucket's last D2H must have read it before the caller's stream writes it again.
    if (b.used == 0) ZO_RETURN_IF_ERROR(b.landed.OrderBefore(AsStream(stream)));
    const uint64_t piece = std::min(bytes, bucket_bytes_ - b.used);
    ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.memory.as<std::byte>() + b.used, src, piece,
                                            cudaMemcpyDeviceToDevice, AsStream(stream)));
    b.pieces.push_back({host, piece, b.used, tag});
    b.used = std::min(bucket_bytes_, RoundUp(b.used + piece, kPieceAlign));
    src += piece;
    host += piece;
    bytes -= piece;
  }
  return Status::Ok();
}

Status DevicePath::Flush(void* stream) {
  Bucket& b = *buckets_[current_];
  if (b.pieces.empty()) return Status::Ok();
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  for (size_t i = 0; i < b.pieces.size(); ++i) {
    const Piece& p = b.pieces[i];
    // The first copy waits for the caller's stream; the others follow it on the D2H stream.
    ZO_ASSIGN_OR_RETURN(b.landed,
                        copies->DeviceToHost(p.host, b.memory.as<std::byte>() + p.offset, p.bytes,
                                             i == 0 ? AsStream(stream) : nullptr));
    bytes_to_host_ += p.bytes;
  }
  if (landed_) {
    auto call = std::make_unique<LandedCall>(LandedCall{&landed_, std::move(b.pieces)});
    ZO_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(copies->stream(CopyEngine::Direction::kDeviceToHost),
                                               RunLanded, call.get()));
    call.release();  // RunLanded owns it now
  }
  b.pieces.clear();
  b.used = 0;
  current_ = 1 - current_;
  ++flushes_;
  return Status::Ok();
}

Status DevicePath::WaitLanded() {
  for (auto& b : buckets_) ZO_RETURN_IF_ERROR(b->landed.Wait());
  return Status::Ok();
}

Result<std::byte*> DevicePath::AcquireSlot() {
  Slot& s = *slots_[next_slot_ % slots_.size()];
  const auto start = std::chrono::steady_clock::now();
  ZO_RETURN_IF_ERROR(s.uploaded.Wait());
  upload_wait_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s.memory.data();
}

Status DevicePath::Upload(void* device_dst, uint64_t bytes) {
  Slot& s = *slots_[next_slot_++ % slots_.size()];
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  ZO_ASSIGN_OR_RETURN(s.uploaded, copies->HostToDevice(device_dst, s.memory.data(), bytes));
  bytes_to_gpu_ += bytes;
  return Status::Ok();
}

Status DevicePath::WaitParameters(void* stream) {
  if (next_slot_ == 0) return Status::Ok();
  return slots_[(next_slot_ - 1) % slots_.size()]->uploaded.OrderBefore(AsStream(stream));
}

Status DevicePath::CopyToHost(void* host, const void* device, uint64_t bytes) {
  ZO_ASSIGN_OR_RETURN(CopyEngine * copies, rt_->Copies());
  return copies->DeviceToHostStaged(host, device, bytes);
}

uint64_t DevicePath::gpu_bytes() const {
  uint64_t total = 0;
  for (const auto& b : buckets_) total += b->memory.size();
  return total;
}

uint64_t DevicePath::host_bytes() const {
  uint64_t total = 0;
  for (const auto& s : slots_) total += s->memory.size();
  return total;
}

}  // namespace zoffload::internal
