// The ZeRO partition's checkpoints (zero_partition.h): every rank gathers the state bucket by
// bucket and rank 0 writes it in the engine's format; loading, every rank checks everything and
// the ranks agree before any changes.
#include <algorithm>
#include <cstring>

#include "common/strings.h"
#include "engine/checkpoint.h"
#include "engine/param_math.h"
#include "engine/zero_partition.h"

namespace zoffload::internal::zero {

Status ZeroPartition::Agree(const Status& outcome, std::string_view what) {
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

Status ZeroPartition::GatherBucketState(size_t b, std::vector<float>& master,
                                        std::vector<std::byte>* m, std::vector<std::byte>* v) {
  const StatePrecision precision = core_.config.zoffload.optimizer_state;
  const uint64_t moment = m != nullptr ? AdamMomentBytes(precision, 1) : 0;  // per element
  const uint64_t slice = plan_.slice(b), padded = plan_.buckets()[b].padded;
  std::vector<float> my_master(slice, 0.0f), span_master;
  std::vector<std::byte> my_m(slice * moment), my_v(slice * moment), span_m, span_v;
  for (size_t k : owned_in_bucket_[b]) {
    const BucketPlan::Span& s = owned_[k];
    span_master.resize(s.n);
    span_m.resize(AdamMomentBytes(precision, s.n));
    span_v.resize(span_m.size());
    ZO_RETURN_IF_ERROR(core_.state->Read(k, span_master.data(), span_m.data(), span_v.data()));
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

Status ZeroPartition::Save(const std::string& dir) {
  const StatePrecision precision = core_.config.zoffload.optimizer_state;
  Status ready = core_.BetweenSteps("Save");
  if (ready.ok() && precision == StatePrecision::kInt8) {
    ready = UnimplementedError(
        "Save: a ZeRO run with int8 optimizer state cannot be saved yet (the int8 moments' "
        "blocks follow each rank's partition); use zoffload.optimizer_state fp32 or bf16");
  }
  ZO_RETURN_IF_ERROR(Agree(ready, "Save"));
  const uint64_t moment = AdamMomentBytes(precision, 1);  // per element: fp32 4, bf16 2
  CheckpointMeta meta =
      CheckpointHeader(core_.steps, core_.scaler.state(), core_.config, core_.groups);
  // Entries in the plan's order, so that each bucket is gathered once.
  std::vector<size_t> order;
  for (const BucketPlan::Bucket& bucket : plan_.buckets()) {
    for (const BucketPlan::Span& s : bucket.spans) {
      if (s.first == 0) order.push_back(s.tensor);
    }
  }
  for (size_t t : order) {
    const EngineParam& p = core_.params[t];
    meta.entries.push_back(EntryFor(p.name, p.n, p.shape, p.dtype, p.group, precision));
  }
  // Every rank gathers every entry in the same order; rank 0 writes them.
  size_t gathered = 0;
  size_t cached = plan_.buckets().size();  // the bucket now in `master`, `m`, `v`
  std::vector<float> master;
  std::vector<std::byte> m, v;
  auto gather = [&](size_t i, float* out_master, std::byte* out_m, std::byte* out_v) -> Status {
    gathered = i + 1;
    for (const auto& [b, s] : info_[order[i]].places) {
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

Status ZeroPartition::Load(const std::string& dir) {
  const StatePrecision precision = core_.config.zoffload.optimizer_state;
  std::string from;
  CheckpointMeta meta;
  std::vector<const CheckpointEntry*> saved;
  // Every rank reads and checks everything before any rank changes anything.
  Status checked = core_.BetweenSteps("Load");
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
    for (const EngineParam& p : core_.params) registered.push_back({p.name, p.n, p.dtype});
    auto matched = MatchCheckpoint(meta, from, registered, precision, core_.groups.size());
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
  for (size_t t = 0; t < core_.params.size(); ++t) {
    const EngineParam& p = core_.params[t];
    const CheckpointEntry& c = *saved[t];
    ZO_RETURN_IF_ERROR(read(c));
    const std::byte* m = buffer.data() + 4 * c.elements;
    const std::byte* v = m + c.moment_bytes;
    for (size_t k : InfoOf(p).owned) {
      const BucketPlan::Span& s = owned_[k];
      ZO_RETURN_IF_ERROR(
          core_.state->Write(k, master + s.first, m + s.first * moment, v + s.first * moment)
              .WithContext(StrCat("Load '", p.name, "'")));
      ZO_ASSIGN_OR_RETURN(SpanValues mine, OwnedValues(k, Access::kWrite));
      CastFromFloat(master + s.first, mine.data, dtype_, s.n);
    }
    if (stage_ < 3) CastFromFloat(master, p.data, dtype_, p.n);
  }
  core_.groups = meta.groups;
  core_.steps = meta.steps;
  core_.scaler.Restore({meta.loss_scale, meta.overflows, meta.good_steps});
  return Status::Ok();
}

}  // namespace zoffload::internal::zero
