// ZeroOptimizer: the trainer core with the ZeRO partition — internal::zero::ZeroOptimizer over
// any Communicator, and the public zoffload::ZeroOptimizer (include/zoffload/zero.h) over its
// rank's HostComm or NCCL communicator.
#include "engine/zero_optimizer.h"

#include <chrono>
#include <filesystem>
#include <string>

#include "common/strings.h"
#include "engine/engine_core.h"
#include "engine/zero_partition.h"
#include "zero/host_comm.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "zero/nccl_communicator.h"
#endif

namespace zoffload {
using internal::StrCat;

struct ZeroOptimizer::Impl {
  std::unique_ptr<internal::zero::Communicator> comm;  // the rank's own (null: given)
  internal::EngineCore core;
  internal::zero::ZeroPartition* partition = nullptr;  // the core's
};

Result<std::unique_ptr<ZeroOptimizer>> ZeroOptimizer::Access::Create(
    const Config& config, std::vector<ParameterSpec> params, internal::zero::Communicator& comm,
    ZeroOptions options, uint64_t align) {
  using internal::EngineCore;
  using internal::Partition;
  using internal::zero::ZeroPartition;
  EngineOptions eo;
  eo.host_params = true;
  eo.groups = std::move(options.groups);
  eo.context = options.context;
  auto impl = std::make_unique<ZeroOptimizer::Impl>();
  auto make = [&](EngineCore& core) -> Result<std::unique_ptr<Partition>> {
    auto made = std::make_unique<ZeroPartition>(core, comm);
    ZO_RETURN_IF_ERROR(made->Plan(options, align));
    impl->partition = made.get();
    return std::unique_ptr<Partition>(std::move(made));
  };
  // Ranks on one machine must not share a swap directory.
  auto own_dirs = [&comm](RuntimeOptions& runtime) -> Status {
    if (comm.world() == 1) return Status::Ok();
    for (std::string& dir : runtime.nvme_paths) {
      dir = StrCat(dir, "/rank", comm.rank());
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) {
        return FailedPreconditionError(
            StrCat("ZeRO: cannot create this rank's swap directory ", dir, ": ", ec.message()));
      }
    }
    return Status::Ok();
  };
  ZO_RETURN_IF_ERROR(impl->core.Setup(config, std::move(params), std::move(eo), "ZeRO",
                                      comm.world(), make, own_dirs));
  return std::unique_ptr<ZeroOptimizer>(new ZeroOptimizer(std::move(impl)));
}

namespace {

// The rank's NCCL communicator on its device (rank.nccl_id set).
Result<std::unique_ptr<internal::zero::Communicator>> NcclFor(const ZeroRank& rank,
                                                              std::chrono::milliseconds timeout) {
#if ZO_HAVE_CUDA
  auto id = internal::NcclUniqueId::FromHex(rank.nccl_id);
  if (!id.ok()) {
    return InvalidArgumentError(
        StrCat("ZeRO: the NCCL id (ZeroRank::nccl_id, ZOFFLOAD_NCCL_ID): ", id.status().message()));
  }
  if (const cudaError_t e = cudaSetDevice(rank.device); e != cudaSuccess) {
    return Status(StatusCode::kUnavailable,
                  StrCat("ZeRO over NCCL: rank ", rank.rank, " cannot use CUDA device ",
                         rank.device, ": ", cudaGetErrorString(e)));
  }
  ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NOLINT(concurrency-mt-unsafe)
  ZO_ASSIGN_OR_RETURN(internal::NcclComm nccl,
                      internal::NcclComm::Init(rank.world, rank.rank, *id));
  internal::zero::NcclCommunicator::Options o;
  o.timeout = timeout;
  ZO_ASSIGN_OR_RETURN(auto comm, internal::zero::NcclCommunicator::Create(std::move(nccl), o));
  return std::unique_ptr<internal::zero::Communicator>(std::move(comm));
#else
  (void)rank;
  (void)timeout;
  return Status(StatusCode::kUnimplemented, "ZeRO over NCCL: this build has no CUDA");
#endif
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ZeroOptimizer::~ZeroOptimizer() = default;

Result<std::unique_ptr<ZeroOptimizer>> ZeroOptimizer::Create(const Config& config,
                                                             std::vector<ParameterSpec> params,
                                                             const ZeroRank& rank,
                                                             ZeroOptions options) {
  if (!internal::zero::GoodRunName(rank.run)) {
    return InvalidArgumentError(StrCat("ZeRO: the run's name is '", rank.run,
                                       "'; use letters, digits, '.', '_' and '-' (at most 200)"));
  }
  std::unique_ptr<internal::zero::Communicator> comm;
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.zoffload.comm_timeout_seconds * 1000));
  if (!rank.nccl_id.empty()) {
    ZO_ASSIGN_OR_RETURN(comm, NcclFor(rank, timeout));
  } else {
    internal::zero::HostComm::Options co;
    co.name = StrCat("zoffload-", rank.run);
    co.rank = rank.rank;
    co.world = rank.world;
    co.timeout = timeout;
    ZO_ASSIGN_OR_RETURN(comm, internal::zero::HostComm::Create(co));
  }
  ZO_ASSIGN_OR_RETURN(auto zero,
                      Access::Create(config, std::move(params), *comm, std::move(options)));
  zero->impl_->comm = std::move(comm);  // destroyed after the core (declared before it)
  return zero;
}

Status ZeroOptimizer::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                    DType dtype) {
  return impl_->core.GradientReady(name, grad, elements, dtype, nullptr);
}
Result<void*> ZeroOptimizer::GradientBuffer(std::string_view name) {
  return impl_->core.GradientBuffer(name);
}
Result<EngineStepStats> ZeroOptimizer::Step() { return impl_->core.Step(); }
Status ZeroOptimizer::GatherParameter(std::string_view name, void* out) {
  ZO_ASSIGN_OR_RETURN(internal::EngineParam * p, impl_->core.Find(name));
  return impl_->partition->GatherParameter(*p, out);
}
Status ZeroOptimizer::GatherMaster(std::string_view name, float* out) {
  ZO_ASSIGN_OR_RETURN(internal::EngineParam * p, impl_->core.Find(name));
  return impl_->partition->GatherMaster(*p, out);
}
Status ZeroOptimizer::Save(const std::string& dir) { return impl_->partition->Save(dir); }
Status ZeroOptimizer::Load(const std::string& dir) { return impl_->partition->Load(dir); }
Status ZeroOptimizer::SetGroup(int index, const ParamGroup& group) {
  return impl_->core.SetGroup(index, group);
}
int ZeroOptimizer::group_count() const { return static_cast<int>(impl_->core.groups.size()); }
const ParamGroup& ZeroOptimizer::group(int index) const {
  return impl_->core.groups.at(static_cast<size_t>(index));
}
int ZeroOptimizer::stage() const { return impl_->partition->stage(); }
int64_t ZeroOptimizer::steps() const { return impl_->core.steps; }
float ZeroOptimizer::loss_scale() const { return impl_->core.scaler.scale(); }
uint64_t ZeroOptimizer::partition_elements() const {
  return impl_->partition->partition_elements();
}
uint64_t ZeroOptimizer::owned_elements() const { return impl_->partition->owned_elements(); }

}  // namespace zoffload
