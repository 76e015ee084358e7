// libFuzzer: any bytes as zoffload-plan's inputs, a model's config.json (--model FILE) and a
// bench record file (--bench-json), then an estimate of the model read. Each must give a
// result or a Status, never crash or throw; a model read has sizes whose counts do not wrap.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/json_file.h"
#include "plan/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace plan = zoffload::internal::plan;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto j = zoffload::internal::ParseJson(text, "fuzz.json");
  if (!j.ok()) return 0;
  plan::Speeds speeds;
  (void)plan::AddSpeeds(*j, "fuzz.json", &speeds);
  auto model = plan::ModelFromConfigJson(*j, "fuzz.json");
  if (!model.ok()) return 0;
  if (model->params == 0 || model->params > (uint64_t{1} << 56)) std::abort();
  (void)plan::EstimateRun(*model, plan::Workload{}, plan::Candidate{}, speeds);
  return 0;
}
