// The public ZeroOptimizer (include/zoffload/zero.h): the rank's HostComm and its
// internal::zero::ZeroOptimizer.
#include "zoffload/zero.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "build_info.h"
#include "common/strings.h"
#include "zero/host_comm.h"
#include "zero/zero_optimizer.h"
#if ZO_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "zero/nccl_communicator.h"
#endif

namespace zoffload {
namespace {

using internal::StrCat;

// The value of environment variable `name`, or empty.
std::string Env(const char* name) {
  const char* value = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read at start-up
  return value != nullptr ? value : "";
}

// A whole non-negative decimal number, or -1.
int64_t WholeNumber(const std::string& text) {
  if (text.empty() || text.size() > 9) return -1;
  int64_t n = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

bool GoodRunName(const std::string& run) {
  if (run.empty() || run.size() > 200) return false;
  for (char c : run) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

Result<ZeroRank> ZeroRank::FromEnvironment() {
  ZeroRank r;
  const std::string rank = Env("RANK"), world = Env("WORLD_SIZE");
  if (!rank.empty() || !world.empty()) {
    const int64_t q = WholeNumber(rank), n = WholeNumber(world);
    if (n < 1 || n > 4096) {
      return InvalidArgumentError(
          StrCat("ZeRO: WORLD_SIZE is '", world, "'; it must be the number of ranks, 1 to 4096"));
    }
    if (q < 0 || q >= n) {
      return InvalidArgumentError(
          StrCat("ZeRO: RANK is '", rank, "'; it must be 0 to WORLD_SIZE - 1 (", n - 1, ")"));
    }
    r.rank = static_cast<int>(q);
    r.world = static_cast<int>(n);
  }
  if (const std::string local = Env("LOCAL_RANK"); !local.empty()) {
    r.device = static_cast<int>(WholeNumber(local));
    if (r.device < 0 || r.device > 1024) {
      return InvalidArgumentError(
          StrCat("ZeRO: LOCAL_RANK is '", local, "'; it must be this rank's GPU, 0 to 1024"));
    }
  }
  r.nccl_id = Env("ZOFFLOAD_NCCL_ID");  // checked where it is used
  r.run = Env("ZOFFLOAD_RUN_ID");
  const char* from = "ZOFFLOAD_RUN_ID";
  if (r.run.empty() && !Env("TORCHELASTIC_RUN_ID").empty()) {
    r.run = StrCat(Env("TORCHELASTIC_RUN_ID"), "-", Env("MASTER_PORT"));
    from = "TORCHELASTIC_RUN_ID and MASTER_PORT";
  }
  if (r.run.empty()) {
    if (r.world > 1) {
      return InvalidArgumentError(
          StrCat("ZeRO: rank ", r.rank, " of ", r.world,
                 " needs the run's name, the same on every rank: set ZOFFLOAD_RUN_ID (torchrun "
                 "sets TORCHELASTIC_RUN_ID and MASTER_PORT)"));
    }
    r.run = StrCat("single-", ::getpid());
  } else if (!GoodRunName(r.run)) {
    return InvalidArgumentError(StrCat("ZeRO: the run's name from ", from, " is '", r.run,
                                       "'; use letters, digits, '.', '_' and '-' (at most 200)"));
  }
  return r;
}

Result<std::string> ZeroRank::NewNcclId() {
#if ZO_HAVE_CUDA
  ZO_ASSIGN_OR_RETURN(const internal::NcclUniqueId id, internal::NcclUniqueId::Create());
  return id.ToHex();
#else
  return Status(StatusCode::kUnimplemented, "ZeRO over NCCL: this build has no CUDA");
#endif
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

struct ZeroOptimizer::Impl {
  std::unique_ptr<internal::zero::Communicator> comm;  // outlives the optimizer
  std::unique_ptr<internal::zero::ZeroOptimizer> zero;
};

ZeroOptimizer::ZeroOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ZeroOptimizer::~ZeroOptimizer() = default;

Result<std::unique_ptr<ZeroOptimizer>> ZeroOptimizer::Create(const Config& config,
                                                             std::vector<ParameterSpec> params,
                                                             const ZeroRank& rank,
                                                             ZeroOptions options) {
  if (!GoodRunName(rank.run)) {
    return InvalidArgumentError(StrCat("ZeRO: the run's name is '", rank.run,
                                       "'; use letters, digits, '.', '_' and '-' (at most 200)"));
  }
  auto impl = std::make_unique<Impl>();
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.zoffload.comm_timeout_seconds * 1000));
  if (!rank.nccl_id.empty()) {
    ZO_ASSIGN_OR_RETURN(impl->comm, NcclFor(rank, timeout));
  } else {
    internal::zero::HostComm::Options co;
    co.name = StrCat("zoffload-", rank.run);
    co.rank = rank.rank;
    co.world = rank.world;
    co.timeout = timeout;
    ZO_ASSIGN_OR_RETURN(impl->comm, internal::zero::HostComm::Create(co));
  }
  ZO_ASSIGN_OR_RETURN(impl->zero, internal::zero::ZeroOptimizer::Create(
                                      config, std::move(params), *impl->comm, std::move(options)));
  return std::unique_ptr<ZeroOptimizer>(new ZeroOptimizer(std::move(impl)));
}

Status ZeroOptimizer::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                    DType dtype) {
  return impl_->zero->GradientReady(name, grad, elements, dtype);
}
Result<void*> ZeroOptimizer::GradientBuffer(std::string_view name) {
  return impl_->zero->GradientBuffer(name);
}
Result<EngineStepStats> ZeroOptimizer::Step() { return impl_->zero->Step(); }
Status ZeroOptimizer::GatherParameter(std::string_view name, void* out) {
  return impl_->zero->GatherParameter(name, out);
}
Status ZeroOptimizer::GatherMaster(std::string_view name, float* out) {
  return impl_->zero->GatherMaster(name, out);
}
Status ZeroOptimizer::Save(const std::string& dir) { return impl_->zero->Save(dir); }
Status ZeroOptimizer::Load(const std::string& dir) { return impl_->zero->Load(dir); }
Status ZeroOptimizer::SetGroup(int index, const ParamGroup& group) {
  return impl_->zero->SetGroup(index, group);
}
int ZeroOptimizer::group_count() const { return impl_->zero->group_count(); }
const ParamGroup& ZeroOptimizer::group(int index) const { return impl_->zero->group(index); }
int ZeroOptimizer::stage() const { return impl_->zero->stage(); }
int64_t ZeroOptimizer::steps() const { return impl_->zero->steps(); }
float ZeroOptimizer::loss_scale() const { return impl_->zero->loss_scale(); }
uint64_t ZeroOptimizer::partition_elements() const { return impl_->zero->partition_elements(); }
uint64_t ZeroOptimizer::owned_elements() const { return impl_->zero->owned_elements(); }

}  // namespace zoffload
