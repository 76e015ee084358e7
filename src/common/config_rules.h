// The config's cross-field rules, shared by the parser (config.cc) and ValidateConfig
// (config_rules.cc).
#pragma once

#include <string>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal {

/// Appends each problem of `config` beyond its keys' types ("json.path: what is wrong") to
/// `errors`, for `world_size` ranks; resolves the batch sizes and normalizes nvme_paths.
void CheckConfigRules(Config& config, int world_size, std::vector<std::string>* errors);
/// zoffload.overlap as a trainer runs it: "auto" is "backward" where the optimizer state is in
/// host memory and one process holds all of it (not `zero_partitioned`), else "none";
/// "backward" under ZeRO across ranks runs as "none" (the same result: its updates after
/// backward; updates during backward are the one-process core's only so far); any other
/// value as it is.
Overlap ChosenOverlap(const Config& config, bool zero_partitioned);
/// OK without errors; else INVALID_ARGUMENT listing them, one per line, prefixed by `source`.
Status ConfigErrors(const std::vector<std::string>& errors, const std::string& source);

}  // namespace zoffload::internal
