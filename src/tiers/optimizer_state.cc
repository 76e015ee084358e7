#include "tiers/optimizer_state.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <unordered_set>

#include "common/strings.h"
#include "cpu_adam/adam_kernels.h"
#include "cpu_adam/adam_math.h"

namespace zoffload::internal {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kStepTrack = "step";  // the caller's thread on the timeline

// Bytes of the element codes of a moment of `n` elements: the moment without the int8 scales
// that follow them.
uint64_t MomentCodeBytes(StatePrecision p, uint64_t n) {
  const uint64_t scales =
      p == StatePrecision::kInt8 ? 4 * ((n + kInt8StateBlock - 1) / kInt8StateBlock) : 0;
  return AdamMomentBytes(p, n) - scales;
}

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// FNV-1a over the layout, as 16 hex digits.
std::string LayoutHash(const std::vector<OptimizerTensor>& tensors, StatePrecision precision,
                       uint64_t chunk) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::string_view bytes) {
    for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  };
  for (const OptimizerTensor& t : tensors) mix(StrCat(t.name, '\0', t.n, '\0'));
  mix(StrCat(ToString(precision), '\0', chunk));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 0; i < 16; ++i) out[i] = kHex[(h >> (60 - 4 * i)) & 15];
  return out;
}

}  // namespace

struct OptimizerState::Slot {
  HostMemory images;  // one chunk's params, m and v images, laid out as on disk
  Future<> read, write;
  std::byte* part(const std::array<uint64_t, 3>& offsets, int i) {
    return images.data() + offsets[i];
  }
};

Result<OptimizerStateOptions> OptimizerStateOptions::FromConfig(const Config& config) {
  const OffloadOptimizerConfig& oo = config.zero_optimization.offload_optimizer;
  OptimizerStateOptions o;
  switch (oo.device) {
    case OffloadDevice::kCpu:
      o.home = StateHome::kHost;
      break;
    case OffloadDevice::kNvme:
      o.home = StateHome::kNvme;
      o.offload_ratio = oo.ratio;
      break;
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
  o.pipeline.chunk_elements = config.zoffload.update_chunk_elements;
  return o;
}

OptimizerState::~OptimizerState() {
  for (auto& slot : slots_) {
    for (Future<>* f : {&slot->read, &slot->write}) f->Wait().IgnoreError();
  }
}

uint64_t OptimizerState::ImageBytes(uint64_t elements, bool moment) const {
  return moment ? AdamMomentBytes(options_.precision, elements) : 4 * elements;
}

std::array<uint64_t, 3> OptimizerState::PartOffsets(uint64_t n) const {
  const uint64_t m = RoundUp(ImageBytes(n, false), block_);
  return {0, m, m + RoundUp(ImageBytes(n, true), block_)};
}

std::pair<uint64_t, uint64_t> OptimizerState::ItemRange(size_t k) const {
  const Item& it = items_[k];
  const uint64_t v = PartOffsets(it.n)[2];
  const uint64_t bytes = v + ImageBytes(it.n, true);
  return {it.offset, k + 1 < items_.size() ? RoundUp(bytes, block_) : bytes};
}

namespace {

// The chunk of the update (elements), once `tensors` and `options` are checked.
Result<uint64_t> CheckedChunk(const std::vector<OptimizerTensor>& tensors,
                              const OptimizerStateOptions& options) {
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
  // Chunks of host state cost no memory (the update and its copy work in place), so they are
  // large: fewer passes, each of which wakes and joins the threads, and fewer uploads. A chunk
  // of NVMe state is one read and one write through `buffers` slots of host memory.
  const uint64_t chunk = po.chunk_elements != 0                       ? po.chunk_elements
                         : options.home == StateHome::kHost           ? uint64_t{64} << 20
                         : options.precision == StatePrecision::kInt8 ? uint64_t{16} << 20
                                                                      : uint64_t{4} << 20;
  if (chunk % kInt8StateBlock != 0) {
    return InvalidArgumentError(StrCat("optimizer state: chunk_elements ", chunk,
                                       " is not a multiple of ", kInt8StateBlock));
  }
  if (options.home == StateHome::kNvme && po.buffers < kMinNvmeBuffers) {
    return InvalidArgumentError(
        StrCat("optimizer state: the NVMe pipeline needs at least ", kMinNvmeBuffers,
               " buffers (zero_optimization.offload_optimizer.buffer_count), got ", po.buffers));
  }
  const bool nvme = options.home == StateHome::kNvme;
  if (nvme && !(options.offload_ratio > 0 && options.offload_ratio <= 1)) {
    return InvalidArgumentError(
        StrCat("optimizer state: offload_ratio (zero_optimization.offload_optimizer.ratio) must "
               "be in (0, 1], got ",
               options.offload_ratio));
  }
  return chunk;
}

}  // namespace

Result<std::vector<OptimizerTensor>> OptimizerState::AllocateHostShare() {
  const bool nvme = options_.home == StateHome::kNvme;
  const StatePrecision precision = options_.precision;
  // Whole tensors, in order, fill the host share; the others go to NVMe.
  uint64_t total = 0;
  for (const OptimizerTensor& t : tensors_) total += t.n;
  const double host_share = nvme ? 1.0 - options_.offload_ratio : 1.0;
  const auto host_elements = static_cast<uint64_t>(host_share * static_cast<double>(total));
  uint64_t kept = 0;
  std::vector<OptimizerTensor> on_nvme;
  for (const OptimizerTensor& t : tensors_) {
    HostMemory p, m, v;
    if (kept + t.n <= host_elements) {
      kept += t.n;
      Runtime& rt = *rt_;
      const std::string what = StrCat("the optimizer state of '", t.name, "'");
      ZO_ASSIGN_OR_RETURN(p, rt.AllocateHost(4 * t.n, what, false, true));
      ZO_ASSIGN_OR_RETURN(m, rt.AllocateHost(AdamMomentBytes(precision, t.n), what, false, true));
      ZO_ASSIGN_OR_RETURN(v, rt.AllocateHost(AdamMomentBytes(precision, t.n), what, false, true));
      std::memset(p.data(), 0, p.size());
      std::memset(m.data(), 0, m.size());
      std::memset(v.data(), 0, v.size());
    } else {
      on_nvme.push_back(t);
    }
    params_.push_back(std::move(p));
    m_.push_back(std::move(m));
    v_.push_back(std::move(v));
  }
  return on_nvme;
}

Status OptimizerState::SetUpNvme(const std::vector<OptimizerTensor>& on_nvme) {
  const StatePrecision precision = options_.precision;
  const uint64_t chunk = chunk_;
  ZO_ASSIGN_OR_RETURN(swap_, rt_->Swap());
  block_ = swap_->block_size();
  uint64_t end = 0, biggest = 0;
  for (size_t t = 0; t < tensors_.size(); ++t) {
    first_item_.push_back(items_.size());
    if (in_host(t)) continue;
    for (uint64_t first = 0; first < tensors_[t].n; first += chunk) {
      items_.push_back({t, first, std::min(chunk, tensors_[t].n - first), end});
      const uint64_t padded = ItemRange(items_.size() - 1).second;
      const uint64_t bytes = RoundUp(padded, block_);
      end += bytes;
      biggest = std::max(biggest, bytes);
    }
  }
  first_item_.push_back(items_.size());
  const std::string stem = StrCat("optimizer-", LayoutHash(on_nvme, precision, chunk));
  const auto [last_offset, last_bytes] = ItemRange(items_.size() - 1);
  using State = SwapSpace::TensorInfo::State;
  std::array<SwapSpace::TensorInfo, 2> info;
  for (int c = 0; c < 2; ++c) {
    keys_[c] = StrCat(stem, c == 0 ? ".a" : ".b");
    // Block checksums are computed and verified by the Adam threads between requests, so the
    // I/O threads only move data.
    ZO_RETURN_IF_ERROR(
        swap_->Allocate(keys_[c], last_offset + last_bytes, SwapSpace::ChecksumBy::kCaller));
    ZO_ASSIGN_OR_RETURN(info[c], swap_->Info(keys_[c]));
  }
  // The newest committed copy is current.
  const bool clean[2] = {info[0].state == State::kClean, info[1].state == State::kClean};
  current_ =
      clean[0] && clean[1] ? (info[1].generation > info[0].generation ? 1 : 0) : (clean[1] ? 1 : 0);
  if (!clean[0] && !clean[1] &&
      (info[0].state == State::kInterrupted || info[1].state == State::kInterrupted)) {
    return DataLossError(StrCat("optimizer state '", stem,
                                "' was interrupted while it was first being written, before any "
                                "step was committed: Initialize it again"));
  }
  for (int b = 0; b < options_.pipeline.buffers; ++b) {
    auto slot = std::make_unique<Slot>();
    ZO_ASSIGN_OR_RETURN(slot->images,
                        rt_->AllocateHost(biggest, "an NVMe pipeline slot", false, true));
    ZO_RETURN_IF_ERROR(swap_->engine().RegisterBuffer(slot->images.span()));
    slots_.push_back(std::move(slot));
  }
  return Status::Ok();
}

Result<std::unique_ptr<OptimizerState>> OptimizerState::Create(std::vector<OptimizerTensor> tensors,
                                                               RuntimeContext& context,
                                                               OptimizerStateOptions options) {
  ZO_ASSIGN_OR_RETURN(const uint64_t chunk, CheckedChunk(tensors, options));
  std::unique_ptr<OptimizerState> state(new OptimizerState());
  state->tensors_ = std::move(tensors);
  state->options_ = std::move(options);
  state->chunk_ = chunk;
  state->rt_ = &RuntimeAccess::Of(context);
  state->tracer_ = state->rt_->tracer();
  ZO_ASSIGN_OR_RETURN(const std::vector<OptimizerTensor> on_nvme, state->AllocateHostShare());
  if (!on_nvme.empty()) ZO_RETURN_IF_ERROR(state->SetUpNvme(on_nvme));
  for (const auto& list : {&state->params_, &state->m_, &state->v_}) {
    for (const HostMemory& b : *list) state->state_bytes_ += b.size();
  }
  for (const auto& slot : state->slots_) state->state_bytes_ += slot->images.size();
  return state;
}

uint64_t OptimizerState::host_bytes() const { return state_bytes_ + copy_bytes_.load(); }

namespace {

// A moment of tensor `t` in the whole-tensor layout (all codes, then for int8 all scales) and a
// chunk's image of it (the chunk's codes, then its scales): `to_image` copies the chunk
// [first, first + n) one way or the other.
void MomentChunk(StatePrecision p, uint64_t total, std::byte* whole, std::byte* image,
                 uint64_t first, uint64_t n, bool to_image) {
  auto copy = [to_image](std::byte* w, std::byte* i, uint64_t bytes) {
    if (to_image) {
      std::memcpy(i, w, bytes);
    } else {
      std::memcpy(w, i, bytes);
    }
  };
  const uint64_t code_bytes = MomentCodeBytes(p, n);
  copy(whole + MomentCodeBytes(p, first), image, code_bytes);
  if (p == StatePrecision::kInt8) {
    const uint64_t scales = (n + kInt8StateBlock - 1) / kInt8StateBlock;
    copy(whole + MomentCodeBytes(p, total) + 4 * (first / kInt8StateBlock), image + code_bytes,
         4 * scales);
  }
}

}  // namespace

Status OptimizerState::Write(size_t i, const float* params, const void* m, const void* v) {
  if (i >= tensors_.size()) return OutOfRangeError(StrCat("optimizer state: no tensor ", i));
  const OptimizerTensor& t = tensors_[i];
  const StatePrecision p = options_.precision;
  const void* moments[2] = {m, v};
  // Chunk [first, first + n)'s moment j into `image` (zeros without a given moment).
  auto moment_in = [&](int j, std::byte* image, uint64_t first, uint64_t n) {
    if (moments[j] == nullptr) {
      std::memset(image, 0, AdamMomentBytes(p, n));
      return;
    }
    MomentChunk(p, t.n, const_cast<std::byte*>(static_cast<const std::byte*>(moments[j])), image,
                first, n, /*to_image=*/true);
  };
  if (in_host(i)) {
    std::memcpy(params_[i].data(), params, 4 * t.n);
    for (uint64_t first = 0; first < t.n; first += chunk_) {
      const uint64_t offset = AdamMomentBytes(p, first);
      const uint64_t n = std::min(chunk_, t.n - first);
      moment_in(0, m_[i].data() + offset, first, n);
      moment_in(1, v_[i].data() + offset, first, n);
    }
    return Status::Ok();
  }
  ZO_RETURN_IF_ERROR(broken_);
  const std::string& key = keys_[current_];
  ZO_RETURN_IF_ERROR(swap_->BeginWrite({key}));
  Slot& slot = *slots_[0];
  for (size_t k = first_item_[i]; k < first_item_[i + 1]; ++k) {
    const Item& it = items_[k];
    const auto offsets = PartOffsets(it.n);
    const auto [offset, bytes] = ItemRange(k);
    std::memset(slot.images.data(), 0, bytes);  // padding
    std::memcpy(slot.part(offsets, 0), params + it.first, 4 * it.n);
    for (int j = 0; j < 2; ++j) moment_in(j, slot.part(offsets, j + 1), it.first, it.n);
    const std::span<const std::byte> data(slot.images.data(), bytes);
    ZO_RETURN_IF_ERROR(swap_->Checksum(key, offset, data, options_.threads));
    ZO_RETURN_IF_ERROR(
        swap_->Write(key, offset, data).Wait().WithContext(StrCat("writing '", t.name, "'")));
  }
  return swap_->Commit(/*defer_manifest=*/false, {key});
}

Status OptimizerState::Read(size_t i, float* params, void* m, void* v) {
  if (i >= tensors_.size()) return OutOfRangeError(StrCat("optimizer state: no tensor ", i));
  const OptimizerTensor& t = tensors_[i];
  const StatePrecision p = options_.precision;
  std::byte* moments[2] = {static_cast<std::byte*>(m), static_cast<std::byte*>(v)};
  auto moment_out = [&](int j, std::byte* image, uint64_t first, uint64_t n) {
    MomentChunk(p, t.n, moments[j], image, first, n, /*to_image=*/false);
  };
  if (in_host(i)) {
    std::memcpy(params, params_[i].data(), params_[i].size());
    for (uint64_t first = 0; first < t.n; first += chunk_) {
      const uint64_t offset = AdamMomentBytes(p, first);
      const uint64_t n = std::min(chunk_, t.n - first);
      moment_out(0, m_[i].data() + offset, first, n);
      moment_out(1, v_[i].data() + offset, first, n);
    }
    return Status::Ok();
  }
  ZO_RETURN_IF_ERROR(broken_);
  Slot& slot = *slots_[0];
  for (size_t k = first_item_[i]; k < first_item_[i + 1]; ++k) {
    const Item& it = items_[k];
    const auto offsets = PartOffsets(it.n);
    const auto [offset, bytes] = ItemRange(k);
    const std::span<std::byte> data(slot.images.data(), bytes);
    ZO_RETURN_IF_ERROR(swap_->Read(keys_[current_], offset, data)
                           .Wait()
                           .WithContext(StrCat("reading '", t.name, "'")));
    ZO_RETURN_IF_ERROR(swap_->Verify(keys_[current_], offset, data, options_.threads)
                           .WithContext(StrCat("reading '", t.name, "'")));
    std::memcpy(params + it.first, slot.part(offsets, 0), 4 * it.n);
    for (int j = 0; j < 2; ++j) moment_out(j, slot.part(offsets, j + 1), it.first, it.n);
  }
  return Status::Ok();
}

Result<std::vector<AdamShard>> OptimizerState::GradientShards(
    std::span<const TensorGrads> grads) const {
  if (grads.size() != tensors_.size()) {
    return InvalidArgumentError(
        StrCat("optimizer step: ", grads.size(), " gradients for ", tensors_.size(), " tensors"));
  }
  std::vector<AdamShard> shards(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].grads == nullptr) {
      return InvalidArgumentError(
          StrCat("optimizer step: no gradients for '", tensors_[i].name, "'"));
    }
    shards[i].n = tensors_[i].n;
    shards[i].grads = grads[i].grads;
    shards[i].grad_dtype = grads[i].dtype;
  }
  return shards;
}

Result<GradNorm> OptimizerState::Norm(std::span<const TensorGrads> grads) const {
  ZO_ASSIGN_OR_RETURN(const std::vector<AdamShard> shards, GradientShards(grads));
  return GradientNorm(shards, options_.threads);
}

Result<AdamStepResult> OptimizerState::Step(std::span<const TensorGrads> grads,
                                            const AdamHyper& hyper, float loss_scale,
                                            float max_grad_norm, ParamSink* sink,
                                            std::span<const size_t> order, const GradNorm* norm) {
  ZO_RETURN_IF_ERROR(broken_);
  if (!order.empty()) {
    std::vector<char> seen(tensors_.size(), 0);
    bool permutation = order.size() == tensors_.size();
    for (size_t t : order) permutation = permutation && t < seen.size() && !seen[t]++;
    if (!permutation) {
      return InvalidArgumentError(StrCat("optimizer step: the update order (", order.size(),
                                         " entries) is not a permutation of the ", tensors_.size(),
                                         " tensors"));
    }
  }
  if (!(loss_scale > 0)) {
    return InvalidArgumentError(StrCat("optimizer step: loss_scale must be > 0, got ", loss_scale));
  }
  const auto start = Clock::now();
  ZO_ASSIGN_OR_RETURN(const std::vector<AdamShard> grad_shards, GradientShards(grads));
  // The norm pass decides the step: skip on inf/NaN, else the gradient scale. With NVMe
  // state it runs after the first chunk reads are under way (reads change nothing).
  AdamStepResult result;
  auto decide = [&]() -> std::optional<float> {
    const GradNorm found = norm != nullptr ? *norm : GradientNorm(grad_shards, options_.threads);
    if (!found.finite) {
      result.skipped = true;
      result.grad_norm = NonfiniteNorm(found.l2);
      return std::nullopt;
    }
    return ClipAndUnscale(found.l2, loss_scale, max_grad_norm, &result.grad_norm,
                          &result.clip_coef);
  };
  StepStats stats;
  if (items_.empty()) {
    const auto t0 = Clock::now();
    const std::optional<float> grad_scale = decide();
    if (tracer_ != nullptr && norm == nullptr) {
      tracer_->Record(kStepTrack, "gradient norm", t0, Clock::now());
    }
    if (!grad_scale) return result;
    ZO_RETURN_IF_ERROR(UpdateInHost(grads, hyper, *grad_scale, sink, &stats, order));
  } else {
    ZO_RETURN_IF_ERROR(Stream(grads, &hyper, sink, decide, &stats));
    if (result.skipped) return result;
  }
  stats.seconds = Since(start);
  last_ = stats;
  return result;
}

Status OptimizerState::UpdatePiece(size_t t, const TensorGrads& g, float* params, void* m, void* v,
                                   uint64_t first, uint64_t n, const AdamHyper& hyper,
                                   float grad_scale, ParamSink* sink, const std::string& label,
                                   StepStats* stats, const StateFrom& from) {
  AdamShard shard;
  shard.params = params;
  shard.n = n;
  shard.state = options_.precision;
  shard.m = m;
  shard.v = v;
  shard.params_from = from.params;
  shard.m_from = from.m;
  shard.v_from = from.v;
  shard.grads = static_cast<const char*>(g.grads) + first * DTypeBytes(g.dtype);
  shard.grad_dtype = g.dtype;
  shard.copy = g.copy;
  if (sink != nullptr) {
    ZO_ASSIGN_OR_RETURN(void* copy, sink->Begin(t, first, n));
    if (g.copy != ParamCopy::kNone) shard.param_copy = copy;
  } else if (g.copy != ParamCopy::kNone) {
    shard.param_copy = static_cast<char*>(g.param_copy) + first * 2;
  }
  shard.index_offset =
      first + (options_.precision == StatePrecision::kInt8 ? 0 : tensors_[t].first);
  const auto t0 = Clock::now();
  ZO_RETURN_IF_ERROR(AdamUpdateTraced(shard, g.hyper != nullptr ? *g.hyper : hyper, grad_scale,
                                      options_.threads, tracer_, label));
  stats->adam_seconds += Since(t0);
  if (tracer_ != nullptr) tracer_->Record(kStepTrack, StrCat("adam ", label), t0, Clock::now());
  return sink != nullptr ? sink->End(t, first, n, params) : Status::Ok();
}

Status OptimizerState::UpdateInHost(std::span<const TensorGrads> grads, const AdamHyper& hyper,
                                    float grad_scale, ParamSink* sink, StepStats* stats,
                                    std::span<const size_t> order) {
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const size_t i = order.empty() ? k : order[k];
    if (!in_host(i)) continue;
    ZO_RETURN_IF_ERROR(UpdateHostTensor(i, grads[i], hyper, grad_scale, sink, stats));
  }
  return Status::Ok();
}

Status OptimizerState::UpdateHostTensor(size_t i, const TensorGrads& grads, const AdamHyper& hyper,
                                        float grad_scale, ParamSink* sink, StepStats* stats) {
  for (uint64_t first = 0; first < tensors_[i].n; first += chunk_) {
    ZO_RETURN_IF_ERROR(UpdateHostChunk(i, first, grads, hyper, grad_scale, sink, stats));
  }
  return Status::Ok();
}

Status OptimizerState::UpdateHostChunk(size_t i, uint64_t first, const TensorGrads& grads,
                                       const AdamHyper& hyper, float grad_scale, ParamSink* sink,
                                       StepStats* stats) {
  const uint64_t moment = AdamMomentBytes(options_.precision, first);  // its image (see m_)
  StateFrom from;  // kept: the update reads the copy (the state as it was)
  if (!reads_copy_.empty() && reads_copy_[i]) {
    from = {copy_params_[i].as<float>() + first, copy_m_[i].data() + moment,
            copy_v_[i].data() + moment};
  }
  return UpdatePiece(i, grads, params_[i].as<float>() + first, m_[i].data() + moment,
                     v_[i].data() + moment, first, std::min(chunk_, tensors_[i].n - first), hyper,
                     grad_scale, sink, tensors_[i].name, stats, from)
      .WithContext(StrCat("updating '", tensors_[i].name, "'"));
}

Status OptimizerState::UpdateTensor(size_t t, const TensorGrads& grads, const AdamHyper& hyper,
                                    float grad_scale, ParamSink* sink, StepStats* stats) {
  ZO_RETURN_IF_ERROR(broken_);
  if (t >= tensors_.size() || !in_host(t) || grads.grads == nullptr) {
    return InvalidArgumentError(
        StrCat("optimizer update: tensor ", t, " is not a tensor in host memory with gradients"));
  }
  return UpdateHostTensor(t, grads, hyper, grad_scale, sink, stats);
}

Result<bool> OptimizerState::Keep(size_t t, uint64_t room) {
  if (t >= tensors_.size() || !in_host(t)) {
    return InvalidArgumentError(
        StrCat("optimizer state: tensor ", t, " is not a tensor in host memory to keep"));
  }
  if (copy_params_.empty()) {
    copy_params_.resize(tensors_.size());
    copy_m_.resize(tensors_.size());
    copy_v_.resize(tensors_.size());
    reads_copy_.assign(tensors_.size(), false);
  }
  const uint64_t bytes = params_[t].size() + m_[t].size() + v_[t].size();
  if (copy_params_[t].empty()) {
    if (copy_bytes_.load() + bytes > room) return false;
    const std::string what = StrCat("the rollback copy of '", tensors_[t].name, "'s state");
    ZO_ASSIGN_OR_RETURN(copy_params_[t], rt_->AllocateHost(params_[t].size(), what, false));
    ZO_ASSIGN_OR_RETURN(copy_m_[t], rt_->AllocateHost(m_[t].size(), what, false));
    ZO_ASSIGN_OR_RETURN(copy_v_[t], rt_->AllocateHost(v_[t].size(), what, false));
    copy_bytes_ += bytes;
  }
  // The state becomes the copy, and the update writes its new values into the other buffers.
  std::swap(params_[t], copy_params_[t]);
  std::swap(m_[t], copy_m_[t]);
  std::swap(v_[t], copy_v_[t]);
  reads_copy_[t] = true;
  kept_.push_back(t);
  return true;
}

std::vector<size_t> OptimizerState::Undo() {
  for (size_t t : kept_) {
    std::swap(params_[t], copy_params_[t]);
    std::swap(m_[t], copy_m_[t]);
    std::swap(v_[t], copy_v_[t]);
    reads_copy_[t] = false;
  }
  return std::exchange(kept_, {});
}

void OptimizerState::Commit() {
  for (size_t t : kept_) reads_copy_[t] = false;
  kept_.clear();
}

Result<StepStats> OptimizerState::IoOnlyPass() {
  if (items_.empty()) {
    return FailedPreconditionError("optimizer state: the I/O pass needs NVMe-resident state");
  }
  ZO_RETURN_IF_ERROR(broken_);
  StepStats stats;
  const auto start = Clock::now();
  ZO_RETURN_IF_ERROR(Stream({}, nullptr, nullptr, {}, &stats));
  stats.seconds = Since(start);
  return stats;
}

Status OptimizerState::Stream(std::span<const TensorGrads> grads, const AdamHyper* hyper,
                              ParamSink* sink, const std::function<std::optional<float>()>& decide,
                              StepStats* stats) {
  Tracer* tracer = tracer_;
  const std::string& from = keys_[current_];    // read: the current copy
  const std::string& to = keys_[1 - current_];  // written, then current
  // The chunks of the tensors in host memory, updated between the NVMe chunks (an even share
  // before each one's read is waited for), so their CPU Adam runs while the disk works.
  std::vector<std::pair<size_t, uint64_t>> host_chunks;  // tensor, first element
  size_t host_done = 0;
  const size_t buffers = slots_.size();
  const PipelineOptions& po = options_.pipeline;
  const size_t lookahead = !po.overlap_read ? 0 : po.overlap_write ? buffers - 2 : buffers - 1;
  Status status;
  auto note = [&](const Status& s, size_t k, const char* what) {
    if (status.ok() && !s.ok()) {
      const Item& it = items_[k];
      status = s.WithContext(StrCat(what, " '", tensors_[it.tensor].name, "' elements [", it.first,
                                    ", ", it.first + it.n, ")"));
    }
  };
  auto wait = [&](Future<>& f, size_t k, const char* what) {
    if (!f.valid()) return;
    const auto t0 = Clock::now();
    note(f.Wait(), k, what);
    stats->io_wait_seconds += Since(t0);
  };
  // The timeline: the caller's work on kStepTrack, each slot's reads and writes on its own
  // track (a slot has one request in flight at a time), the Adam threads' shares and the
  // rings' busy spans on theirs.
  auto chunk_name = [&](size_t k) {
    const Item& it = items_[k];
    return StrCat(tensors_[it.tensor].name, "[", it.first, "+", it.n, "]");
  };
  auto step_span = [&](const char* name, Clock::time_point t0) {
    if (tracer != nullptr) tracer->Record(kStepTrack, name, t0, Clock::now());
  };
  auto chunk_span = [&](const char* what, size_t k, Clock::time_point t0) {
    if (tracer != nullptr)
      tracer->Record(kStepTrack, StrCat(what, chunk_name(k)), t0, Clock::now());
  };
  auto traced = [&](Future<> io, const char* what, size_t k) -> Future<> {
    if (tracer == nullptr) return io;
    return io.Then([tracer, track = StrCat("nvme slot ", k % buffers), start = Clock::now(),
                    name = StrCat(what, " ", chunk_name(k))](const Status& s) {
      tracer->Record(track, name, start, Clock::now());
      return s;
    });
  };
  std::vector<size_t> slot_item(buffers, 0);  // the item each slot holds
  auto start_reads = [&](size_t k) {
    Slot& slot = *slots_[k % buffers];
    wait(slot.write, slot_item[k % buffers], "writing");  // the slot's last chunk is on disk
    if (!status.ok()) return;
    slot_item[k % buffers] = k;
    const auto [offset, len] = ItemRange(k);
    slot.read = traced(swap_->Read(from, offset, {slot.images.data(), len}), "read", k);
    stats->bytes_read += len;
  };
  // The first reads go out before the norm pass and the manifest update: they need neither.
  size_t next = 0;
  while (next < items_.size() && next <= lookahead) start_reads(next++);
  float grad_scale = 0;
  if (decide) {
    const auto t0 = Clock::now();
    const std::optional<float> scale = decide();
    step_span("gradient norm", t0);
    if (!scale) {  // overflow: the step is skipped; nothing has been written
      for (auto& slot : slots_) slot->read.Wait().IgnoreError();
      return Status::Ok();
    }
    grad_scale = *scale;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (!in_host(t)) continue;
      for (uint64_t first = 0; first < tensors_[t].n; first += chunk_) {
        host_chunks.emplace_back(t, first);
      }
    }
  }
  const auto begin_start = Clock::now();
  if (Status s = swap_->BeginWrite({to}); !s.ok()) status = s;
  step_span("manifest: mark writing", begin_start);
  for (size_t k = 0; k < items_.size() && status.ok(); ++k) {
    while (next < items_.size() && next <= k + lookahead && status.ok()) start_reads(next++);
    const size_t host_due = (host_chunks.size() * (k + 1) + items_.size() - 1) / items_.size();
    while (status.ok() && host_done < host_due) {
      const auto [t, first] = host_chunks[host_done++];
      status = UpdateHostChunk(t, first, grads[t], *hyper, grad_scale, sink, stats);
    }
    Slot& slot = *slots_[k % buffers];
    wait(slot.read, k, "reading");
    const auto [offset, len] = ItemRange(k);
    const std::span<const std::byte> data(slot.images.data(), len);
    const auto verify_start = Clock::now();
    if (status.ok()) note(swap_->Verify(from, offset, data, options_.threads), k, "reading");
    if (!status.ok()) break;
    chunk_span("verify ", k, verify_start);
    const Item& it = items_[k];
    const auto offsets = PartOffsets(it.n);
    if (hyper != nullptr) {
      note(UpdatePiece(it.tensor, grads[it.tensor], reinterpret_cast<float*>(slot.part(offsets, 0)),
                       slot.part(offsets, 1), slot.part(offsets, 2), it.first, it.n, *hyper,
                       grad_scale, sink, tracer != nullptr ? chunk_name(k) : std::string(), stats,
                       {}),
           k, "updating");
      if (!status.ok()) break;
    }
    const auto checksum_start = Clock::now();
    note(swap_->Checksum(to, offset, data, options_.threads), k, "writing");
    if (!status.ok()) break;
    chunk_span("checksum ", k, checksum_start);
    slot.write = traced(swap_->Write(to, offset, data), "write", k);
    stats->bytes_written += len;
    if (!po.overlap_write) wait(slot.write, k, "writing");
  }
  for (size_t b = 0; b < buffers; ++b) {  // nothing may be in flight once the step returns
    wait(slots_[b]->read, slot_item[b], "reading");
    wait(slots_[b]->write, slot_item[b], "writing");
  }
  if (status.ok()) {
    const auto commit_start = Clock::now();
    status = swap_->Commit(/*defer_manifest=*/true, {to});
    step_span("manifest: commit", commit_start);
  }
  if (!status.ok()) {
    // The copy being written is void; the current one was only read.
    swap_->Invalidate(to).IgnoreError();
    if (host_done > 0) {
      broken_ = status.WithContext(
          "an earlier optimizer step failed midway, after updating the state kept in host "
          "memory; the state on NVMe is as before that step");
    }
    return status.WithContext("optimizer step");
  }
  current_ = 1 - current_;
  return Status::Ok();
}

}  // namespace zoffload::internal
