#include "zoffload/config.h"

#include <sys/stat.h>

#include <fstream>

#include <gtest/gtest.h>

#include "test_util.h"

namespace zoffload::internal {
namespace {

// A config that sets every key to a non-default value.
constexpr const char* kEveryKey = R"({
  "train_batch_size": 32,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 8,
  "gradient_clipping": 1.0,
  "wall_clock_breakdown": true,
  "optimizer": {"type": "Adam", "params": {"lr": 2e-5, "betas": [0.8, 0.95], "eps": 1e-6,
                "weight_decay": 0.1, "adam_w_mode": false}},
  "bf16": {"enabled": false},
  "fp16": {"enabled": true, "loss_scale": 128, "initial_scale_power": 12,
           "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 0.5},
  "zero_optimization": {
    "stage": 3, "contiguous_gradients": false, "overlap_comm": true,
    "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme0", "pin_memory": true,
                          "buffer_count": 6, "ratio": 0.5, "pipeline_read": true,
                          "pipeline_write": true},
    "offload_param": {"device": "cpu", "nvme_path": "/mnt/nvme1", "pin_memory": true,
                      "buffer_count": 7, "buffer_size": 200000000, "max_in_cpu": 3000000000},
    "stage3_prefetch_bucket_size": 1000, "stage3_param_persistence_threshold": 0,
    "stage3_max_live_parameters": 2000, "stage3_max_reuse_distance": 3000
  },
  "aio": {"block_size": 4194304, "queue_depth": 32, "intra_op_parallelism": 4,
          "single_submit": true, "overlap_events": false},
  "zoffload": {"nvme_paths": ["/mnt/a", "/mnt/b"],
               "budgets": {"gpu_bytes": "20GiB", "pinned_host_bytes": 1073741824,
                           "host_bytes": "64G"},
               "optimizer_state": "int8", "cpu_adam_threads": 12, "cpu_adam_bind_cores": true,
               "update_chunk_elements": "16M", "trace_path": "/tmp/trace.json"}
})";

Result<Config> Parse(const std::string& text, int world_size = 1) {
  return ParseConfig(text, ParseOptions{world_size, "test.json"});
}

// Asserts that parsing fails and that the message contains each of `needles`.
void ExpectError(const std::string& text, std::initializer_list<std::string> needles,
                 int world_size = 1) {
  auto c = Parse(text, world_size);
  ASSERT_FALSE(c.ok()) << "parsed: " << text;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  for (const std::string& n : needles) {
    EXPECT_NE(c.status().message().find(n), std::string::npos)
        << "missing '" << n << "' in: " << c.status().message();
  }
}

TEST(ConfigTest, EmptyObjectGivesDocumentedDefaults) {
  auto c = Parse("{}");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_optimization.stage, 0);
  EXPECT_EQ(c->aio.block_size, 1048576);
  EXPECT_EQ(c->aio.queue_depth, 8);
  EXPECT_EQ(c->aio.intra_op_parallelism, 1);
  EXPECT_TRUE(c->aio.overlap_events);
  EXPECT_EQ(c->optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c->zero_optimization.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(c->zero_optimization.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(c->zoffload.optimizer_state, StatePrecision::kFp32);
  EXPECT_FALSE(c->train_batch_size.has_value());
  EXPECT_EQ(c->gradient_accumulation_steps, 1);
}

TEST(ConfigTest, EveryKeyIsRead) {
  auto parsed = Parse(kEveryKey);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const Config& c = *parsed;
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_TRUE(c.wall_clock_breakdown);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_EQ(c.optimizer.params.lr, 2e-5);
  EXPECT_EQ(c.optimizer.params.betas[0], 0.8);
  EXPECT_EQ(c.optimizer.params.betas[1], 0.95);
  EXPECT_EQ(c.optimizer.params.eps, 1e-6);
  EXPECT_EQ(c.optimizer.params.weight_decay, 0.1);
  EXPECT_FALSE(c.optimizer.params.adam_w_mode);
  EXPECT_FALSE(c.optimizer.decoupled_weight_decay());
  EXPECT_FALSE(c.bf16.enabled);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 128);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 3);
  EXPECT_FALSE(z.contiguous_gradients);
  EXPECT_TRUE(z.overlap_comm);
  EXPECT_EQ(z.reduce_bucket_size, 50000000);
  EXPECT_EQ(z.allgather_bucket_size, 200000000);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_optimizer.nvme_path, "/mnt/nvme0");
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 6);
  EXPECT_EQ(z.offload_optimizer.ratio, 0.5);
  EXPECT_TRUE(z.offload_optimizer.pipeline_read);
  EXPECT_TRUE(z.offload_optimizer.pipeline_write);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.nvme_path, "/mnt/nvme1");
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_param.buffer_count, 7);
  EXPECT_EQ(z.offload_param.buffer_size, 200000000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 3000000000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 1000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 0);
  EXPECT_EQ(z.stage3_max_live_parameters, 2000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 3000);
  EXPECT_EQ(c.aio.block_size, 4194304);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_EQ(c.zoffload.nvme_paths, (std::vector<std::string>{"/mnt/a", "/mnt/b"}));
  EXPECT_EQ(c.zoffload.budgets.gpu_bytes, 20ull << 30);
  EXPECT_EQ(c.zoffload.budgets.pinned_host_bytes, 1ull << 30);
  EXPECT_EQ(c.zoffload.budgets.host_bytes, 64ull << 30);
  EXPECT_EQ(c.zoffload.optimizer_state, StatePrecision::kInt8);
  EXPECT_EQ(c.zoffload.trace_path, "/tmp/trace.json");
  EXPECT_EQ(c.zoffload.cpu_adam_threads, 12);
  EXPECT_EQ(c.zoffload.update_chunk_elements, uint64_t{16} << 20);
  EXPECT_TRUE(c.zoffload.cpu_adam_bind_cores);
}

TEST(ConfigTest, SerializeRoundTrips) {
  for (const char* text : {kEveryKey, "{}", R"({"train_micro_batch_size_per_gpu": 2})"}) {
    auto first = Parse(text);
    ASSERT_TRUE(first.ok()) << first.status();
    const std::string json = SerializeConfig(*first);
    auto second = Parse(json);
    ASSERT_TRUE(second.ok()) << second.status() << "\n" << json;
    EXPECT_EQ(*first, *second) << json;
    EXPECT_EQ(SerializeConfig(*second), json);
  }
}

TEST(ConfigTest, ThreadCountIsAnAliasOfIntraOpParallelism) {
  auto c = Parse(R"({"aio": {"thread_count": 3}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->aio.intra_op_parallelism, 3);
  EXPECT_NE(SerializeConfig(*c).find("\"intra_op_parallelism\": 3"), std::string::npos);
  ExpectError(R"({"aio": {"thread_count": 3, "intra_op_parallelism": 2}})",
              {"aio.thread_count: both 'intra_op_parallelism' and its alias 'thread_count'"});
}

TEST(ConfigTest, EnumsAreCaseInsensitive) {
  auto c = Parse(R"({"optimizer": {"type": "adamw"}, "zero_optimization": {"stage": 1,
      "offload_optimizer": {"device": "CPU"}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c->zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
}

TEST(ConfigTest, UnknownKeysNameThePathAndTheNearestKey) {
  ExpectError(R"({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})",
              {"test.json: zero_optimization.offload_optimizer.devcie: unknown key; did you "
               "mean 'device'?"});
  ExpectError(R"({"train_batch_sise": 8})", {"train_batch_sise: unknown key; did you mean "
                                             "'train_batch_size'?"});
  ExpectError(R"({"aio": {"blocksize": 4096}})", {"aio.blocksize", "'block_size'"});
  ExpectError(R"({"zoffload": {"budgets": {"gpu": 1}}})", {"zoffload.budgets.gpu: unknown key"});
  // Far from anything: the valid keys are listed instead of a guess.
  ExpectError(R"({"bf16": {"xyzzy": true}})",
              {"bf16.xyzzy: unknown key; valid keys here: enabled"});
}

TEST(ConfigTest, WrongTypesNameThePathAndExpectedType) {
  ExpectError(R"({"aio": {"queue_depth": "8"}})",
              {"aio.queue_depth: expected an integer, got string \"8\""});
  ExpectError(R"({"aio": {"single_submit": 1}})", {"aio.single_submit: expected true or false"});
  ExpectError(R"({"optimizer": {"params": {"lr": "fast"}}})",
              {"optimizer.params.lr: expected a number"});
  ExpectError(R"({"optimizer": {"params": {"betas": [0.9]}}})",
              {"optimizer.params.betas: expected an array of two numbers"});
  ExpectError(R"({"zero_optimization": {"offload_optimizer": {"nvme_path": 3}}})",
              {"zero_optimization.offload_optimizer.nvme_path: expected a string"});
  ExpectError(R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
              {"zero_optimization.offload_optimizer.device: expected one of \"none\", \"cpu\", "
               "\"nvme\", got string \"disk\""});
  ExpectError(R"({"zero_optimization": {"stage": 2.5}})",
              {"zero_optimization.stage: expected an integer, got number 2.5"});
  ExpectError(R"({"zero_optimization": {"stage": 1e10}})", {"zero_optimization.stage: integer"});
  ExpectError(R"({"zero_optimization": 3})",
              {"zero_optimization: expected an object, got number 3"});
  ExpectError(R"({"zoffload": {"nvme_paths": ["/a", 2]}})",
              {"zoffload.nvme_paths[1]: expected a string"});
  ExpectError(R"({"zoffload": {"nvme_paths": "/a"}})",
              {"zoffload.nvme_paths: expected an array of strings"});
  ExpectError(R"({"zoffload": {"budgets": {"host_bytes": "lots"}}})",
              {"zoffload.budgets.host_bytes: expected a byte count"});
  ExpectError(R"({"zoffload": {"optimizer_state": "fp8"}})",
              {"zoffload.optimizer_state: expected one of \"fp32\", \"bf16\", \"int8\""});
  ExpectError(R"({"optimizer": {"type": "Lion"}, "zoffload": {"optimizer_state": "int8"}})",
              {"zoffload.optimizer_state: int8 state is for Adam and AdamW only, not Lion"});
  ExpectError("[1, 2]", {"(root): expected an object"});
}

TEST(ConfigTest, AdagradAndLionTypes) {
  auto lion = Parse(R"({"optimizer": {"type": "lion", "params": {"betas": [0.9, 0.99]}}})");
  ASSERT_TRUE(lion.ok()) << lion.status();
  EXPECT_EQ(lion->optimizer.type, OptimizerType::kLion);
  EXPECT_TRUE(lion->optimizer.decoupled_weight_decay());
  auto adagrad = Parse(R"({"optimizer": {"type": "Adagrad", "params": {"eps": 1e-10}}})");
  ASSERT_TRUE(adagrad.ok()) << adagrad.status();
  EXPECT_EQ(adagrad->optimizer.type, OptimizerType::kAdagrad);
  EXPECT_FALSE(adagrad->optimizer.decoupled_weight_decay());
}

TEST(ConfigTest, MalformedJsonReportsLineAndColumn) {
  ExpectError("{\n  \"aio\": {\"block_size\": 4096,}\n}", {"test.json: invalid JSON", "line 2"});
  ExpectError("", {"invalid JSON"});
}

// nlohmann throws out_of_range (not parse_error) for numbers past double's range: it was an
// uncaught exception, a SIGABRT in every tool that reads a config.
TEST(ConfigTest, NumbersPastDoublesRangeAreErrorsNotCrashes) {
  ExpectError(R"({"x": 1e309})", {"test.json: invalid JSON", "number overflow", "1e309"});
  ExpectError(R"({"gradient_clipping": -1e400})", {"invalid JSON", "-1e400"});
}

TEST(ConfigTest, DuplicateKeysAreErrors) {
  ExpectError(R"({"aio": {"queue_depth": 8, "queue_depth": 16}})",
              {"aio.queue_depth: duplicate key"});
}

TEST(ConfigTest, EveryErrorIsReportedAtOnce) {
  auto c = Parse(R"({"aio": {"queue_depth": 0, "blok_size": 1}, "zero_optimization":
      {"stage": 7}})");
  ASSERT_FALSE(c.ok());
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("3 errors in test.json"), std::string::npos) << m;
  EXPECT_NE(m.find("aio.queue_depth: must be in [1, 4096], got 0"), std::string::npos) << m;
  EXPECT_NE(m.find("aio.blok_size: unknown key"), std::string::npos) << m;
  EXPECT_NE(m.find("zero_optimization.stage: must be 0, 1, 2 or 3, got 7"), std::string::npos) << m;
}

TEST(ConfigTest, BatchArithmetic) {
  auto a = Parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 2);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->gradient_accumulation_steps, 4);
  auto b = Parse(R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})", 2);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->train_micro_batch_size_per_gpu, 8);
  auto c = Parse(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})", 2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train_batch_size, 30);
  auto d = Parse(R"({"train_batch_size": 16})", 4);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(d->gradient_accumulation_steps, 1);
  auto accumulation_only = Parse(R"({"gradient_accumulation_steps": 4})");
  ASSERT_TRUE(accumulation_only.ok()) << accumulation_only.status();
  EXPECT_FALSE(accumulation_only->train_batch_size.has_value());
  auto e = Parse(R"({"train_micro_batch_size_per_gpu": 3})", 2);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->train_batch_size, 6);

  ExpectError(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                  "gradient_accumulation_steps": 2})",
              {"train_batch_size: 32 != train_micro_batch_size_per_gpu (4) x "
               "gradient_accumulation_steps (2) x world size (2) = 16"},
              2);
  ExpectError(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})",
              {"train_batch_size: 30 is not divisible by train_micro_batch_size_per_gpu (4) x "
               "world size (1) = 4"});
  ExpectError(R"({"train_batch_size": 30, "gradient_accumulation_steps": 4})",
              {"is not divisible by gradient_accumulation_steps (4)"});
  ExpectError(R"({"train_batch_size": 3})", {"is not divisible by world size (2)"}, 2);
  ExpectError(R"({"train_batch_size": 0})", {"train_batch_size: must be > 0, got 0"});
  ExpectError(R"({"train_micro_batch_size_per_gpu": -2})",
              {"train_micro_batch_size_per_gpu: must be > 0, got -2"});
  ExpectError("{}", {"(world size): must be >= 1, got 0"}, 0);
}

// One bad value per rule, each expected error naming its path.
TEST(ConfigTest, ImpossibleValuesAndCombinations) {
  struct Case {
    const char* json;
    const char* error;
  };
  const Case cases[] = {
      {R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})",
       "fp16.enabled: fp16 and bf16 cannot both be enabled"},
      {R"({"zero_optimization": {"stage": -1}})", "zero_optimization.stage: must be 0, 1, 2 or 3"},
      {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage: must be 0, 1, 2 or 3"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})",
       "zero_optimization.offload_optimizer.nvme_path: device is \"nvme\" but no nvme_path"},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
       "zero_optimization.offload_param.nvme_path: device is \"nvme\" but no nvme_path"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}})",
       "zero_optimization.offload_optimizer.ratio: must be in (0, 1], got 0"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})",
       "zero_optimization.offload_optimizer.ratio: must be in (0, 1], got 1.5"},
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.5}}})",
       "zero_optimization.offload_optimizer.ratio: a ratio below 1 needs"},
      {R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})",
       "zero_optimization.offload_optimizer.device: offloading the optimizer needs "
       "zero_optimization.stage >= 1, got 0"},
      {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
       "zero_optimization.offload_param.device: offloading parameters needs "
       "zero_optimization.stage 3, got 2"},
      {R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 0}}})",
       "zero_optimization.offload_optimizer.buffer_count: must be > 0, got 0"},
      {R"({"zero_optimization": {"offload_param": {"buffer_count": -1}}})",
       "zero_optimization.offload_param.buffer_count: must be > 0, got -1"},
      {R"({"zero_optimization": {"offload_param": {"buffer_size": 0}}})",
       "zero_optimization.offload_param.buffer_size: must be > 0, got 0"},
      {R"({"zero_optimization": {"offload_param": {"max_in_cpu": 0}}})",
       "zero_optimization.offload_param.max_in_cpu: must be > 0, got 0"},
      {R"({"zero_optimization": {"reduce_bucket_size": 0}})",
       "zero_optimization.reduce_bucket_size: must be > 0, got 0"},
      {R"({"zero_optimization": {"allgather_bucket_size": -5}})",
       "zero_optimization.allgather_bucket_size: must be > 0, got -5"},
      {R"({"zero_optimization": {"stage3_prefetch_bucket_size": -1}})",
       "zero_optimization.stage3_prefetch_bucket_size: must be >= 0, got -1"},
      {R"({"zero_optimization": {"stage3_param_persistence_threshold": -1}})",
       "zero_optimization.stage3_param_persistence_threshold: must be >= 0, got -1"},
      {R"({"zero_optimization": {"stage3_max_live_parameters": 0}})",
       "zero_optimization.stage3_max_live_parameters: must be > 0, got 0"},
      {R"({"zero_optimization": {"stage3_max_reuse_distance": -1}})",
       "zero_optimization.stage3_max_reuse_distance: must be >= 0, got -1"},
      {R"({"aio": {"block_size": 0}})", "aio.block_size: must be a positive multiple of 4096"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size: must be a positive multiple of 4096"},
      {R"({"aio": {"block_size": 1099511627776}})",
       "aio.block_size: must be a positive multiple of 4096 bytes up to 1 GiB"},
      {R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 1}}})",
       "zero_optimization.offload_optimizer.buffer_count: device \"nvme\" streams the state "
       "through at least 2 buffers"},
      {R"({"aio": {"queue_depth": 5000}})", "aio.queue_depth: must be in [1, 4096], got 5000"},
      {R"({"aio": {"intra_op_parallelism": 0}})", "aio.intra_op_parallelism: must be in [1, 256]"},
      {R"({"optimizer": {"params": {"lr": -1}}})", "optimizer.params.lr: must be >= 0, got -1"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})",
       "optimizer.params.betas: beta2 must be in [0, 1), got 1"},
      {R"({"optimizer": {"params": {"eps": 0}}})", "optimizer.params.eps: must be > 0, got 0"},
      {R"({"optimizer": {"params": {"weight_decay": -0.1}}})",
       "optimizer.params.weight_decay: must be >= 0"},
      {R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})",
       "optimizer.params.adam_w_mode: false contradicts type AdamW"},
      {R"({"fp16": {"loss_scale": -1}})", "fp16.loss_scale: must be >= 0, got -1"},
      {R"({"fp16": {"initial_scale_power": 64}})", "fp16.initial_scale_power: must be in [0, 63]"},
      {R"({"fp16": {"loss_scale_window": 0}})", "fp16.loss_scale_window: must be > 0, got 0"},
      {R"({"fp16": {"hysteresis": 0}})", "fp16.hysteresis: must be > 0, got 0"},
      {R"({"fp16": {"min_loss_scale": 0}})", "fp16.min_loss_scale: must be > 0, got 0"},
      {R"({"gradient_clipping": -1})", "gradient_clipping: must be >= 0, got -1"},
      {R"({"zoffload": {"nvme_paths": ["/a", "/a"]}})",
       "zoffload.nvme_paths[1]: \"/a\" is listed twice"},
      {R"({"zoffload": {"nvme_paths": ["/a", "/a/"]}})",
       "zoffload.nvme_paths[1]: \"/a/\" is listed twice (as \"/a\")"},
      {R"({"zoffload": {"nvme_paths": ["/a", "/a//."]}})", "\"/a//.\" is listed twice"},
      {R"({"zoffload": {"nvme_paths": ["/a//", "/a"]}})", "\"/a\" is listed twice"},
      {R"({"zoffload": {"nvme_paths": ["/a\u0000b"]}})",
       "zoffload.nvme_paths[0]: contains a NUL byte"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_path": "/x\u0000"}}})",
       "zero_optimization.offload_optimizer.nvme_path: contains a NUL byte"},
      {R"({"zoffload": {"nvme_paths": [""]}})", "zoffload.nvme_paths[0]: must not be empty"},
      {R"({"zoffload": {"cpu_adam_threads": -1}})",
       "zoffload.cpu_adam_threads: must be in [0, 4096]"},
      {R"({"zoffload": {"update_chunk_elements": 1000}})",
       "zoffload.update_chunk_elements: must be a multiple of 256 in [0, 2^30] (0 = by where "
       "the state lives and its precision), got 1000"},
      {R"({"zoffload": {"update_chunk_elements": "4G"}})",
       "zoffload.update_chunk_elements: must be a multiple of 256 in [0, 2^30]"},
      {R"({"zoffload": {"budgets": {"gpu_bytes": 0}}})", "zoffload.budgets.gpu_bytes: must be > 0"},
      {R"({"zoffload": {"budgets": {"pinned_host_bytes": "0"}}})",
       "zoffload.budgets.pinned_host_bytes: must be > 0"},
      {R"({"zoffload": {"budgets": {"host_bytes": -3}}})",
       "zoffload.budgets.host_bytes: integer -3 is out of range"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    ExpectError(c.json, {c.error});
  }
}

TEST(ConfigTest, StripeListSatisfiesNvmePath) {
  auto c = Parse(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                     "zoffload": {"nvme_paths": ["/mnt/a"]}})");
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST(ConfigTest, NullUnsetsOptionalValues) {
  auto c = Parse(R"({"train_batch_size": null, "zoffload": {"budgets": {"gpu_bytes": null}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->train_batch_size.has_value());
  EXPECT_FALSE(c->zoffload.budgets.gpu_bytes.has_value());
}

TEST(ConfigTest, LoadConfigFileNamesTheFile) {
  testing::TempDir dir;
  const std::string path = dir.File("ds.json");
  std::ofstream(path) << R"({"aio": {"queue_dept": 8}})";
  auto c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(path + ": aio.queue_dept: unknown key; did you mean "
                                             "'queue_depth'?"),
            std::string::npos)
      << c.status();
  auto missing = LoadConfigFile(dir.File("nope.json"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.json"), std::string::npos);
}

// A dotted key got the hint "did you mean 'offload_optimizer'?"; a key with an ANSI escape was
// printed raw, driving the terminal.
TEST(ConfigTest, DottedKeysAndControlCharactersInKeys) {
  ExpectError(R"({"zero_optimization": {"offload_optimizer.device": "cpu"}})",
              {"zero_optimization.offload_optimizer.device: unknown key; nested keys are objects: "
               "write \"offload_optimizer\": {\"device\": ...}"});
  auto escaped = Parse(R"({"aio": {"\u001b[31mred": 1}})");  // JSON's escape for ESC
  ASSERT_FALSE(escaped.ok());
  const std::string message(escaped.status().message());
  EXPECT_EQ(message.find('\x1b'), std::string::npos) << "a raw escape in: " << message;
  EXPECT_NE(message.find("aio.\\x1b[31mred: unknown key"), std::string::npos) << message;
}

// The products wrapped: 4611686018427387905 x 4 = 4 (mod 2^64) "matched" a batch of 4.
TEST(ConfigTest, BatchArithmeticThatOverflowsIsAnError) {
  ExpectError(R"({"train_micro_batch_size_per_gpu": 4611686018427387905,
                 "gradient_accumulation_steps": 4, "train_batch_size": 4})",
              {"overflows a 64-bit count"});
  ExpectError(R"({"train_micro_batch_size_per_gpu": 4611686018427387904,
                 "gradient_accumulation_steps": 2})",
              {"overflows a 64-bit count"});
}

// Each level kept its whole path: 30k levels took 891 MB, 100k aborted with bad_alloc.
TEST(ConfigTest, DeepNestingIsAnErrorAtLinearCost) {
  constexpr int kLevels = 200000;
  std::string deep;
  for (int i = 0; i < kLevels; ++i) deep += R"({"a": )";
  deep += "1";
  deep.append(kLevels, '}');
  ExpectError(deep, {"nested deeper than 64 levels", "a.a.a"});
  std::string arrays = R"({"aio": )" + std::string(kLevels, '[') + std::string(kLevels, ']') + "}";
  ExpectError(arrays, {"aio[][]", "nested deeper than 64 levels"});
  // Within the limit, duplicate keys are still found with their paths.
  ExpectError(
      R"({"zero_optimization": {"offload_optimizer": {"device": "cpu", "device": "nvme"}}})",
      {"zero_optimization.offload_optimizer.device: duplicate key"});
}

TEST(ConfigTest, ValidateConfigChecksStructsBuiltInCode) {
  Config c;
  c.zero_optimization.stage = 2;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  Status s = ValidateConfig(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  c.zero_optimization.offload_optimizer.nvme_path = "/mnt/nvme";
  EXPECT_TRUE(ValidateConfig(c).ok());
}

// Numbers the parse would change are errors naming their key, never silent substitutes: an
// underflow read as 0, a float past 2^53 rounded to another integer, an integer past 64 bits.
TEST(ConfigTest, NumbersThatWouldChangeMeaningAreErrors) {
  ExpectError(R"({"optimizer": {"params": {"lr": 1e-400}}})",
              {"optimizer.params.lr", "would be read as 0"});
  ExpectError(R"({"optimizer": {"params": {"betas": [0.9, 2.5e-999]}}})",
              {"optimizer.params.betas[]", "would be read as 0"});
  ExpectError(R"({"gradient_clipping": -0.00000e-500, "optimizer": {"params": {"lr": 1e400}}})",
              {"overflow"});
  ExpectError(R"({"zero_optimization": {"reduce_bucket_size": 9007199254740993.0}})",
              {"zero_optimization.reduce_bucket_size", "2^53"});
  ExpectError(R"({"train_batch_size": 1e17})", {"train_batch_size", "2^53"});
  ExpectError(R"({"zero_optimization": {"reduce_bucket_size": 18446744073709551616}})",
              {"zero_optimization.reduce_bucket_size", "64 bits"});
  // What is exact stays accepted: a zero written with an exponent, integral floats to 2^53.
  auto c = Parse(R"({"gradient_clipping": 0e-400, "zero_optimization": {"reduce_bucket_size": 5e8},
                     "zoffload": {"update_chunk_elements": 9007199254740992}})");
  EXPECT_FALSE(c.ok());  // the chunk is out of its own range, but read exactly:
  EXPECT_NE(c.status().message().find("9007199254740992"), std::string::npos) << c.status();
  c = Parse(R"({"gradient_clipping": 0e-400, "zero_optimization": {"reduce_bucket_size": 5e8}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_optimization.reduce_bucket_size, 500000000u);
}

// A batch product near 2^63 that the parser accepts, it also reads back from its own output.
TEST(ConfigTest, LargeBatchProductsRoundTrip) {
  auto c = Parse(R"({"train_micro_batch_size_per_gpu": 3037000499,
                     "gradient_accumulation_steps": 3037000499})");
  ASSERT_TRUE(c.ok()) << c.status();
  auto again = Parse(SerializeConfig(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->train_batch_size, c->train_batch_size);
  ExpectError(R"({"train_micro_batch_size_per_gpu": 3037000500,
                  "gradient_accumulation_steps": 3037000500})",
              {"overflows a 64-bit count"});
}

// The loader reads regular files only, and at most 16 MiB of one, saying which path is wrong
// (a directory said "unexpected end of input"; /dev/zero was read until memory ran out).
TEST(ConfigTest, LoaderReadsOnlyRegularFilesOfBoundedSize) {
  testing::TempDir dir;
  const std::string fifo = dir.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string big = dir.path() + "/big.json";
  std::ofstream(big) << std::string(17 << 20, ' ') << "{}";
  for (const std::string& path : {std::string("/dev/zero"), fifo, dir.path(), big}) {
    auto c = LoadConfigFile(path);
    ASSERT_FALSE(c.ok()) << path;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
    EXPECT_NE(c.status().message().find(path), std::string::npos) << c.status();
  }
  auto text = ReadConfigJson(R"({"a": {"b": 1e-5, "c": 18446744073709551615}})", false);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, R"({"a":{"b":1e-05,"c":18446744073709551615}})");
  EXPECT_FALSE(ReadConfigJson(R"({"a": 1, "a": 2})", false).ok());
  EXPECT_FALSE(ReadConfigJson("/dev/zero", true).ok());
}

}  // namespace
}  // namespace zoffload::internal
