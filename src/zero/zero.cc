// ZeroRank (include/zoffload/zero.h): which rank this process is, from the launcher's
// environment, and NCCL ids. (The ZeroOptimizer itself is the engine core's:
// engine/zero_optimizer.cc.)
#include "zoffload/zero.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "build_info.h"
#include "common/strings.h"
#include "zero/host_comm.h"
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

}  // namespace

bool internal::zero::GoodRunName(const std::string& run) {
  if (run.empty() || run.size() > 200) return false;
  for (char c : run) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

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
  } else if (!internal::zero::GoodRunName(r.run)) {
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

}  // namespace zoffload
