#include "zero/zero_optimizer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "common/strings.h"
#include "common/trace.h"
#include "cpu_adam/adam_kernels.h"
#include "cpu_adam/adam_math.h"
#include "engine/checkpoint.h"
#include "engine/param_math.h"
#include "zero/exact_squares.h"

namespace zoffload::internal::zero {
namespace {

using Clock = std::chrono::steady_clock;

// Trace tracks (zoffload.trace_path): each step, and each GatherParameter call.
constexpr const char* kStepTrack = "zero";
constexpr const char* kGatherTrack = "parameter gathers";

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Writes the new values of the owned spans (OptimizerState's tensors) into their memory, which
// `values` gives for overwriting: a span's at its first chunk, let go after its last.
class PartitionSink final : public ParamSink {
 public:
  PartitionSink(std::function<Result<SpanValues>(size_t)> values,
                const std::vector<BucketPlan::Span>& owned, DType dtype)
      : values_(std::move(values)), owned_(owned), dtype_(dtype) {}
  Result<void*> Begin(size_t tensor, uint64_t first, uint64_t /*n*/) override {
    auto it = open_.find(tensor);
    if (it == open_.end()) {
      ZO_ASSIGN_OR_RETURN(SpanValues v, values_(tensor));
      it = open_.emplace(tensor, std::move(v)).first;
    }
    return static_cast<void*>(it->second.data + first * DTypeBytes(dtype_));
  }
  Status End(size_t tensor, uint64_t first, uint64_t n, const float* master) override {
    const auto it = open_.find(tensor);
    if (it == open_.end()) {
      return InternalError(StrCat("ZeRO: span ", tensor, " ended without a beginning"));
    }
    if (dtype_ == DType::kFp32) std::memcpy(it->second.data + 4 * first, master, 4 * n);
    if (first + n == owned_[tensor].n) open_.erase(it);
    return Status::Ok();
  }

 private:
  std::function<Result<SpanValues>(size_t)> values_;
  const std::vector<BucketPlan::Span>& owned_;
  DType dtype_;
  std::map<size_t, SpanValues> open_;
};

}  // namespace

ZeroOptimizer::~ZeroOptimizer() {
  // The values on NVMe are this run's working copy (a checkpoint holds the masters): their
  // space is given back.
  for (const std::string& key : value_keys_) store_->Unregister(key).IgnoreError();
}

uint64_t ZeroOptimizer::bytes_per_element() const { return DTypeBytes(dtype_); }

uint64_t ZeroOptimizer::owned_elements() const {
  uint64_t n = 0;
  for (const BucketPlan::Span& s : owned_) n += s.n;
  return n;
}

Result<std::unique_ptr<ZeroOptimizer>> ZeroOptimizer::Create(const Config& config,
                                                             std::vector<ParameterSpec> specs,
                                                             Communicator& comm,
                                                             ZeroOptions options, uint64_t align) {
  std::unique_ptr<ZeroOptimizer> z(new ZeroOptimizer(config, comm));
  // The parser's rules, for a config built in code (config_: nvme_paths normalized).
  ZO_RETURN_IF_ERROR(ValidateConfig(z->config_, comm.world()).WithContext("ZeRO"));
  const ZeroConfig& zc = z->config_.zero_optimization;
  if (zc.stage < 1 || zc.stage > 3) {
    return InvalidArgumentError(
        StrCat("ZeRO: zero_optimization.stage must be 1, 2 or 3 to partition across ranks, got ",
               zc.stage));
  }
  if (config.zoffload.overlap != Overlap::kNone) {
    return InvalidArgumentError(
        "ZeRO: zoffload.overlap must be \"none\" with zero_optimization across ranks (the "
        "update needs every rank's gradients first)");
  }
  z->stage_ = zc.stage;
  z->accumulation_ = static_cast<int>(config.gradient_accumulation_steps.value_or(1));
  z->scaler_ = LossScaler(config.fp16);
  ZO_ASSIGN_OR_RETURN(OptimizerStateOptions so, OptimizerStateOptions::FromConfig(z->config_));
  ZO_ASSIGN_OR_RETURN(z->groups_, StartingGroups(options.groups, config.optimizer, "ZeRO"));
  ZO_RETURN_IF_ERROR(CheckSpecs(specs, z->groups_.size(), "ZeRO"));
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParameterSpec& s = specs[i];
    if (s.dtype != specs[0].dtype) {
      return InvalidArgumentError(StrCat("ZeRO: parameter '", s.name, "' is ", ToString(s.dtype),
                                         " but '", specs[0].name, "' is ", ToString(specs[0].dtype),
                                         "; the parameters of one optimizer share a dtype"));
    }
    z->index_.emplace(s.name, i);
    Param p;
    p.name = s.name;
    p.n = s.elements;
    p.data = zc.stage == 3 ? nullptr : s.data;
    p.group = s.group;
    p.dtype = s.dtype;
    p.shape = s.shape.empty() ? std::vector<uint64_t>{s.elements} : s.shape;
    z->params_.push_back(std::move(p));
    sizes.push_back(s.elements);
  }
  z->dtype_ = specs[0].dtype;
  std::vector<size_t> order = options.order;
  if (order.empty()) {
    for (size_t i = specs.size(); i > 0; --i) order.push_back(i - 1);
  }
  if (align == 0) return InvalidArgumentError("ZeRO: align must be at least 1 element");
  auto plan = BucketPlan::Create(sizes, order, comm.world(),
                                 static_cast<uint64_t>(zc.reduce_bucket_size), align);
  if (!plan.ok()) return plan.status().WithContext("ZeRO");
  z->plan_ = std::move(*plan);
  const std::vector<BucketPlan::Bucket>& buckets = z->plan_.buckets();
  uint64_t slice_at = 0, full_at = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    z->bucket_offset_.push_back(slice_at);
    z->full_offset_.push_back(full_at);
    slice_at += z->plan_.slice(b);
    full_at += buckets[b].padded;
    for (const BucketPlan::Span& s : buckets[b].spans)
      z->params_[s.tensor].places.push_back({b, s});
  }
  z->owned_ = z->plan_.Owned(comm.rank());
  z->owned_in_bucket_.resize(buckets.size());
  for (size_t k = 0, b = 0; k < z->owned_.size(); ++k) {
    while (z->owned_[k].offset >= z->bucket_offset_[b] + z->plan_.slice(b)) ++b;
    z->owned_in_bucket_[b].push_back(k);
    z->params_[z->owned_[k].tensor].owned.push_back(k);
  }

  RuntimeContext* context = options.context;
  if (context == nullptr) {
    RuntimeOptions ro = RuntimeOptions::FromConfig(z->config_);
    if (comm.world() > 1) {  // ranks on one machine must not share a swap directory
      for (std::string& dir : ro.nvme_paths) {
        dir = StrCat(dir, "/rank", comm.rank());
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        if (ec) {
          return FailedPreconditionError(
              StrCat("ZeRO: cannot create this rank's swap directory ", dir, ": ", ec.message()));
        }
      }
    }
    ZO_ASSIGN_OR_RETURN(z->own_context_, RuntimeContext::Create(std::move(ro)));
    context = z->own_context_.get();
  }
  z->rt_ = &RuntimeAccess::Of(*context);
  SetCpuAdamCoreBinding(config.zoffload.cpu_adam_bind_cores);

  const uint64_t part = z->plan_.partition_elements();
  const uint64_t element = z->bytes_per_element();
  if (comm.world() == 1 && z->accumulation_ == 1 && z->stage_ >= 2 &&
      (z->dtype_ == DType::kFp32 || z->dtype_ == DType::kBf16)) {
    z->grad_dtype_ = z->dtype_;
  }
  // Page-locked where a caller's D2H may land in it (GradientBuffer).
  ZO_ASSIGN_OR_RETURN(z->grads_, z->rt_->AllocateHost(DTypeBytes(z->grad_dtype_) * part,
                                                      "ZeRO: the partition's gradients",
                                                      z->GradientsAsGiven() && z->rt_->has_gpu()));
  std::memset(z->grads_.data(), 0, z->grads_.size());
  if (z->stage_ == 3 && zc.offload_param.device == OffloadDevice::kNvme) {
    // The cache holds a piece while it is gathered or updated: the largest must fit.
    const auto largest = std::max_element(
        z->owned_.begin(), z->owned_.end(),
        [](const BucketPlan::Span& a, const BucketPlan::Span& b) { return a.n < b.n; });
    if (largest != z->owned_.end() &&
        largest->n > static_cast<uint64_t>(zc.offload_param.max_in_cpu)) {
      return InvalidArgumentError(StrCat(
          "ZeRO: zero_optimization.offload_param.max_in_cpu (", zc.offload_param.max_in_cpu,
          " elements) cannot hold '", specs[largest->tensor].name, "' (", largest->n,
          " elements of it on this rank): the host cache of the parameters on NVMe must hold "
          "the largest piece; raise it to at least ",
          largest->n));
    }
    StoreOptions store;
    store.nvme_cache_bytes = static_cast<uint64_t>(zc.offload_param.max_in_cpu) * element;
    ZO_ASSIGN_OR_RETURN(z->store_, TensorStore::Open(*context, store));
    for (const BucketPlan::Span& s : z->owned_) {
      std::string key =
          StrCat("zero-values/", specs[s.tensor].name, "[", s.first, ":", s.first + s.n, "]");
      ZO_RETURN_IF_ERROR(z->store_->Register(key, z->dtype_, s.n, Tier::kNvme)
                             .WithContext("ZeRO: offload_param nvme"));
      z->value_keys_.push_back(std::move(key));
    }
  } else {
    ZO_ASSIGN_OR_RETURN(z->values_, z->rt_->AllocateHost(
                                        element * part, "ZeRO: the partition's parameters", false));
    std::memset(z->values_.data(), 0, z->values_.size());
  }
  if (z->stage_ == 1) {
    ZO_ASSIGN_OR_RETURN(z->full_grads_, z->rt_->AllocateHost(
                                            4 * full_at, "ZeRO stage 1: the gradient sums", false));
    std::memset(z->full_grads_.data(), 0, z->full_grads_.size());
  }
  if (!z->owned_.empty()) {
    std::vector<OptimizerTensor> tensors;
    for (const BucketPlan::Span& s : z->owned_) {
      tensors.push_back(
          {StrCat(specs[s.tensor].name, "[", s.first, ":", s.first + s.n, "]"), s.n, s.first});
    }
    ZO_ASSIGN_OR_RETURN(z->state_, OptimizerState::Create(std::move(tensors), *context, so));
    std::vector<float> master;
    for (size_t k = 0; k < z->owned_.size(); ++k) {
      const BucketPlan::Span& s = z->owned_[k];
      const ParameterSpec& spec = specs[s.tensor];
      const std::byte* values = static_cast<const std::byte*>(spec.data) + s.first * element;
      ZO_ASSIGN_OR_RETURN(SpanValues mine, z->OwnedValues(k, Access::kWrite));
      std::memcpy(mine.data, values, s.n * element);
      const float* initial = spec.initial != nullptr ? spec.initial + s.first : nullptr;
      if (initial == nullptr) {
        master.resize(s.n);
        Accumulate(master.data(), values, z->dtype_, s.n, false);
        initial = master.data();
      }
      ZO_RETURN_IF_ERROR(
          z->state_->Write(k, initial).WithContext(StrCat("ZeRO: initializing '", spec.name, "'")));
    }
  }
  return z;
}

Result<ZeroOptimizer::Param*> ZeroOptimizer::Find(std::string_view name, std::string_view call) {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return NotFoundError(StrCat(call, ": no parameter '", name, "' was registered"));
  }
  return &params_[it->second];
}

Status ZeroOptimizer::ReduceBucket(size_t b, int micro) {
  Filling& f = filling_.at(b);
  float* mine = grads_.as<float>() + bucket_offset_[b];
  const uint64_t slice = plan_.slice(b);
  if (micro == 0) {
    return comm_.ReduceScatterSum(f.sums.data(), mine, slice)
        .WithContext(StrCat("ZeRO: reduce-scatter of bucket ", b));
  }
  reduced_.resize(slice);
  ZO_RETURN_IF_ERROR(comm_.ReduceScatterSum(f.sums.data(), reduced_.data(), slice)
                         .WithContext(StrCat("ZeRO: reduce-scatter of bucket ", b)));
  for (uint64_t i = 0; i < slice; ++i) mine[i] += reduced_[i];
  return Status::Ok();
}

Status ZeroOptimizer::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                    DType dtype) {
  ZO_ASSIGN_OR_RETURN(Param * p, Find(name, "GradientReady"));
  if (elements != p->n || dtype != dtype_ || grad == nullptr) {
    return InvalidArgumentError(StrCat("GradientReady: '", p->name, "' takes ", p->n, " ",
                                       ToString(dtype_), " elements, got ", elements, " ",
                                       ToString(dtype), " at ", grad));
  }
  if (p->received == accumulation_) {
    return FailedPreconditionError(
        StrCat("GradientReady: '", p->name, "' already has its ", accumulation_,
               " gradient(s) of this step (gradient_accumulation_steps); call Step first"));
  }
  const int micro = p->received;
  const auto* bytes = static_cast<const std::byte*>(grad);
  const uint64_t element = bytes_per_element();
  if (bytes == InPlace(*p)) {  // written where it goes (GradientBuffer)
    ++p->received;
    return Status::Ok();
  }
  for (const auto& [b, s] : p->places) {
    const std::byte* from = bytes + s.first * element;
    if (stage_ == 1) {
      Accumulate(full_grads_.as<float>() + full_offset_[b] + s.offset, from, dtype_, s.n,
                 micro > 0);
      continue;
    }
    if (comm_.world() == 1) {
      // One rank: a sum over ranks is its own value, so the partition's sums take the gradient
      // directly (the bits of the bucket and its reduce-scatter, without them); with one
      // micro-batch, as given.
      const uint64_t at = bucket_offset_[b] + s.offset;
      if (GradientsAsGiven()) {
        std::memcpy(grads_.data() + at * element, from, s.n * element);
      } else {
        Accumulate(grads_.as<float>() + at, from, dtype_, s.n, micro > 0);
      }
      continue;
    }
    auto [it, fresh] = filling_.try_emplace(b);
    Filling& f = it->second;
    if (fresh) {
      f.sums.assign(plan_.buckets()[b].padded, 0.0f);
      f.micro = micro;
    } else if (f.micro != micro) {
      return FailedPreconditionError(
          StrCat("GradientReady: '", p->name, "' sent its gradient of micro-batch ", micro + 1,
                 " while bucket ", b, " still waits for gradients of micro-batch ", f.micro + 1,
                 "; every parameter's gradient of a micro-batch must come before the next one's"));
    }
    Accumulate(f.sums.data() + s.offset, from, dtype_, s.n, false);
    f.received += s.n;
    if (f.received == plan_.buckets()[b].elements) {
      const Status reduced = ReduceBucket(b, micro);
      filling_.erase(b);
      ZO_RETURN_IF_ERROR(reduced);
    }
  }
  ++p->received;
  return Status::Ok();
}

Result<void*> ZeroOptimizer::GradientBuffer(std::string_view name) {
  ZO_ASSIGN_OR_RETURN(Param * p, Find(name, "GradientBuffer"));
  return static_cast<void*>(InPlace(*p));
}

std::byte* ZeroOptimizer::InPlace(const Param& p) {
  if (!GradientsAsGiven() || p.places.empty()) return nullptr;
  // The parameter's spans must follow each other in the partition (padding splits them).
  const uint64_t first = bucket_offset_[p.places.front().first] + p.places.front().second.offset;
  uint64_t next = first;
  for (const auto& [b, s] : p.places) {
    if (bucket_offset_[b] + s.offset != next) return nullptr;
    next += s.n;
  }
  return grads_.data() + first * bytes_per_element();
}

Status ZeroOptimizer::GatherBucket(size_t b, std::byte* out) {
  const uint64_t element = bytes_per_element();
  return comm_
      .AllGather(values_.data() + bucket_offset_[b] * element, out, plan_.slice(b) * element)
      .WithContext(StrCat("ZeRO: all-gather of bucket ", b));
}

Result<SpanValues> ZeroOptimizer::OwnedValues(size_t k, Access access) {
  SpanValues v;
  if (store_ == nullptr) {
    v.data = values_.data() + owned_[k].offset * bytes_per_element();
    return v;
  }
  ZO_ASSIGN_OR_RETURN(v.lease, store_->Acquire(value_keys_[k], access).Get());
  v.data = v.lease.data();
  return v;
}

void ZeroOptimizer::ReadAhead(size_t t) {
  const size_t at = gathered_.size();
  gathered_.push_back(t);
  if (at < last_gathered_.size() && last_gathered_[at] == t) ReadFrom(at + 1);
}

void ZeroOptimizer::ReadFrom(size_t next) {
  const ZeroConfig& zc = config_.zero_optimization;
  // Half the cache at most: what is read ahead must not evict what is in use.
  const auto window = static_cast<uint64_t>(
      std::min(zc.stage3_prefetch_bucket_size, zc.offload_param.max_in_cpu / 2));
  if (window == 0) return;
  auto owned = [this](size_t t) {
    uint64_t n = 0;
    for (size_t k : params_[t].owned) n += owned_[k].n;
    return n;
  };
  ahead_ = std::max(ahead_, next);
  uint64_t pending = 0;
  for (size_t i = next; i < ahead_; ++i) pending += owned(last_gathered_[i]);
  while (ahead_ < last_gathered_.size() &&
         (ahead_ == next || pending + owned(last_gathered_[ahead_]) <= window)) {
    for (size_t k : params_[last_gathered_[ahead_]].owned) store_->Prefetch(value_keys_[k]);
    pending += owned(last_gathered_[ahead_]);
    ++ahead_;
  }
}

Status ZeroOptimizer::AllGatherParameters() {
  const uint64_t element = bytes_per_element();
  std::vector<std::byte> bucket;
  for (size_t b = 0; b < plan_.buckets().size(); ++b) {
    bucket.resize(plan_.buckets()[b].padded * element);
    ZO_RETURN_IF_ERROR(GatherBucket(b, bucket.data()));
    for (const BucketPlan::Span& s : plan_.buckets()[b].spans) {
      std::memcpy(static_cast<std::byte*>(params_[s.tensor].data) + s.first * element,
                  bucket.data() + s.offset * element, s.n * element);
    }
  }
  return Status::Ok();
}

Result<EngineStepStats> ZeroOptimizer::Step() {
  const auto start = Clock::now();
  std::vector<std::string> missing;
  for (const Param& p : params_) {
    if (p.received != accumulation_) {
      missing.push_back(StrCat("'", p.name, "' (", p.received, " of ", accumulation_, ")"));
    }
  }
  if (!missing.empty()) {
    return FailedPreconditionError(StrCat("Step: ", missing.size(), " of ", params_.size(),
                                          " parameters lack gradients: ", FirstFew(missing, ", "),
                                          "; nothing was updated"));
  }
  if (stage_ == 1) {
    for (size_t b = 0; b < plan_.buckets().size(); ++b) {
      ZO_RETURN_IF_ERROR(comm_
                             .ReduceScatterSum(full_grads_.as<float>() + full_offset_[b],
                                               grads_.as<float>() + bucket_offset_[b],
                                               plan_.slice(b))
                             .WithContext(StrCat("Step: reduce-scatter of bucket ", b)));
    }
  }
  // The exact norm: every rank's squares, added as integers.
  const int threads = config_.zoffload.cpu_adam_threads > 0 ? config_.zoffload.cpu_adam_threads
                                                            : omp_get_max_threads();
  ExactSquares mine;
  for (const BucketPlan::Span& s : owned_) {
    if (grad_dtype_ == DType::kBf16) {
      mine.AddBf16(grads_.as<uint16_t>() + s.offset, s.n, threads);
    } else {
      mine.Add(grads_.as<float>() + s.offset, s.n, threads);
    }
  }
  std::vector<ExactSquares> all(static_cast<size_t>(comm_.world()));
  ZO_RETURN_IF_ERROR(comm_.AllGather(&mine, all.data(), sizeof(ExactSquares))
                         .WithContext("Step: the gradient norm's parts"));
  ExactSquares total;
  for (const ExactSquares& part : all) total.Merge(part);
  const GradNorm norm{std::sqrt(total.Sum()), total.finite()};

  EngineStepStats stats;
  const float scale = scaler_.scale();
  stats.loss_scale = scale;
  const float max_norm = static_cast<float>(config_.gradient_clipping);
  AdamStepResult result;
  if (state_ != nullptr) {
    AdamHyper base = HyperFromConfig(config_.optimizer);
    base.step = steps_ + 1;
    const std::vector<AdamHyper> hypers = GroupHypers(groups_, base);
    std::vector<TensorGrads> grads;
    for (const BucketPlan::Span& s : owned_) {
      grads.push_back({grads_.data() + s.offset * DTypeBytes(grad_dtype_), grad_dtype_, nullptr,
                       CopyFor(dtype_), &hypers[params_[s.tensor].group]});
    }
    // (With the values on NVMe a span is overwritten without being read: after a failed step
    // the values of the spans it was updating are undefined, as the run's state is.)
    PartitionSink sink([this](size_t k) { return OwnedValues(k, Access::kWrite); }, owned_, dtype_);
    auto stepped = state_->Step(grads, base, scale, max_norm, &sink, {}, &norm);
    if (!stepped.ok()) return stepped.status().WithContext("Step");
    result = *stepped;
    if (!result.skipped) stats.adam_seconds = state_->last_step().adam_seconds;
  } else if (!norm.finite) {  // this rank owns no elements: the same decision, no update
    result.skipped = true;
    result.grad_norm = NonfiniteNorm(norm.l2);
  } else {
    ClipAndUnscale(norm.l2, scale, max_norm, &result.grad_norm, &result.clip_coef);
  }
  if (!result.skipped) {
    ++steps_;
    if (stage_ < 3) ZO_RETURN_IF_ERROR(AllGatherParameters().WithContext("Step"));
  }
  scaler_.Update(result.skipped);
  for (Param& p : params_) p.received = 0;
  if (store_ != nullptr) {  // the next step's first reads start now
    last_gathered_ = std::move(gathered_);
    gathered_.clear();
    ahead_ = 0;
    ReadFrom(0);
  }
  stats.step = steps_;
  stats.skipped = result.skipped;
  stats.grad_norm = result.grad_norm;
  stats.clip_coef = result.clip_coef;
  stats.seconds = Since(start);
  if (Tracer* tracer = rt_->tracer()) tracer->Record(kStepTrack, "step", start, Clock::now());
  return stats;
}

Status ZeroOptimizer::SetGroup(int index, const ParamGroup& group) {
  if (index < 0 || index >= group_count()) {
    return OutOfRangeError(
        StrCat("SetGroup: no parameter group ", index, " (there are ", group_count(), ")"));
  }
  ZO_RETURN_IF_ERROR(CheckGroup(group, StrCat("SetGroup ", index)));
  groups_[static_cast<size_t>(index)] = group;
  return Status::Ok();
}

Status ZeroOptimizer::GatherParameter(std::string_view name, void* out) {
  ZO_ASSIGN_OR_RETURN(Param * p, Find(name, "GatherParameter"));
  const auto start = Clock::now();
  const Status gathered = GatherPieces(p, out);
  // The time the caller was blocked (reads not yet in, the copies, the other ranks).
  if (Tracer* tracer = rt_->tracer()) tracer->Record(kGatherTrack, p->name, start, Clock::now());
  return gathered;
}

Status ZeroOptimizer::GatherPieces(Param* p, void* out) {
  if (store_ != nullptr) ReadAhead(static_cast<size_t>(p - params_.data()));
  const uint64_t element = bytes_per_element();
  const auto me = static_cast<uint64_t>(comm_.rank());
  for (const auto& [b, s] : p->places) {
    // Ranks [first, last] hold the span's elements [lo(r), hi(r)) (bucket offsets); each sends
    // `most` elements, its own first: world x the largest piece instead of the whole bucket.
    const uint64_t slice = plan_.slice(b);
    const uint64_t first = s.offset / slice, last = (s.offset + s.n - 1) / slice;
    auto lo = [&](uint64_t r) { return std::max(s.offset, r * slice); };
    auto hi = [&](uint64_t r) { return std::min(s.offset + s.n, (r + 1) * slice); };
    uint64_t most = 0;
    for (uint64_t r = first; r <= last; ++r) most = std::max(most, hi(r) - lo(r));
    const uint64_t bytes = most * element;
    auto scratch = [&] {  // what a rank sends that is not its whole piece (`most` elements)
      if (scratch_.size() < bytes) scratch_.resize(bytes);
      return scratch_.data();
    };
    const std::byte* send = nullptr;
    SpanValues mine;
    if (me >= first && me <= last) {
      const uint64_t from = s.first + lo(me) - s.offset;
      const auto span = std::find_if(p->owned.begin(), p->owned.end(),
                                     [&](size_t k) { return owned_[k].first == from; });
      if (span == p->owned.end()) {
        return InternalError(StrCat("GatherParameter: '", p->name, "' has no span at ", from));
      }
      Result<SpanValues> leased = OwnedValues(*span, Access::kRead);
      if (!leased.ok()) {
        return leased.status().WithContext(StrCat("GatherParameter: '", p->name, "'"));
      }
      mine = std::move(*leased);
      const uint64_t n = hi(me) - lo(me);
      if (comm_.world() == 1) {  // the whole span is this rank's: one copy
        std::memcpy(static_cast<std::byte*>(out) + s.first * element, mine.data, n * element);
        continue;
      }
      if (n == most) {
        send = mine.data;
      } else {
        send = static_cast<const std::byte*>(std::memcpy(scratch(), mine.data, n * element));
      }
    }
    if (send == nullptr) send = scratch();  // no piece here: filler
    gathered_values_.resize(static_cast<uint64_t>(comm_.world()) * bytes);
    ZO_RETURN_IF_ERROR(comm_.AllGather(send, gathered_values_.data(), bytes)
                           .WithContext(StrCat("GatherParameter: '", p->name, "' in bucket ", b)));
    for (uint64_t r = first; r <= last; ++r) {
      std::memcpy(static_cast<std::byte*>(out) + (s.first + lo(r) - s.offset) * element,
                  gathered_values_.data() + r * bytes, (hi(r) - lo(r)) * element);
    }
  }
  return Status::Ok();
}

Status ZeroOptimizer::GatherMaster(std::string_view name, float* out) {
  ZO_ASSIGN_OR_RETURN(Param * p, Find(name, "GatherMaster"));
  std::vector<float> master;
  for (const auto& [b, s] : p->places) {
    ZO_RETURN_IF_ERROR(GatherBucketState(b, master, nullptr, nullptr)
                           .WithContext(StrCat("GatherMaster: '", p->name, "'")));
    std::memcpy(out + s.first, master.data() + s.offset, 4 * s.n);
  }
  return Status::Ok();
}

Status ZeroOptimizer::BetweenSteps(std::string_view what) const {
  for (const Param& p : params_) {
    if (p.received > 0) {
      return FailedPreconditionError(StrCat(what, ": '", p.name,
                                            "' has gradients of the coming step; call it between "
                                            "Step and the next step's first gradient"));
    }
  }
  return Status::Ok();
}

Status ZeroOptimizer::Agree(const Status& outcome, std::string_view what) {
  const int32_t mine = static_cast<int32_t>(outcome.code());
  std::vector<int32_t> all(static_cast<size_t>(comm_.world()));
  ZO_RETURN_IF_ERROR(comm_.AllGather(&mine, all.data(), 4).WithContext(what));
  if (!outcome.ok()) return outcome;
  for (size_t q = 0; q < all.size(); ++q) {
    if (all[q] != 0) {
      return Status(
          static_cast<StatusCode>(all[q]),
          StrCat(what, ": rank ", q, " failed (its own error says why); nothing here changed"));
    }
  }
  return Status::Ok();
}

Status ZeroOptimizer::GatherBucketState(size_t b, std::vector<float>& master,
                                        std::vector<std::byte>* m, std::vector<std::byte>* v) {
  const StatePrecision precision = config_.zoffload.optimizer_state;
  const uint64_t moment = m != nullptr ? AdamMomentBytes(precision, 1) : 0;  // per element
  const uint64_t slice = plan_.slice(b), padded = plan_.buckets()[b].padded;
  std::vector<float> my_master(slice, 0.0f), span_master;
  std::vector<std::byte> my_m(slice * moment), my_v(slice * moment), span_m, span_v;
  for (size_t k : owned_in_bucket_[b]) {
    const BucketPlan::Span& s = owned_[k];
    span_master.resize(s.n);
    span_m.resize(AdamMomentBytes(precision, s.n));
    span_v.resize(span_m.size());
    ZO_RETURN_IF_ERROR(state_->Read(k, span_master.data(), span_m.data(), span_v.data()));
    const uint64_t at = s.offset - bucket_offset_[b];
    std::memcpy(my_master.data() + at, span_master.data(), 4 * s.n);
    if (moment > 0) {  // (without moments my_m and my_v are empty)
      std::memcpy(my_m.data() + at * moment, span_m.data(), s.n * moment);
      std::memcpy(my_v.data() + at * moment, span_v.data(), s.n * moment);
    }
  }
  master.resize(padded);
  ZO_RETURN_IF_ERROR(comm_.AllGather(my_master.data(), master.data(), 4 * slice));
  if (m == nullptr) return Status::Ok();
  m->resize(padded * moment);
  v->resize(padded * moment);
  ZO_RETURN_IF_ERROR(comm_.AllGather(my_m.data(), m->data(), slice * moment));
  return comm_.AllGather(my_v.data(), v->data(), slice * moment);
}

Status ZeroOptimizer::Save(const std::string& dir) {
  const StatePrecision precision = config_.zoffload.optimizer_state;
  Status ready = BetweenSteps("Save");
  if (ready.ok() && precision == StatePrecision::kInt8) {
    ready = UnimplementedError(
        "Save: a ZeRO run with int8 optimizer state cannot be saved yet (the int8 moments' "
        "blocks follow each rank's partition); use zoffload.optimizer_state fp32 or bf16");
  }
  ZO_RETURN_IF_ERROR(Agree(ready, "Save"));
  const uint64_t moment = AdamMomentBytes(precision, 1);  // per element: fp32 4, bf16 2
  CheckpointMeta meta = CheckpointHeader(steps_, scaler_.state(), config_, groups_);
  // Entries in the plan's order, so that each bucket is gathered once.
  std::vector<size_t> order;
  for (const BucketPlan::Bucket& bucket : plan_.buckets()) {
    for (const BucketPlan::Span& s : bucket.spans) {
      if (s.first == 0) order.push_back(s.tensor);
    }
  }
  for (size_t t : order) {
    const Param& p = params_[t];
    meta.entries.push_back(EntryFor(p.name, p.n, p.shape, p.dtype, p.group, precision));
  }
  // Every rank gathers every entry in the same order; rank 0 writes them.
  size_t gathered = 0;
  size_t cached = plan_.buckets().size();  // the bucket now in `master`, `m`, `v`
  std::vector<float> master;
  std::vector<std::byte> m, v;
  auto gather = [&](size_t i, float* out_master, std::byte* out_m, std::byte* out_v) -> Status {
    gathered = i + 1;
    for (const auto& [b, s] : params_[order[i]].places) {
      if (b != cached) {
        ZO_RETURN_IF_ERROR(GatherBucketState(b, master, &m, &v));
        cached = b;
      }
      std::memcpy(out_master + s.first, master.data() + s.offset, 4 * s.n);
      std::memcpy(out_m + s.first * moment, m.data() + s.offset * moment, s.n * moment);
      std::memcpy(out_v + s.first * moment, v.data() + s.offset * moment, s.n * moment);
    }
    return Status::Ok();
  };
  Status written;
  if (comm_.rank() == 0) written = WriteCheckpoint(dir, meta, gather);
  // After a write error rank 0 still takes its part in the gathers the others make.
  uint64_t largest = 0;
  for (const CheckpointEntry& c : meta.entries) largest = std::max(largest, c.bytes());
  std::vector<std::byte> scratch(largest);
  for (size_t i = comm_.rank() == 0 ? gathered : 0; i < meta.entries.size(); ++i) {
    std::byte* sm = scratch.data() + 4 * meta.entries[i].elements;
    ZO_RETURN_IF_ERROR(
        gather(i, reinterpret_cast<float*>(scratch.data()), sm, sm + meta.entries[i].moment_bytes)
            .WithContext("Save"));
  }
  return Agree(written, "Save");
}

Status ZeroOptimizer::Load(const std::string& dir) {
  const StatePrecision precision = config_.zoffload.optimizer_state;
  std::string from;
  CheckpointMeta meta;
  std::vector<const CheckpointEntry*> saved;
  // Every rank reads and checks everything before any rank changes anything.
  Status checked = BetweenSteps("Load");
  if (checked.ok() && precision == StatePrecision::kInt8) {
    checked = UnimplementedError(
        "Load: a ZeRO run with int8 optimizer state cannot load a checkpoint yet (the int8 "
        "moments' blocks follow each rank's partition); use fp32 or bf16 state");
  }
  if (checked.ok()) {
    auto read_meta = ReadCheckpointMeta(dir, &from);
    checked = read_meta.status();
    if (read_meta.ok()) meta = std::move(*read_meta);
  }
  if (checked.ok()) {
    std::vector<RegisteredParam> registered;
    for (const Param& p : params_) registered.push_back({p.name, p.n, p.dtype});
    auto matched = MatchCheckpoint(meta, from, registered, precision, groups_.size());
    checked = matched.status();
    if (matched.ok()) saved = std::move(*matched);
  }
  uint64_t largest = 0;
  for (const CheckpointEntry* c : saved) largest = std::max(largest, c->bytes());
  std::vector<std::byte> buffer(largest);
  auto* master = reinterpret_cast<float*>(buffer.data());
  auto read = [&](const CheckpointEntry& c) {
    std::byte* m = buffer.data() + 4 * c.elements;
    return ReadCheckpointEntry(from, c, master, m, m + c.moment_bytes);
  };
  for (size_t t = 0; checked.ok() && t < saved.size(); ++t) checked = read(*saved[t]);
  ZO_RETURN_IF_ERROR(Agree(checked, "Load"));
  const uint64_t moment = AdamMomentBytes(precision, 1);
  for (size_t t = 0; t < params_.size(); ++t) {
    const Param& p = params_[t];
    const CheckpointEntry& c = *saved[t];
    ZO_RETURN_IF_ERROR(read(c));
    const std::byte* m = buffer.data() + 4 * c.elements;
    const std::byte* v = m + c.moment_bytes;
    for (size_t k : p.owned) {
      const BucketPlan::Span& s = owned_[k];
      ZO_RETURN_IF_ERROR(
          state_->Write(k, master + s.first, m + s.first * moment, v + s.first * moment)
              .WithContext(StrCat("Load '", p.name, "'")));
      ZO_ASSIGN_OR_RETURN(SpanValues mine, OwnedValues(k, Access::kWrite));
      CastFromFloat(master + s.first, mine.data, dtype_, s.n);
    }
    if (p.data != nullptr) CastFromFloat(master, p.data, dtype_, p.n);
  }
  groups_ = meta.groups;
  steps_ = meta.steps;
  scaler_.Restore({meta.loss_scale, meta.overflows, meta.good_steps});
  return Status::Ok();
}

}  // namespace zoffload::internal::zero
