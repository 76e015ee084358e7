#include "gpu/nccl_comm.h"

#include <cstring>
#include <utility>

#include "common/log.h"
#include "common/strings.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal {
namespace {

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return ncclBfloat16;
    case DType::kFp16:
      return ncclFloat16;
    case DType::kFp32:
      break;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kSum:
      break;
  }
  return ncclSum;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Result<NcclUniqueId> NcclUniqueId::Create() {
  NcclUniqueId id;
  ZO_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id.id_));
  return id;
}

std::string NcclUniqueId::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * sizeof(id_.internal));
  for (const char c : id_.internal) {
    const auto byte = static_cast<unsigned char>(c);
    hex.push_back(kDigits[byte >> 4]);
    hex.push_back(kDigits[byte & 15]);
  }
  return hex;
}

Result<NcclUniqueId> NcclUniqueId::FromHex(std::string_view hex) {
  NcclUniqueId id;
  if (hex.size() != 2 * sizeof(id.id_.internal)) {
    return InvalidArgumentError(StrCat("NCCL unique id: expected ", 2 * sizeof(id.id_.internal),
                                       " hex digits, got ", hex.size()));
  }
  for (size_t i = 0; i < sizeof(id.id_.internal); ++i) {
    const int hi = HexDigit(hex[2 * i]), lo = HexDigit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return InvalidArgumentError(StrCat("NCCL unique id: not a hex digit at ", 2 * i));
    }
    id.id_.internal[i] = static_cast<char>(hi * 16 + lo);
  }
  return id;
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  const ncclResult_t res = failed_ ? ncclCommAbort(comm_) : ncclCommDestroy(comm_);
  if (res != ncclSuccess) {
    Log(LogLevel::kWarning, StrCat("NCCL communicator release: ", ncclGetErrorString(res)));
  }
}

NcclComm::NcclComm(NcclComm&& other) noexcept
    : comm_(std::exchange(other.comm_, nullptr)),
      world_size_(other.world_size_),
      rank_(other.rank_),
      failed_(other.failed_) {}

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    NcclComm dying(std::move(*this));
    comm_ = std::exchange(other.comm_, nullptr);
    world_size_ = other.world_size_;
    rank_ = other.rank_;
    failed_ = other.failed_;
  }
  return *this;
}

Result<NcclComm> NcclComm::Init(int world_size, int rank, const NcclUniqueId& id) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return InvalidArgumentError(
        StrCat("NCCL: rank ", rank, " is not in a world of size ", world_size));
  }
  ncclComm_t comm = nullptr;
  ZO_NCCL_RETURN_IF_ERROR(ncclCommInitRank(&comm, world_size, id.get(), rank));
  return NcclComm(comm, world_size, rank);
}

Result<NcclComm> NcclComm::InitSingle(int device) {
  ncclComm_t comm = nullptr;
  ZO_NCCL_RETURN_IF_ERROR(ncclCommInitAll(&comm, 1, &device));
  return NcclComm(comm, 1, 0);
}

Status NcclComm::AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                           cudaStream_t stream) {
  ZO_NCCL_RETURN_IF_ERROR(
      ncclAllReduce(send, recv, count, NcclType(dtype), NcclOp(op), comm_, stream));
  return Status::Ok();
}

Status NcclComm::ReduceScatter(const void* send, void* recv, size_t recv_count, DType dtype,
                               ReduceOp op, cudaStream_t stream) {
  ZO_NCCL_RETURN_IF_ERROR(
      ncclReduceScatter(send, recv, recv_count, NcclType(dtype), NcclOp(op), comm_, stream));
  return Status::Ok();
}

Status NcclComm::AllGather(const void* send, void* recv, size_t send_count, DType dtype,
                           cudaStream_t stream) {
  ZO_NCCL_RETURN_IF_ERROR(ncclAllGather(send, recv, send_count, NcclType(dtype), comm_, stream));
  return Status::Ok();
}

Status NcclComm::AllGatherBytes(const void* send, void* recv, size_t bytes, cudaStream_t stream) {
  ZO_NCCL_RETURN_IF_ERROR(ncclAllGather(send, recv, bytes, ncclInt8, comm_, stream));
  return Status::Ok();
}

Status NcclComm::Broadcast(const void* send, void* recv, size_t count, DType dtype, int root,
                           cudaStream_t stream) {
  ZO_NCCL_RETURN_IF_ERROR(ncclBroadcast(send, recv, count, NcclType(dtype), root, comm_, stream));
  return Status::Ok();
}

Status NcclComm::CheckAsyncError() {
  ncclResult_t async = ncclSuccess;
  ZO_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_, &async));
  if (async != ncclSuccess && async != ncclInProgress) {
    failed_ = true;
    return NcclStatus(async, "ncclCommGetAsyncError", __FILE__, __LINE__);
  }
  return Status::Ok();
}

void NcclComm::Abort() {
  if (comm_ == nullptr) return;
  const ncclResult_t res = ncclCommAbort(std::exchange(comm_, nullptr));
  if (res != ncclSuccess) {
    Log(LogLevel::kWarning, StrCat("NCCL communicator abort: ", ncclGetErrorString(res)));
  }
}

}  // namespace zoffload::internal
