// ZeroOptimizer: ZeRO stages 1-3 (zero_optimization.stage) for one rank of a run whose ranks
// are processes on one machine — the C++ side of what zoffload.torch does under
// torch.distributed (docs/zero.md).
//
// Each rank keeps 1/N of the optimizer state (fp32 masters and Adam moments, in host memory or
// on NVMe as offload_optimizer says; stage 1), of the gradients (stage 2) and of the parameters
// (stage 3). The ranks communicate through a shared-memory segment named after the run, or,
// given an NCCL id, over NCCL between their GPUs (ranks may then be on several machines). Every
// rank registers the same parameters and makes the same calls in the same order (they are
// collective); a rank that does not arrive within the timeout makes the others fail. Over
// shared memory the results do not depend on the world size: N ranks taking one micro-batch
// each get the bits of one rank taking the N micro-batches as accumulation steps (over NCCL at
// world sizes 1 and 2 too; above 2 NCCL's sums match to rounding).
//
// One training step of one rank (host parameters):
//   for each micro-batch: forward, backward; GradientReady(name, grad, ...) per parameter
//     (stage 3: GatherParameter before each use of a parameter);
//   Step().
//
// Thread-safety: one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/dtype.h"
#include "zoffload/engine.h"
#include "zoffload/export.h"
#include "zoffload/runtime.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

/// Which rank this process is, of how many, in which run.
struct ZeroRank {
  int rank = 0, world = 1;
  /// The run's name: the same on every rank, unique among the runs on the machine (letters,
  /// digits, '.', '_', '-'; at most 200). The shared-memory segment is named after it.
  std::string run;
  /// Empty: the ranks communicate through host shared memory. Otherwise an NCCL unique id
  /// (NewNcclId on one rank, handed to every rank by the launcher: ZOFFLOAD_NCCL_ID, a file,
  /// torch.distributed): the collectives run over NCCL on CUDA device `device` (the buffers stay
  /// in host memory; each collective goes up, runs between the GPUs and comes down). NVLink
  /// multicast is off (NCCL_NVLS_ENABLE=0 unless set).
  std::string nccl_id;
  int device = 0;

  /// From the environment a launcher sets (torchrun's, or by hand): RANK and WORLD_SIZE
  /// (absent: rank 0 of 1), the run from ZOFFLOAD_RUN_ID, else torchrun's
  /// TORCHELASTIC_RUN_ID and MASTER_PORT; nccl_id from ZOFFLOAD_NCCL_ID and device from
  /// LOCAL_RANK (absent: 0). INVALID_ARGUMENT naming the variable that is malformed or missing.
  static Result<ZeroRank> FromEnvironment();
  /// A new NCCL unique id (256 hex digits) for one run, made on one rank; UNIMPLEMENTED in a
  /// build without CUDA.
  static Result<std::string> NewNcclId();
};

struct ZeroOptions {
  /// Parameter indices in the order their gradients arrive; empty: the reverse of the given
  /// order (backward runs the model backwards).
  std::vector<size_t> order;
  /// The parameter groups; empty: one group from the config's optimizer.params.
  std::vector<ParamGroup> groups;
  /// Shared with other parts (must outlive the optimizer); null: one of its own from the config
  /// (at world size > 1 with the NVMe directories' subdirectory "rank<r>", made if missing).
  RuntimeContext* context = nullptr;
};

class ZeroOptimizer {
 public:
  /// `params`: host memory, one dtype for all. At stages 1 and 2 `data` is the parameter every
  /// rank keeps whole (Step writes the new values into it); at stage 3 it is read here for the
  /// initial values only. Errors name the parameter, key or size at fault.
  static Result<std::unique_ptr<ZeroOptimizer>> Create(const Config& config,
                                                       std::vector<ParameterSpec> params,
                                                       const ZeroRank& rank,
                                                       ZeroOptions options = {});
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  /// This micro-batch's gradient of parameter `name` (host memory, its dtype); the memory may
  /// be reused when this returns.
  Status GradientReady(std::string_view name, const void* grad, uint64_t elements, DType dtype);
  /// One rank, one micro-batch (stages 2-3): the optimizer's own memory for parameter `name`'s
  /// gradient (page-locked when a GPU is present), where a caller may write it before
  /// GradientReady(name, that memory, ...), which then takes it in place, with no copy; null
  /// where it cannot (several ranks or micro-batches, stage 1, a parameter split by padding).
  /// Write it only between Step and this parameter's GradientReady.
  Result<void*> GradientBuffer(std::string_view name);
  /// The optimizer step at the accumulation boundary.
  Result<EngineStepStats> Step();
  /// Parameter `name`'s current values (its dtype) into `out`, host memory (collective).
  Status GatherParameter(std::string_view name, void* out);
  /// Parameter `name`'s fp32 master values into `out` (collective).
  Status GatherMaster(std::string_view name, float* out);
  /// A checkpoint in the OffloadEngine's format, whole parameters written by rank 0: it loads
  /// at any world size and into an OffloadEngine (collective; fp32 or bf16 state).
  Status Save(const std::string& dir);
  /// Restores a checkpoint of Save or of an OffloadEngine (collective; nothing changes on any
  /// rank unless every rank has verified every checksum).
  Status Load(const std::string& dir);
  /// Changes a group's hyperparameters from the next Step on (an LR schedule).
  Status SetGroup(int index, const ParamGroup& group);
  int group_count() const;
  const ParamGroup& group(int index) const;

  int stage() const;
  int64_t steps() const;
  float loss_scale() const;
  /// This rank's partition, padding included (the same on every rank).
  uint64_t partition_elements() const;
  /// The elements whose optimizer state this rank holds.
  uint64_t owned_elements() const;

  /// The library's own way in (src/engine/zero_optimizer.h: one over any communicator, for
  /// tests); not part of the API.
  struct Access;

 private:
  struct Impl;
  explicit ZeroOptimizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoffload
ZO_API_END
