#include "tiers/optimizer_state.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <unordered_set>

#include "common/strings.h"
#include "cpu_adam/adam_math.h"

namespace zoffload {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::array<const char*, 3> kParts = {".p", ".m", ".v"};

uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

size_t ElemBytes(DType t) { return t == DType::kFp32 ? 4 : 2; }

// Bytes of the element codes of a moment of `n` elements; int8 scales follow them.
uint64_t MomentCodeBytes(StatePrecision p, uint64_t n) {
  switch (p) {
    case StatePrecision::kFp32:
      return 4 * n;
    case StatePrecision::kBf16:
      return 2 * n;
    case StatePrecision::kInt8:
      break;
  }
  return (n + 3) & ~uint64_t{3};
}

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

struct OptimizerState::Slot {
  std::array<AlignedBuffer, 3> image;  // params, m, v of one chunk
  std::array<IoFuture, 3> reads, writes;
};

Result<OptimizerStateOptions> OptimizerStateOptions::FromConfig(const Config& config) {
  const OffloadOptimizerConfig& oo = config.zero_optimization.offload_optimizer;
  OptimizerStateOptions o;
  switch (oo.device) {
    case OffloadDevice::kCpu:
      o.home = StateHome::kHost;
      break;
    case OffloadDevice::kNvme: {
      o.home = StateHome::kNvme;
      ZO_ASSIGN_OR_RETURN(o.swap, SwapSpaceOptions::ForOptimizerState(config));
      break;
    }
    case OffloadDevice::kNone:
      return InvalidArgumentError(
          "zero_optimization.offload_optimizer.device is \"none\": the optimizer state is not "
          "offloaded");
  }
  o.precision = config.zoffload.optimizer_state;
  o.threads = config.zoffload.cpu_adam_threads;
  o.pipeline.buffers = oo.buffer_count;
  o.pipeline.overlap_read = oo.pipeline_read;
  o.pipeline.overlap_write = oo.pipeline_write;
  return o;
}

OptimizerState::~OptimizerState() {
  for (auto& slot : slots_) {
    for (auto* futures : {&slot->reads, &slot->writes}) {
      for (IoFuture& f : *futures) {
        if (f.valid()) f.Wait().IgnoreError();
      }
    }
  }
}

uint64_t OptimizerState::ImageBytes(uint64_t elements, bool moment) const {
  return moment ? AdamMomentBytes(options_.precision, elements) : 4 * elements;
}

std::pair<uint64_t, uint64_t> OptimizerState::ImageRange(size_t tensor, uint64_t chunk,
                                                         int part) const {
  const uint64_t stride = part > 0 ? moment_stride_ : param_stride_;
  if (chunk + 1 < Chunks(tensor)) return {chunk * stride, stride};
  return {chunk * stride, ImageBytes(tensors_[tensor].n - chunk * chunk_, part > 0)};
}

Result<std::unique_ptr<OptimizerState>> OptimizerState::Create(std::vector<OptimizerTensor> tensors,
                                                               OptimizerStateOptions options) {
  std::unordered_set<std::string> names;
  for (const OptimizerTensor& t : tensors) {
    if (t.name.empty() || t.n == 0) {
      return InvalidArgumentError(
          StrCat("optimizer state: tensor '", t.name, "' needs a name and at least 1 element"));
    }
    if (!names.insert(t.name).second) {
      return InvalidArgumentError(StrCat("optimizer state: tensor '", t.name, "' given twice"));
    }
  }
  const PipelineOptions& po = options.pipeline;
  const uint64_t chunk = po.chunk_elements != 0                       ? po.chunk_elements
                         : options.precision == StatePrecision::kInt8 ? uint64_t{16} << 20
                                                                      : uint64_t{4} << 20;
  if (chunk % kInt8StateBlock != 0) {
    return InvalidArgumentError(StrCat("optimizer state: chunk_elements ", chunk,
                                       " is not a multiple of ", kInt8StateBlock));
  }
  if (options.home == StateHome::kNvme && po.buffers < 2) {
    return InvalidArgumentError(
        StrCat("optimizer state: the NVMe pipeline needs at least 2 buffers "
               "(zero_optimization.offload_optimizer.buffer_count), got ",
               po.buffers));
  }
  std::unique_ptr<OptimizerState> state(new OptimizerState());
  state->tensors_ = std::move(tensors);
  state->options_ = std::move(options);
  state->chunk_ = chunk;
  const StatePrecision precision = state->options_.precision;
  if (state->options_.home == StateHome::kHost) {
    for (const OptimizerTensor& t : state->tensors_) {
      ZO_ASSIGN_OR_RETURN(AlignedBuffer p, AlignedBuffer::Allocate(4 * t.n, 64, true));
      ZO_ASSIGN_OR_RETURN(AlignedBuffer m,
                          AlignedBuffer::Allocate(AdamMomentBytes(precision, t.n), 64, true));
      ZO_ASSIGN_OR_RETURN(AlignedBuffer v,
                          AlignedBuffer::Allocate(AdamMomentBytes(precision, t.n), 64, true));
      std::memset(p.data(), 0, p.size());
      std::memset(m.data(), 0, m.size());
      std::memset(v.data(), 0, v.size());
      state->params_.push_back(std::move(p));
      state->m_.push_back(std::move(m));
      state->v_.push_back(std::move(v));
    }
    return state;
  }
  ZO_ASSIGN_OR_RETURN(state->swap_, SwapSpace::Open(state->options_.swap));
  const uint64_t block = state->swap_->block_size();
  state->param_stride_ = RoundUp(state->ImageBytes(chunk, false), block);
  state->moment_stride_ = RoundUp(state->ImageBytes(chunk, true), block);
  for (size_t i = 0; i < state->tensors_.size(); ++i) {
    const OptimizerTensor& t = state->tensors_[i];
    const uint64_t chunks = state->Chunks(i);
    const uint64_t last = t.n - (chunks - 1) * chunk;
    for (int part = 0; part < 3; ++part) {
      const bool moment = part > 0;
      const uint64_t stride = moment ? state->moment_stride_ : state->param_stride_;
      ZO_RETURN_IF_ERROR(state->swap_->Allocate(
          t.name + kParts[part], (chunks - 1) * stride + state->ImageBytes(last, moment)));
    }
  }
  for (int b = 0; b < state->options_.pipeline.buffers; ++b) {
    auto slot = std::make_unique<Slot>();
    for (int part = 0; part < 3; ++part) {
      const uint64_t bytes = part > 0 ? state->moment_stride_ : state->param_stride_;
      ZO_ASSIGN_OR_RETURN(slot->image[part], AlignedBuffer::Allocate(bytes, 4096, true));
      ZO_RETURN_IF_ERROR(state->swap_->engine().RegisterBuffer(slot->image[part].span()));
    }
    state->slots_.push_back(std::move(slot));
  }
  return state;
}

uint64_t OptimizerState::host_bytes() const {
  uint64_t total = 0;
  for (const auto& list : {&params_, &m_, &v_}) {
    for (const AlignedBuffer& b : *list) total += b.size();
  }
  for (const auto& slot : slots_) {
    for (const AlignedBuffer& b : slot->image) total += b.size();
  }
  return total;
}

Status OptimizerState::Initialize(size_t i, const float* params) {
  if (i >= tensors_.size()) return OutOfRangeError(StrCat("optimizer state: no tensor ", i));
  const OptimizerTensor& t = tensors_[i];
  if (options_.home == StateHome::kHost) {
    std::memcpy(params_[i].data(), params, 4 * t.n);
    std::memset(m_[i].data(), 0, m_[i].size());
    std::memset(v_[i].data(), 0, v_[i].size());
    return Status::Ok();
  }
  ZO_RETURN_IF_ERROR(broken_);
  std::vector<std::string> keys;
  for (const char* part : kParts) keys.push_back(t.name + part);
  ZO_RETURN_IF_ERROR(swap_->BeginWrite(keys));
  Slot& slot = *slots_[0];
  for (uint64_t c = 0; c < Chunks(i); ++c) {
    const uint64_t len = std::min(chunk_, t.n - c * chunk_);
    std::memcpy(slot.image[0].data(), params + c * chunk_, 4 * len);
    std::memset(slot.image[1].data(), 0, slot.image[1].size());
    std::memset(slot.image[2].data(), 0, slot.image[2].size());
    for (int part = 0; part < 3; ++part) {
      const auto [offset, bytes] = ImageRange(i, c, part);
      slot.writes[part] = swap_->Write(keys[part], offset, {slot.image[part].data(), bytes});
    }
    for (IoFuture& f : slot.writes) ZO_RETURN_IF_ERROR(f.Wait());
  }
  return swap_->Commit();
}

Status OptimizerState::Read(size_t i, float* params, void* m, void* v) {
  if (i >= tensors_.size()) return OutOfRangeError(StrCat("optimizer state: no tensor ", i));
  const OptimizerTensor& t = tensors_[i];
  if (options_.home == StateHome::kHost) {
    std::memcpy(params, params_[i].data(), params_[i].size());
    std::memcpy(m, m_[i].data(), m_[i].size());
    std::memcpy(v, v_[i].data(), v_[i].size());
    return Status::Ok();
  }
  ZO_RETURN_IF_ERROR(broken_);
  const StatePrecision p = options_.precision;
  const uint64_t codes_total = MomentCodeBytes(p, t.n);
  Slot& slot = *slots_[0];
  void* moments[2] = {m, v};
  for (uint64_t c = 0; c < Chunks(i); ++c) {
    const uint64_t len = std::min(chunk_, t.n - c * chunk_);
    for (int part = 0; part < 3; ++part) {
      const auto [offset, bytes] = ImageRange(i, c, part);
      slot.reads[part] =
          swap_->Read(t.name + kParts[part], offset, {slot.image[part].data(), bytes});
    }
    for (IoFuture& f : slot.reads) ZO_RETURN_IF_ERROR(f.Wait());
    std::memcpy(params + c * chunk_, slot.image[0].data(), 4 * len);
    for (int k = 0; k < 2; ++k) {
      auto* out = static_cast<std::byte*>(moments[k]);
      const std::byte* image = slot.image[k + 1].data();
      const uint64_t code_bytes = MomentCodeBytes(p, len);
      std::memcpy(out + MomentCodeBytes(p, c * chunk_), image,
                  p == StatePrecision::kInt8 ? len : code_bytes);
      if (p == StatePrecision::kInt8) {  // scales follow the codes, in both layouts
        const uint64_t scales = (len + kInt8StateBlock - 1) / kInt8StateBlock;
        std::memcpy(out + codes_total + 4 * (c * chunk_ / kInt8StateBlock), image + code_bytes,
                    4 * scales);
      }
    }
  }
  return Status::Ok();
}

Result<AdamStepResult> OptimizerState::Step(std::span<const TensorGrads> grads,
                                            const AdamHyper& hyper, float loss_scale,
                                            float max_grad_norm) {
  ZO_RETURN_IF_ERROR(broken_);
  if (grads.size() != tensors_.size()) {
    return InvalidArgumentError(
        StrCat("optimizer step: ", grads.size(), " gradients for ", tensors_.size(), " tensors"));
  }
  if (!(loss_scale > 0)) {
    return InvalidArgumentError(StrCat("optimizer step: loss_scale must be > 0, got ", loss_scale));
  }
  const auto start = Clock::now();
  std::vector<AdamShard> grad_shards(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].grads == nullptr) {
      return InvalidArgumentError(
          StrCat("optimizer step: no gradients for '", tensors_[i].name, "'"));
    }
    grad_shards[i].n = tensors_[i].n;
    grad_shards[i].grads = grads[i].grads;
    grad_shards[i].grad_dtype = grads[i].dtype;
  }
  AdamStepResult result;
  const GradNorm norm = GradientNorm(grad_shards, options_.threads);
  if (!norm.finite) {
    result.skipped = true;
    return result;
  }
  const float grad_scale = internal::ClipAndUnscale(norm.l2, loss_scale, max_grad_norm,
                                                    &result.grad_norm, &result.clip_coef);
  StepStats stats;
  if (options_.home == StateHome::kHost) {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      AdamShard shard = grad_shards[i];
      shard.params = params_[i].as<float>();
      shard.state = options_.precision;
      shard.m = m_[i].data();
      shard.v = v_[i].data();
      shard.param_copy = grads[i].param_copy;
      shard.copy = grads[i].copy;
      const auto t0 = Clock::now();
      ZO_RETURN_IF_ERROR(AdamUpdate(shard, hyper, grad_scale, options_.threads));
      if (options_.tracer != nullptr) {
        options_.tracer->Record("cpu adam", tensors_[i].name, t0, Clock::now());
      }
    }
    stats.adam_seconds = Since(start);
  } else {
    ZO_RETURN_IF_ERROR(Stream(grads, &hyper, grad_scale, &stats));
  }
  stats.seconds = Since(start);
  last_ = stats;
  return result;
}

Result<StepStats> OptimizerState::IoOnlyPass() {
  if (options_.home != StateHome::kNvme) {
    return FailedPreconditionError("optimizer state: the I/O pass needs NVMe-resident state");
  }
  ZO_RETURN_IF_ERROR(broken_);
  StepStats stats;
  const auto start = Clock::now();
  ZO_RETURN_IF_ERROR(Stream({}, nullptr, 0.0f, &stats));
  stats.seconds = Since(start);
  return stats;
}

Status OptimizerState::Stream(std::span<const TensorGrads> grads, const AdamHyper* hyper,
                              float grad_scale, StepStats* stats) {
  struct Item {
    size_t tensor;
    uint64_t chunk;
  };
  std::vector<Item> items;
  std::vector<std::string> keys;
  for (size_t t = 0; t < tensors_.size(); ++t) {
    for (uint64_t c = 0; c < Chunks(t); ++c) items.push_back({t, c});
    for (const char* part : kParts) keys.push_back(tensors_[t].name + part);
  }
  ZO_RETURN_IF_ERROR(swap_->BeginWrite(keys));
  Tracer* tracer = options_.tracer;
  const size_t buffers = slots_.size();
  const PipelineOptions& po = options_.pipeline;
  const size_t lookahead = !po.overlap_read ? 0 : po.overlap_write ? buffers - 2 : buffers - 1;
  Status status;
  auto note = [&](const Status& s) {
    if (status.ok() && !s.ok()) status = s;
  };
  auto wait = [&](std::array<IoFuture, 3>& futures) {
    const auto t0 = Clock::now();
    for (IoFuture& f : futures) {
      if (f.valid()) note(f.Wait());
    }
    stats->io_wait_seconds += Since(t0);
  };
  auto traced = [&](const char* track, const Item& it,
                    int part) -> std::function<void(const Status&)> {
    if (tracer == nullptr) return {};
    return [tracer, track, start = Clock::now(),
            name = StrCat(tensors_[it.tensor].name, kParts[part], "[", it.chunk, "]")](
               const Status&) { tracer->Record(track, name, start, Clock::now()); };
  };
  auto start_reads = [&](size_t i) {
    Slot& slot = *slots_[i % buffers];
    wait(slot.writes);  // the slot's previous chunk is on disk
    if (!status.ok()) return;
    const Item& it = items[i];
    for (int part = 0; part < 3; ++part) {
      const auto [offset, len] = ImageRange(it.tensor, it.chunk, part);
      slot.reads[part] = swap_->Read(tensors_[it.tensor].name + kParts[part], offset,
                                     {slot.image[part].data(), len}, traced("nvme read", it, part));
      stats->bytes_read += len;
    }
  };
  size_t next = 0;
  for (size_t i = 0; i < items.size() && status.ok(); ++i) {
    while (next < items.size() && next <= i + lookahead && status.ok()) start_reads(next++);
    Slot& slot = *slots_[i % buffers];
    wait(slot.reads);
    if (!status.ok()) break;
    const Item& it = items[i];
    if (hyper != nullptr) {
      const TensorGrads& g = grads[it.tensor];
      const uint64_t first = it.chunk * chunk_;
      AdamShard shard;
      shard.params = slot.image[0].as<float>();
      shard.n = std::min(chunk_, tensors_[it.tensor].n - first);
      shard.state = options_.precision;
      shard.m = slot.image[1].data();
      shard.v = slot.image[2].data();
      shard.grads = static_cast<const char*>(g.grads) + first * ElemBytes(g.dtype);
      shard.grad_dtype = g.dtype;
      shard.copy = g.copy;
      if (g.copy != ParamCopy::kNone) {
        shard.param_copy = static_cast<char*>(g.param_copy) + first * 2;
      }
      shard.index_offset = first;
      const auto t0 = Clock::now();
      note(AdamUpdate(shard, *hyper, grad_scale, options_.threads));
      stats->adam_seconds += Since(t0);
      if (tracer != nullptr) {
        tracer->Record("cpu adam", StrCat(tensors_[it.tensor].name, "[", it.chunk, "]"), t0,
                       Clock::now());
      }
      if (!status.ok()) break;
    }
    for (int part = 0; part < 3; ++part) {
      const auto [offset, len] = ImageRange(it.tensor, it.chunk, part);
      slot.writes[part] =
          swap_->Write(tensors_[it.tensor].name + kParts[part], offset,
                       {slot.image[part].data(), len}, traced("nvme write", it, part));
      stats->bytes_written += len;
    }
    if (!po.overlap_write) wait(slot.writes);
  }
  for (auto& slot : slots_) {  // nothing may be in flight once the step returns
    wait(slot->reads);
    wait(slot->writes);
  }
  if (status.ok()) status = swap_->Commit();
  if (!status.ok()) {
    broken_ = status.WithContext(
        "an earlier optimizer step failed midway; the state on disk mixes two steps and is "
        "reported as interrupted when reopened");
    return status.WithContext("optimizer step");
  }
  return Status::Ok();
}

}  // namespace zoffload
