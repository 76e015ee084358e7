// Configs the parser refuses, built in code: the trainers' Create must refuse each of them too
// (a C++ caller fills a Config without ParseConfig). Shared by the engine and ZeRO tests.
#pragma once

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "zoffload/config.h"

namespace zoffload::testing {

struct BadConfig {
  std::string key;                      // the JSON path the error names
  std::function<void(Config&)> change;  // applied to a valid config
  bool json = true;                     // false: a value JSON cannot hold (NaN)
};

// One or more values per rule family: sizes, ranges, enums, cross-field rules.
inline std::vector<BadConfig> BadConfigs() {
  return {
      {"zero_optimization.reduce_bucket_size",
       [](Config& c) { c.zero_optimization.reduce_bucket_size = 0; }},
      {"zero_optimization.reduce_bucket_size",
       [](Config& c) { c.zero_optimization.reduce_bucket_size = -4096; }},
      {"zero_optimization.allgather_bucket_size",
       [](Config& c) { c.zero_optimization.allgather_bucket_size = 0; }},
      {"zero_optimization.stage", [](Config& c) { c.zero_optimization.stage = 4; }},
      {"zero_optimization.offload_optimizer.buffer_count",
       [](Config& c) { c.zero_optimization.offload_optimizer.buffer_count = 0; }},
      {"zero_optimization.offload_optimizer.ratio",
       [](Config& c) { c.zero_optimization.offload_optimizer.ratio = 0.0; }},
      {"zero_optimization.offload_optimizer.ratio",
       [](Config& c) { c.zero_optimization.offload_optimizer.ratio = 1.5; }},
      {"zero_optimization.offload_optimizer.nvme_path",
       [](Config& c) {
         c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
         c.zero_optimization.offload_optimizer.nvme_path.clear();
         c.zoffload.nvme_paths.clear();
       }},
      {"zero_optimization.offload_param.device",
       [](Config& c) {
         c.zero_optimization.stage = 2;
         c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
       }},
      {"zero_optimization.stage3_max_live_parameters",
       [](Config& c) { c.zero_optimization.stage3_max_live_parameters = 0; }},
      {"aio.block_size", [](Config& c) { c.aio.block_size = 1000; }},
      {"aio.queue_depth", [](Config& c) { c.aio.queue_depth = 0; }},
      {"aio.intra_op_parallelism", [](Config& c) { c.aio.intra_op_parallelism = 300; }},
      {"gradient_accumulation_steps", [](Config& c) { c.gradient_accumulation_steps = 0; }},
      {"train_batch_size",
       [](Config& c) {
         c.train_batch_size = 7;
         c.train_micro_batch_size_per_gpu = 2;
         c.gradient_accumulation_steps = 1;
       }},
      {"gradient_clipping", [](Config& c) { c.gradient_clipping = -1.0; }},
      {"gradient_clipping", [](Config& c) { c.gradient_clipping = NAN; }, false},
      {"optimizer.params.lr", [](Config& c) { c.optimizer.params.lr = -0.1; }},
      {"optimizer.params.lr", [](Config& c) { c.optimizer.params.lr = NAN; }, false},
      {"optimizer.params.betas", [](Config& c) { c.optimizer.params.betas[1] = 1.0; }},
      {"optimizer.params.eps", [](Config& c) { c.optimizer.params.eps = 0.0; }},
      {"optimizer.params.weight_decay", [](Config& c) { c.optimizer.params.weight_decay = -1; }},
      {"optimizer.params.adam_w_mode",
       [](Config& c) {
         c.optimizer.type = OptimizerType::kAdamW;
         c.optimizer.params.adam_w_mode = false;
       }},
      {"zoffload.optimizer_state",
       [](Config& c) {
         c.optimizer.type = OptimizerType::kLion;
         c.zoffload.optimizer_state = StatePrecision::kInt8;
       }},
      {"fp16.enabled",
       [](Config& c) {
         c.fp16.enabled = true;
         c.bf16.enabled = true;
       }},
      {"fp16.initial_scale_power", [](Config& c) { c.fp16.initial_scale_power = 64; }},
      {"fp16.loss_scale_window", [](Config& c) { c.fp16.loss_scale_window = 0; }},
      {"fp16.min_loss_scale", [](Config& c) { c.fp16.min_loss_scale = 0.0; }},
      {"zoffload.overlap",
       [](Config& c) {
         c.zoffload.overlap = Overlap::kDelayed;
         c.fp16.enabled = true;
         c.bf16.enabled = false;
       }},
      {"zoffload.delayed_warmup_steps", [](Config& c) { c.zoffload.delayed_warmup_steps = -1; }},
      {"zoffload.comm_timeout_seconds", [](Config& c) { c.zoffload.comm_timeout_seconds = 0; }},
      {"zoffload.cpu_adam_threads", [](Config& c) { c.zoffload.cpu_adam_threads = -2; }},
      {"zoffload.update_chunk_elements",
       [](Config& c) { c.zoffload.update_chunk_elements = 1000; }},
      {"zoffload.nvme_paths[0]", [](Config& c) { c.zoffload.nvme_paths = {""}; }},
      {"zoffload.budgets.host_bytes", [](Config& c) { c.zoffload.budgets.host_bytes = 0; }},
  };
}

}  // namespace zoffload::testing
