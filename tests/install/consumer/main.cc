// A program outside the project, built against the installed package.
#include <cstdio>

#include "zoffload/config.h"
#include "zoffload/status.h"

int main() {
  auto config = zoffload::ParseConfig(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu", "pin_memory": true}}})");
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  auto bad = zoffload::ParseConfig(R"({"zero_optimization": {"stgae": 2}})");
  if (bad.ok() || bad.status().message().find("did you mean 'stage'") == std::string::npos) {
    std::fprintf(stderr, "expected an unknown-key error, got: %s\n",
                 bad.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "consumer: stage %d, offload_optimizer.device %s\n", config->zero_optimization.stage,
      std::string(zoffload::ToString(config->zero_optimization.offload_optimizer.device)).c_str());
  return 0;
}
