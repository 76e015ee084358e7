// zoffload-report's verdicts: what zoffload needs, each ready / limited / missing with the one
// action that fixes it, derived from the report's detail (so that they can be checked on
// recorded reports of machines unlike this one).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace zoffload::internal {

struct Verdict {
  std::string component;  ///< "GPU", "NVMe offload at /data", ...
  std::string status;     ///< "ready", "limited" or "missing"
  std::string detail;     ///< what was found
  std::string action;     ///< what fixes it (empty when ready)
};

/// The verdicts for a report as zoffload-report --json writes it (without "verdicts").
std::vector<Verdict> Verdicts(const nlohmann::ordered_json& report);

/// "ready    GPU: 1 x NVIDIA H200 ... — action", aligned; coloured when `color`.
std::string FormatVerdict(const Verdict& v, bool color);

nlohmann::ordered_json ToJson(const std::vector<Verdict>& verdicts);

}  // namespace zoffload::internal
