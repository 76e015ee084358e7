// RuntimeContext: the one owner of what the parts of a training process share.
//
// A TensorStore, an OptimizerState and the OffloadEngine that holds them all need the same
// things: one swap space (one manifest and one I/O engine for the NVMe directories), one pinned
// pool under one host-memory budget, one copy engine (the PCIe streams), the GPU budget and
// the trace. Each part takes the context by reference and borrows them; none opens its own, so
// two parts never rewrite each other's manifest or hide a second memory cap. (The pattern is
// tensorstore's context resources.)
//
// 1. Everything is made on first use: a context for host-only work never opens a swap space
//    or touches CUDA.
// 2. The host budget counts every byte of host memory the parts hold for tensors, state and
//    their buffers (pinned or not; the copy engine's fixed 48 MiB of staging aside); the GPU
//    budget every byte of device memory. A part reserves before it
//    allocates and gives back when it frees; going over is RESOURCE_EXHAUSTED naming the
//    budget, what was asked for, by whom, and what is in use.
// 3. The context must outlive every part that borrows it.
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/export.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

struct RuntimeOptions {
  /// Swap directories (needed once anything lives on NVMe).
  std::vector<std::string> nvme_paths;
  AioConfig aio;
  bool checksums = true;           ///< CRC32C of every NVMe block
  bool durable = false;            ///< see SwapSpaceOptions::durable
  uint64_t host_budget_bytes = 0;  ///< host memory for tensors and state; 0 = no budget
  uint64_t gpu_budget_bytes = 0;   ///< device memory for tensors and buffers; 0 = no budget
  /// TensorStore host tensors from the pinned pool when a GPU is present. (The engine's own
  /// DMA buffers, gradient landing and upload staging, are always pinned.)
  bool pin_host = true;
  int device = 0;          ///< the GPU of device memory, pinned memory and the copy streams
  std::string trace_path;  ///< when non-empty, a Chrome trace is written here at the end

  /// From a config: zoffload.nvme_paths (else offload_optimizer.nvme_path, else
  /// offload_param.nvme_path), aio, zoffload.budgets (host: host_bytes, else
  /// pinned_host_bytes), pin_memory of either offload section, zoffload.trace_path.
  static RuntimeOptions FromConfig(const Config& config);
};

class RuntimeContext {
 public:
  static Result<std::unique_ptr<RuntimeContext>> Create(RuntimeOptions options);
  /// Writes the trace, if any.
  ~RuntimeContext();
  RuntimeContext(const RuntimeContext&) = delete;
  RuntimeContext& operator=(const RuntimeContext&) = delete;

  const RuntimeOptions& options() const;

  struct Stats {
    uint64_t host_bytes = 0, host_budget = 0;  ///< held now; budget (0: none)
    uint64_t gpu_bytes = 0, gpu_budget = 0;
  };
  Stats stats() const;

  /// The library's own way in (src/tiers/runtime_context.h); not part of the API.
  struct Access;

 private:
  struct Impl;
  explicit RuntimeContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoffload
ZO_API_END
