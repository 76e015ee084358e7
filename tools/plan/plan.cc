#include "plan/plan.h"

#include <sys/stat.h>

#include <algorithm>
#include <optional>

#include <nlohmann/json.hpp>

#include "common/json_file.h"
#include "common/strings.h"
#include "zoffload/cpu_adam.h"

namespace zoffload::internal::plan {
namespace {

// A model's config.json or a bench record file: a few MiB at most.
constexpr uint64_t kMaxJsonBytes = uint64_t{64} << 20;

// A record's field, or "" / 0 when it is absent or of another type.
std::string Text(const nlohmann::json& r, std::string_view key) {
  return FieldOf<std::string>(r, key).value_or("");
}
double Number(const nlohmann::json& r, std::string_view key) {
  return FieldOf<double>(r, key).value_or(0.0);
}

struct Named {
  const char* name;
  uint64_t vocab, hidden, intermediate, layers, heads, kv_heads;
};

constexpr Named kNamed[] = {
    {"llama-7b", 32000, 4096, 11008, 32, 32, 32},
    {"llama-13b", 32000, 5120, 13824, 40, 40, 40},
    {"llama-70b", 32000, 8192, 28672, 80, 64, 8},
    {"llama3-8b", 128256, 4096, 14336, 32, 32, 8},
};

// The state precision named `name` ("fp32", "bf16", "int8"), if any.
std::optional<StatePrecision> PrecisionNamed(const std::string& name) {
  for (StatePrecision p : {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
    if (name == ToString(p)) return p;
  }
  return std::nullopt;
}

// Stage 3 + offload_param in one process: the parameters kept for reuse at the turn from
// forward to backward, where the most are kept. zoffload.torch keeps a module's parameters
// between two uses with at most stage3_max_reuse_distance elements fetched in between, up to
// stage3_max_live_parameters at once: the output layer (its forward is followed at once by its
// backward) and the last layers, where layer j from the end waits for the output layer's two
// uses, about one layer of its own modules, and the j later layers' forward, recomputation and
// backward (forward and backward without checkpointing). Without a shape: the bound.
uint64_t KeptAtTurn(const ModelShape& m, const Workload& w) {
  const uint64_t layer = m.layer();
  if (layer == 0) return std::min(w.live_elements, m.params);
  const uint64_t output = m.vocab * m.hidden;
  const uint64_t uses = w.checkpointing ? 3 : 2;
  uint64_t kept = std::min(output, w.live_elements);
  for (uint64_t j = 0; j < m.layers; ++j) {
    if (2 * output + (uses * j + 1) * layer > w.reuse_distance || kept + layer > w.live_elements)
      break;
    kept += layer;
  }
  return kept;
}

}  // namespace

void CountLlama(ModelShape& m) {
  m.params = m.vocab * m.hidden * (m.tied ? 1 : 2) + m.layers * m.layer() + m.hidden;
  // q, k, v, o, gate, up, down and two norms per layer; the embeddings and the final norm.
  m.tensors = 9 * m.layers + (m.tied ? 2 : 3);
}

uint64_t ModelShape::largest_module() const {
  return std::max(vocab * hidden, hidden * intermediate);
}

uint64_t ModelShape::layer() const {
  const uint64_t kv = heads > 0 ? hidden * kv_heads / heads : hidden;
  return 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden;
}

ModelShape ModelOfParams(uint64_t params) {
  ModelShape m;
  m.name = StrCat(params, " parameters");
  m.params = params;
  return m;
}

Result<ModelShape> ModelNamed(const std::string& name) {
  for (const Named& n : kNamed) {
    if (name == n.name) {
      ModelShape m{n.name, n.vocab, n.hidden, n.intermediate, n.layers, n.heads, n.kv_heads};
      CountLlama(m);
      return m;
    }
  }
  struct stat st {};
  if (::stat(name.c_str(), &st) != 0) {
    const Named* nearest = &kNamed[0];
    for (const Named& n : kNamed) {
      if (EditDistance(name, n.name) < EditDistance(name, nearest->name)) nearest = &n;
    }
    std::string known;
    for (const Named& n : kNamed) known += StrCat(known.empty() ? "" : ", ", n.name);
    return NotFoundError(StrCat("model '", name, "' is neither a known shape (", known,
                                ") nor a readable config.json; did you mean '", nearest->name,
                                "'?"));
  }
  ZO_ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonFile(name, kMaxJsonBytes, "model config"));
  return ModelFromConfigJson(j, name);
}

Result<ModelShape> ModelFromConfigJson(const nlohmann::json& j, const std::string& name) {
  if (!j.is_object()) return InvalidArgumentError(StrCat(name, ": not a JSON object"));
  ModelShape m;
  m.name = name;
  // Each size positive and at most `most` (so that the counts below cannot wrap).
  auto size = [&](const char* key, uint64_t* out, uint64_t most = uint64_t{1} << 20) -> Status {
    const auto v = FieldOf<uint64_t>(j, key);
    if (!v || *v == 0 || *v > most) {
      return InvalidArgumentError(StrCat(name, ": '", key, "' missing or not an integer in [1, ",
                                         most,
                                         "] (a Llama-shaped HuggingFace config.json is expected)"));
    }
    *out = *v;
    return Status::Ok();
  };
  ZO_RETURN_IF_ERROR(size("vocab_size", &m.vocab, uint64_t{1} << 24));
  ZO_RETURN_IF_ERROR(size("hidden_size", &m.hidden));
  ZO_RETURN_IF_ERROR(size("intermediate_size", &m.intermediate));
  ZO_RETURN_IF_ERROR(size("num_hidden_layers", &m.layers, uint64_t{1} << 16));
  ZO_RETURN_IF_ERROR(size("num_attention_heads", &m.heads));
  m.kv_heads = FieldOf<uint64_t>(j, "num_key_value_heads").value_or(m.heads);
  if (m.kv_heads == 0 || m.kv_heads > m.heads) {
    return InvalidArgumentError(StrCat(name, ": num_key_value_heads ", m.kv_heads,
                                       " is not in [1, num_attention_heads (", m.heads, ")]"));
  }
  m.tied = FieldOf<bool>(j, "tie_word_embeddings").value_or(false);
  CountLlama(m);
  return m;
}

Estimate EstimateRun(const ModelShape& m, const Workload& w, const Candidate& c, const Speeds& s) {
  Estimate e;
  e.candidate = c;
  const uint64_t p = m.params;
  const auto n = static_cast<uint64_t>(std::max(1, w.world));
  const bool stage3 = w.stage == 3;
  // GPU, per rank.
  if (stage3) {
    const uint64_t window =
        n > 1 || w.offload_param ? 2 * std::min(m.largest_module() + w.prefetch_elements, p) : 0;
    const uint64_t kept = n == 1 && w.offload_param ? 2 * KeptAtTurn(m, w) : 0;
    e.gpu_params = (w.offload_param ? 0 : (2 * p + n - 1) / n) + window + kept;
  } else {
    e.gpu_params = 2 * p;
  }
  const bool host_grads = n > 1 || (stage3 && w.offload_param);
  e.gpu_ring = host_grads ? 0 : std::min<uint64_t>(2 * 2 * w.bucket_elements, 2 * p);
  if (m.hidden > 0) {
    const uint64_t bs = w.batch * w.sequence;
    const uint64_t logits = 10 * bs * m.vocab;
    const uint64_t inputs = m.layers * 2 * bs * m.hidden;  // checkpointed: each layer's input
    e.host_activations = w.checkpointing && w.cpu_checkpointing ? inputs : 0;
    e.gpu_activations = w.checkpointing ? inputs - e.host_activations +
                                              2 * bs * (4 * m.hidden + 3 * m.intermediate) + logits
                                        : m.layers * 34 * bs * m.hidden + logits;
  }
  e.gpu_bytes = e.gpu_params + e.gpu_ring + e.gpu_activations;
  // Host and NVMe.
  const uint64_t state = 4 * p + 2 * AdamMomentBytes(c.state, p);
  const auto on_nvme = static_cast<uint64_t>(static_cast<double>(state) * c.nvme_ratio);
  e.host_state = state - on_nvme;
  const uint64_t staged = w.accumulation > 1 && c.overlap == Overlap::kDelayed ? 2 * p : 0;
  const bool param_nvme = stage3 && w.offload_param && w.param_nvme;
  // offload_param nvme: ZeRO's partition gradients, fp32 sums, or at one rank with one
  // micro-batch each bf16 gradient as given.
  const uint64_t zero_grads = n == 1 && w.accumulation == 1 ? 2 * p : 4 * p;
  e.host_grads = param_nvme ? zero_grads : (w.accumulation > 1 ? 6 * p : 2 * p) + staged;
  e.host_params =
      !stage3 || !w.offload_param ? 0 : 2 * (param_nvme ? std::min(w.max_in_cpu, p) : p);
  e.host_pinned = 2 * p + staged + e.host_params + n * e.host_activations;
  e.host_process = n * kProcessBytes;
  e.host_bytes =
      e.host_state + e.host_grads + e.host_params + n * e.host_activations + e.host_process;
  e.nvme_bytes = 2 * on_nvme + (param_nvme ? 2 * p : 0);
  // Step time.
  const double rate = s.adam(c.state);
  if (rate > 0) e.adam_seconds = static_cast<double>(p) / (rate * 1e9);
  const auto moved = static_cast<double>(on_nvme);
  if (on_nvme > 0 && s.nvme_mixed_gbps > 0) {
    e.io_seconds = 2 * moved / (s.nvme_mixed_gbps * 1e9);
  } else if (on_nvme > 0 && s.nvme_read_gbps > 0 && s.nvme_write_gbps > 0) {
    e.io_seconds = moved / (s.nvme_read_gbps * 1e9) + moved / (s.nvme_write_gbps * 1e9);
  }
  const bool io_known = on_nvme == 0 || e.io_seconds > 0;
  // The measured forward+backward, scaled to this model (the same tokens per step).
  const double f = s.fwd_bwd_params > 0 && p > 0 ? s.fwd_bwd_seconds * static_cast<double>(p) /
                                                       static_cast<double>(s.fwd_bwd_params)
                                                 : s.fwd_bwd_seconds;
  const double h = kHandOverSeconds * static_cast<double>(m.tensors);
  if (n > 1) {
    e.bound = "no step time: ZeRO across ranks is not measured yet";
  } else if (stage3 && (!w.offload_param || c.overlap != Overlap::kNone || w.accumulation > 1)) {
    e.bound =
        "no step time: of stage 3, only offload_param with overlap none and accumulation 1 "
        "is measured";
  } else if (stage3) {
    const bool values_known = !param_nvme || (s.nvme_read_gbps > 0 && s.nvme_write_gbps > 0);
    if (rate > 0 && f > 0 && s.pcie_h2d_gbps > 0 && io_known && values_known) {
      const double passes = w.checkpointing ? 3 : 2;
      const double copies = (passes + 1) * 2.0 * static_cast<double>(p) / (s.pcie_h2d_gbps * 1e9);
      // State on NVMe: the update streams it, its I/O under CPU Adam (as in the step profile).
      double update_io = e.io_seconds;
      double compute = std::max(f, copies);
      double reads = 0;
      if (param_nvme) {
        // What the host cache cannot hold (2 bytes a value) is read in the forward and again
        // in the backward (its recomputation keeps them), ahead of use under the compute, and
        // written back by the update, beside the state's I/O.
        const double out = 2.0 * static_cast<double>(p - std::min(w.max_in_cpu, p));
        reads = 2 * out / (s.nvme_read_gbps * 1e9);
        update_io += out / (s.nvme_write_gbps * 1e9);
        compute = std::max(compute, reads);
      }
      const double update = std::max(e.adam_seconds, update_io);
      e.io_seconds = update_io + reads;
      e.pcie_seconds = copies;
      e.step_seconds = compute + update + h;
      const bool state_bound = update_io > e.adam_seconds;
      e.bound = reads > std::max(f, copies)     ? "NVMe (parameters read ahead)"
                : copies >= std::max(f, update) ? "PCIe (parameters fetched per use)"
                : f >= update                   ? "GPU (the parameter copies under it)"
                : !state_bound                  ? "CPU Adam"
                : param_nvme                    ? "NVMe (parameters and state)"
                                                : "NVMe (state)";
      if (param_nvme) e.bound += "; this combination is not yet checked against a run";
    } else if (rate > 0 && f > 0 && s.pcie_h2d_gbps > 0 && io_known) {
      e.bound =
          "no step time: NVMe's read and write speeds are unknown (--measure with --nvme, "
          "or a bench JSON)";
    } else if (rate > 0 && f > 0 && s.pcie_h2d_gbps > 0) {
      e.bound = "no step time: NVMe's speed is unknown (--measure with --nvme, or a bench JSON)";
    } else if (rate > 0 && f > 0) {
      e.bound =
          "no step time: the PCIe speed is unknown (a zoffload-bench pcie JSON, or --measure)";
    } else {
      e.bound =
          "no step time: CPU Adam's rate or the GPU's forward+backward time is unknown "
          "(--bench-json)";
    }
  } else if (w.accumulation > 1 && c.overlap != Overlap::kDelayed) {
    e.bound = "no step time: accumulation > 1 is measured with overlap delayed only";
  } else if (rate > 0 && f > 0 && io_known) {
    const double slow = c.overlap == Overlap::kNone       ? 1.0
                        : c.overlap == Overlap::kBackward ? kBackwardSlowdown
                                                          : kDelayedSlowdown;
    const double update = std::max(e.adam_seconds * slow, e.io_seconds);
    const std::string cpu = update > e.io_seconds || e.io_seconds == 0 ? "CPU Adam" : "NVMe";
    // PCIe: the bf16 gradients down and the bf16 parameters up, 2P bytes each way (0: unknown).
    // Accumulation N (overlap delayed only): N micro-batches of forward+backward and N
    // gradients down per update.
    const auto micro = static_cast<double>(w.accumulation);
    const double bytes = 2.0 * static_cast<double>(p);
    auto over = [&](double gbps) { return gbps > 0 ? bytes / (gbps * 1e9) : 0.0; };
    const double down = over(s.pcie_d2h_gbps), up = over(s.pcie_h2d_gbps);
    const double both =
        micro *
        over(s.pcie_both_gbps > 0 ? s.pcie_both_gbps : std::min(s.pcie_d2h_gbps, s.pcie_h2d_gbps));
    const double backward = f * s.backward_share + h;
    switch (c.overlap) {
      case Overlap::kNone:  // down under backward, then up under the update
        e.pcie_seconds = down + up;
        e.step_seconds =
            f * (1 - s.backward_share) + std::max(backward, down) + std::max(update, up);
        e.bound = StrCat(backward >= down ? "GPU" : "PCIe (gradients down)", " and ",
                         update >= up ? cpu : "PCIe (parameters up)", " in turn");
        break;
      case Overlap::kAuto:      // a candidate's is resolved (ChosenOverlap): never here
      case Overlap::kBackward:  // both ways at once under backward
        e.pcie_seconds = both;
        e.step_seconds = f * (1 - s.backward_share) + std::max({backward, update, both});
        e.bound = both > std::max(backward, update) ? "PCIe (both ways at once)"
                  : backward >= update              ? "GPU (backward)"
                                                    : cpu;
        break;
      case Overlap::kDelayed:  // both ways at once under the next step
        e.pcie_seconds = both;
        e.step_seconds = std::max({micro * f + h, update, both});
        e.bound = both > std::max(micro * f + h, update) ? "PCIe (both ways at once)"
                  : micro * f + h >= update              ? "GPU (forward+backward)"
                                                         : cpu;
        break;
    }
  }
  return e;
}

void Speeds::SetPcie(std::string_view test, double gbps) {
  if (test == "h2d") pcie_h2d_gbps = gbps;
  if (test == "d2h") pcie_d2h_gbps = gbps;
  if (test == "both_h2d" || test == "both_d2h") {  // the slower way while both run
    pcie_both_gbps = pcie_both_gbps > 0 ? std::min(pcie_both_gbps, gbps) : gbps;
  }
}

Result<Speeds> SpeedsFromJson(const std::vector<std::string>& files) {
  Speeds s;
  for (const std::string& file : files) {
    ZO_ASSIGN_OR_RETURN(const nlohmann::json j,
                        ReadJsonFile(file, kMaxJsonBytes, "--bench-json file"));
    ZO_RETURN_IF_ERROR(AddSpeeds(j, file, &s));
  }
  return s;
}

Status AddSpeeds(const nlohmann::json& j, const std::string& file, Speeds* speeds) {
  Speeds& s = *speeds;
  const nlohmann::json* records = &j;
  if (j.is_object() && j.contains("results")) records = &j["results"];  // bench/finetune_7b.py
  if (!records->is_array()) {
    return InvalidArgumentError(
        StrCat("--bench-json ", file, ": not a list of zoffload-bench records"));
  }
  for (const auto& r : *records) {
    if (!r.is_object()) continue;
    const std::string profile = Text(r, "profile");
    const auto state = PrecisionNamed(Text(r, "state"));
    if (profile == "adam" && Text(r, "rule") == "adam" && state &&
        Text(r, "param_copy") == "bf16") {
      s.adam(*state) = std::max(s.adam(*state), Number(r, "Gparams_per_s"));
    } else if (profile == "engine" && state && Number(r, "adam_alone_gparams") > 0) {
      s.adam(*state) = Number(r, "adam_alone_gparams");
      if (Number(r, "grad_alone_seconds") > 0) {  // its backward stand-in, no forward
        s.fwd_bwd_seconds = Number(r, "grad_alone_seconds");
        s.fwd_bwd_params = FieldOf<uint64_t>(r, "params").value_or(0);
        s.backward_share = 1;
      }
    } else if (profile == "step" && Text(r, "state_on") == "nvme") {
      s.nvme_read_gbps = Number(r, "read_GBps");
      s.nvme_write_gbps = Number(r, "write_GBps");
      s.nvme_mixed_gbps = Number(r, "mixed_GBps");
    } else if (profile == "pcie") {
      s.SetPcie(Text(r, "test"), Number(r, "GBps"));
    } else if (profile == "nvme") {
      const double gbps = Number(r, "GBps");
      double& best = Text(r, "op") == "read" ? s.nvme_read_gbps : s.nvme_write_gbps;
      best = std::max(best, gbps);
    } else if (Text(r, "system") == "fwd_bwd") {
      s.fwd_bwd_seconds = Number(r, "seconds_per_step");
      s.fwd_bwd_params = FieldOf<uint64_t>(r, "params").value_or(0);
      s.backward_share = kBackwardShare;
    } else if (Text(r, "system").starts_with("zoffload:none:") && r.contains("steps")) {
      // CPU Adam inside the exact step (it runs alone there): the median past the warm-up.
      std::vector<double> adam;
      if (!r["steps"].is_array()) continue;
      for (const auto& step : r["steps"]) {
        if (FieldOf<int64_t>(step, "step").value_or(0) > 2)
          adam.push_back(Number(step, "adam_seconds"));
      }
      if (adam.empty()) continue;
      std::sort(adam.begin(), adam.end());
      const double seconds = adam[adam.size() / 2];
      // "zoffload:none:STATE[:...]"
      const std::string rest = Text(r, "system").substr(14);
      const auto system_state = PrecisionNamed(rest.substr(0, rest.find(':')));
      if (system_state && seconds > 0) {
        s.adam(*system_state) = Number(r, "params") / seconds / 1e9;
      }
    }
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::plan
