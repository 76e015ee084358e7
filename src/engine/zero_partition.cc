// The ZeRO Partition (zero_partition.h).
#include "engine/zero_partition.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "common/config_rules.h"
#include "common/strings.h"
#include "common/trace.h"
#include "cpu_adam/adam_math.h"
#include "engine/checkpoint.h"
#include "engine/param_math.h"
#include "zero/exact_squares.h"

namespace zoffload::internal::zero {
namespace {

using Clock = std::chrono::steady_clock;

// Trace track (zoffload.trace_path): each GatherParameter call.
constexpr const char* kGatherTrack = "parameter gathers";

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

ZeroPartition::~ZeroPartition() {
  // The values on NVMe are this run's working copy (a checkpoint holds the masters): their
  // space is given back.
  for (const std::string& key : value_keys_) store_->Unregister(key).IgnoreError();
}

uint64_t ZeroPartition::bytes_per_element() const { return DTypeBytes(dtype_); }

uint64_t ZeroPartition::owned_elements() const {
  uint64_t n = 0;
  for (const BucketPlan::Span& s : owned_) n += s.n;
  return n;
}

Status ZeroPartition::Plan(const ZeroOptions& options, uint64_t align) {
  const ZeroConfig& zc = core_.config.zero_optimization;
  if (zc.stage < 1 || zc.stage > 3) {
    return InvalidArgumentError(
        StrCat("ZeRO: zero_optimization.stage must be 1, 2 or 3 to partition across ranks, got ",
               zc.stage));
  }
  if (ChosenOverlap(core_.config, true) == Overlap::kDelayed) {
    return InvalidArgumentError(
        "ZeRO: zoffload.overlap must be \"none\", \"backward\" or \"auto\" with "
        "zero_optimization across ranks, not \"delayed\" (the update needs every rank's "
        "gradients first)");
  }
  stage_ = zc.stage;
  const std::vector<EngineParam>& params = core_.params;
  std::vector<uint64_t> sizes;
  for (const EngineParam& p : params) {
    if (p.dtype != params[0].dtype) {
      return InvalidArgumentError(StrCat(
          "ZeRO: parameter '", p.name, "' is ", ToString(p.dtype), " but '", params[0].name,
          "' is ", ToString(params[0].dtype), "; the parameters of one optimizer share a dtype"));
    }
    sizes.push_back(p.n);
  }
  dtype_ = params[0].dtype;
  std::vector<size_t> order = options.order;
  if (order.empty()) {
    for (size_t i = params.size(); i > 0; --i) order.push_back(i - 1);
  }
  if (align == 0) return InvalidArgumentError("ZeRO: align must be at least 1 element");
  auto plan = BucketPlan::Create(sizes, order, comm_.world(),
                                 static_cast<uint64_t>(zc.reduce_bucket_size), align);
  if (!plan.ok()) return plan.status().WithContext("ZeRO");
  plan_ = std::move(*plan);
  info_.resize(params.size());
  const std::vector<BucketPlan::Bucket>& buckets = plan_.buckets();
  uint64_t slice_at = 0, full_at = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    bucket_offset_.push_back(slice_at);
    full_offset_.push_back(full_at);
    slice_at += plan_.slice(b);
    full_at += buckets[b].padded;
    for (const BucketPlan::Span& s : buckets[b].spans) info_[s.tensor].places.push_back({b, s});
  }
  owned_ = plan_.Owned(comm_.rank());
  owned_in_bucket_.resize(buckets.size());
  for (size_t k = 0, b = 0; k < owned_.size(); ++k) {
    while (owned_[k].offset >= bucket_offset_[b] + plan_.slice(b)) ++b;
    owned_in_bucket_[b].push_back(k);
    info_[owned_[k].tensor].owned.push_back(k);
  }
  if (comm_.world() == 1 && core_.accumulation == 1 && stage_ >= 2 &&
      (dtype_ == DType::kFp32 || dtype_ == DType::kBf16)) {
    grad_dtype_ = dtype_;
  }
  return Status::Ok();
}

Status ZeroPartition::CreateState(RuntimeContext& context, const OptimizerStateOptions& so) {
  const ZeroConfig& zc = core_.config.zero_optimization;
  const uint64_t part = plan_.partition_elements();
  const uint64_t element = bytes_per_element();
  uint64_t full = 0;
  for (const BucketPlan::Bucket& bucket : plan_.buckets()) full += bucket.padded;
  // Page-locked where a caller's D2H may land in it (GradientBuffer).
  ZO_ASSIGN_OR_RETURN(grads_, core_.rt->AllocateHost(DTypeBytes(grad_dtype_) * part,
                                                     "ZeRO: the partition's gradients",
                                                     GradientsAsGiven() && core_.rt->has_gpu()));
  std::memset(grads_.data(), 0, grads_.size());
  if (stage_ == 3 && zc.offload_param.device == OffloadDevice::kNvme) {
    // The cache holds a piece while it is gathered or updated: the largest must fit.
    const auto largest = std::max_element(
        owned_.begin(), owned_.end(),
        [](const BucketPlan::Span& a, const BucketPlan::Span& b) { return a.n < b.n; });
    if (largest != owned_.end() &&
        largest->n > static_cast<uint64_t>(zc.offload_param.max_in_cpu)) {
      return InvalidArgumentError(StrCat(
          "ZeRO: zero_optimization.offload_param.max_in_cpu (", zc.offload_param.max_in_cpu,
          " elements) cannot hold '", core_.params[largest->tensor].name, "' (", largest->n,
          " elements of it on this rank): the host cache of the parameters on NVMe must hold "
          "the largest piece; raise it to at least ",
          largest->n));
    }
    StoreOptions store;
    store.nvme_cache_bytes = static_cast<uint64_t>(zc.offload_param.max_in_cpu) * element;
    ZO_ASSIGN_OR_RETURN(store_, TensorStore::Open(context, store));
    for (const BucketPlan::Span& s : owned_) {
      std::string key = StrCat("zero-values/", core_.params[s.tensor].name, "[", s.first, ":",
                               s.first + s.n, "]");
      ZO_RETURN_IF_ERROR(
          store_->Register(key, dtype_, s.n, Tier::kNvme).WithContext("ZeRO: offload_param nvme"));
      value_keys_.push_back(std::move(key));
    }
  } else {
    ZO_ASSIGN_OR_RETURN(
        values_, core_.rt->AllocateHost(element * part, "ZeRO: the partition's parameters", false));
    std::memset(values_.data(), 0, values_.size());
  }
  if (stage_ == 1) {
    ZO_ASSIGN_OR_RETURN(full_grads_,
                        core_.rt->AllocateHost(4 * full, "ZeRO stage 1: the gradient sums", false));
    std::memset(full_grads_.data(), 0, full_grads_.size());
  }
  if (owned_.empty()) return Status::Ok();
  std::vector<OptimizerTensor> tensors;
  for (const BucketPlan::Span& s : owned_) {
    tensors.push_back(
        {StrCat(core_.params[s.tensor].name, "[", s.first, ":", s.first + s.n, "]"), s.n, s.first});
  }
  ZO_ASSIGN_OR_RETURN(core_.state, OptimizerState::Create(std::move(tensors), context, so));
  return Status::Ok();
}

// Each owned span's values and master from the parameter (read here for the initial values
// only at stage 3), or the given fp32 values.
Status ZeroPartition::Initialize() {
  const uint64_t element = bytes_per_element();
  std::vector<float> master;
  for (size_t k = 0; k < owned_.size(); ++k) {
    const BucketPlan::Span& s = owned_[k];
    const EngineParam& p = core_.params[s.tensor];
    const std::byte* values = static_cast<const std::byte*>(p.data) + s.first * element;
    ZO_ASSIGN_OR_RETURN(SpanValues mine, OwnedValues(k, Access::kWrite));
    std::memcpy(mine.data, values, s.n * element);
    const float* initial = p.initial != nullptr ? p.initial + s.first : nullptr;
    if (initial == nullptr) {
      master.resize(s.n);
      Accumulate(master.data(), values, dtype_, s.n, false);
      initial = master.data();
    }
    ZO_RETURN_IF_ERROR(
        core_.state->Write(k, initial).WithContext(StrCat("ZeRO: initializing '", p.name, "'")));
  }
  if (stage_ == 3) {
    for (EngineParam& p : core_.params) p.data = nullptr;  // the partition holds the values
  }
  return Status::Ok();
}

Status ZeroPartition::ReduceBucket(size_t b, int micro) {
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

Status ZeroPartition::Take(size_t i, const void* grad, bool /*add*/, bool /*last*/,
                           void* /*stream*/) {
  EngineParam* p = &core_.params[i];
  const int micro = p->received;
  const auto* bytes = static_cast<const std::byte*>(grad);
  const uint64_t element = bytes_per_element();
  if (bytes == InPlace(*p)) return Status::Ok();  // written where it goes (GradientBuffer)
  for (const auto& [b, s] : InfoOf(*p).places) {
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
  return Status::Ok();
}

void* ZeroPartition::InPlaceBuffer(EngineParam& p) { return InPlace(p); }

std::byte* ZeroPartition::InPlace(const EngineParam& p) {
  if (!GradientsAsGiven() || InfoOf(p).places.empty()) return nullptr;
  // The parameter's spans must follow each other in the partition (padding splits them).
  const uint64_t first =
      bucket_offset_[InfoOf(p).places.front().first] + InfoOf(p).places.front().second.offset;
  uint64_t next = first;
  for (const auto& [b, s] : InfoOf(p).places) {
    if (bucket_offset_[b] + s.offset != next) return nullptr;
    next += s.n;
  }
  return grads_.data() + first * bytes_per_element();
}

Status ZeroPartition::GatherBucket(size_t b, std::byte* out) {
  const uint64_t element = bytes_per_element();
  return comm_
      .AllGather(values_.data() + bucket_offset_[b] * element, out, plan_.slice(b) * element)
      .WithContext(StrCat("ZeRO: all-gather of bucket ", b));
}

Result<SpanValues> ZeroPartition::OwnedValues(size_t k, Access access) {
  SpanValues v;
  if (store_ == nullptr) {
    v.data = values_.data() + owned_[k].offset * bytes_per_element();
    return v;
  }
  ZO_ASSIGN_OR_RETURN(v.lease, store_->Acquire(value_keys_[k], access).Get());
  v.data = v.lease.data();
  return v;
}

void ZeroPartition::ReadAhead(size_t t) {
  const size_t at = gathered_.size();
  gathered_.push_back(t);
  if (at < last_gathered_.size() && last_gathered_[at] == t) ReadFrom(at + 1);
}

void ZeroPartition::ReadFrom(size_t next) {
  const ZeroConfig& zc = core_.config.zero_optimization;
  // Half the cache at most: what is read ahead must not evict what is in use.
  const auto window = static_cast<uint64_t>(
      std::min(zc.stage3_prefetch_bucket_size, zc.offload_param.max_in_cpu / 2));
  if (window == 0) return;
  auto owned = [this](size_t t) {
    uint64_t n = 0;
    for (size_t k : info_[t].owned) n += owned_[k].n;
    return n;
  };
  ahead_ = std::max(ahead_, next);
  uint64_t pending = 0;
  for (size_t i = next; i < ahead_; ++i) pending += owned(last_gathered_[i]);
  while (ahead_ < last_gathered_.size() &&
         (ahead_ == next || pending + owned(last_gathered_[ahead_]) <= window)) {
    for (size_t k : info_[last_gathered_[ahead_]].owned) store_->Prefetch(value_keys_[k]);
    pending += owned(last_gathered_[ahead_]);
    ++ahead_;
  }
}

Status ZeroPartition::AllGatherParameters() {
  const uint64_t element = bytes_per_element();
  std::vector<std::byte> bucket;
  for (size_t b = 0; b < plan_.buckets().size(); ++b) {
    bucket.resize(plan_.buckets()[b].padded * element);
    ZO_RETURN_IF_ERROR(GatherBucket(b, bucket.data()));
    for (const BucketPlan::Span& s : plan_.buckets()[b].spans) {
      std::memcpy(static_cast<std::byte*>(core_.params[s.tensor].data) + s.first * element,
                  bucket.data() + s.offset * element, s.n * element);
    }
  }
  return Status::Ok();
}

// The exact norm: every rank's squares, added as integers (stage 1 reduce-scatters first).
Result<std::optional<GradNorm>> ZeroPartition::Norm(bool /*now*/) {
  if (core_.window_norm) return core_.window_norm;
  if (stage_ == 1) {
    for (size_t b = 0; b < plan_.buckets().size(); ++b) {
      ZO_RETURN_IF_ERROR(comm_
                             .ReduceScatterSum(full_grads_.as<float>() + full_offset_[b],
                                               grads_.as<float>() + bucket_offset_[b],
                                               plan_.slice(b))
                             .WithContext(StrCat("reduce-scatter of bucket ", b)));
    }
  }
  const int threads = core_.config.zoffload.cpu_adam_threads > 0
                          ? core_.config.zoffload.cpu_adam_threads
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
                         .WithContext("the gradient norm's parts"));
  ExactSquares total;
  for (const ExactSquares& part : all) total.Merge(part);
  core_.window_norm = GradNorm{std::sqrt(total.Sum()), total.finite()};
  return core_.window_norm;
}

std::vector<TensorGrads> ZeroPartition::Grads(const std::vector<AdamHyper>& hypers) {
  std::vector<TensorGrads> grads;
  for (const BucketPlan::Span& s : owned_) {
    grads.push_back({grads_.data() + s.offset * DTypeBytes(grad_dtype_), grad_dtype_, nullptr,
                     CopyFor(dtype_), &hypers[core_.params[s.tensor].group]});
  }
  return grads;
}

// (With the values on NVMe a span is overwritten without being read: after a failed step the
// values of the spans it was updating are undefined, as the run's state is.)
ParamSink* ZeroPartition::Sink() {
  sink_ = std::make_unique<PartitionSink>(
      [this](size_t k) { return OwnedValues(k, Access::kWrite); }, owned_, dtype_);
  return sink_.get();
}

Status ZeroPartition::Finish(bool skipped) {
  if (!skipped && stage_ < 3) ZO_RETURN_IF_ERROR(AllGatherParameters());
  if (store_ != nullptr) {  // the next step's first reads start now
    last_gathered_ = std::move(gathered_);
    gathered_.clear();
    ahead_ = 0;
    ReadFrom(0);
  }
  return Status::Ok();
}

uint64_t ZeroPartition::host_bytes() const {
  return grads_.size() + values_.size() + full_grads_.size();
}

Status ZeroPartition::GatherParameter(EngineParam& p, void* out) {
  const auto start = Clock::now();
  const Status gathered = GatherPieces(&p, out);
  // The time the caller was blocked (reads not yet in, the copies, the other ranks).
  if (Tracer* tracer = core_.rt->tracer()) {
    tracer->Record(kGatherTrack, p.name, start, Clock::now());
  }
  return gathered;
}

Status ZeroPartition::GatherPieces(EngineParam* p, void* out) {
  if (store_ != nullptr) ReadAhead(static_cast<size_t>(p - core_.params.data()));
  const uint64_t element = bytes_per_element();
  const auto me = static_cast<uint64_t>(comm_.rank());
  for (const auto& [b, s] : InfoOf(*p).places) {
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
      const auto span = std::find_if(InfoOf(*p).owned.begin(), InfoOf(*p).owned.end(),
                                     [&](size_t k) { return owned_[k].first == from; });
      if (span == InfoOf(*p).owned.end()) {
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

Status ZeroPartition::GatherMaster(const EngineParam& p, float* out) {
  std::vector<float> master;
  for (const auto& [b, s] : InfoOf(p).places) {
    ZO_RETURN_IF_ERROR(GatherBucketState(b, master, nullptr, nullptr)
                           .WithContext(StrCat("GatherMaster: '", p.name, "'")));
    std::memcpy(out + s.first, master.data() + s.offset, 4 * s.n);
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::zero
