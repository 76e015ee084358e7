// A build without CUDA has no device GradientPath (Runtime::has_gpu is false there, so the core
// never asks for one).
#include "engine/gradient_path.h"

namespace zoffload::internal {

Result<std::unique_ptr<GradientPath>> MakeDevicePath(EngineCore& /*core*/) {
  return UnimplementedError("engine: this build of zoffload has no CUDA (no device path)");
}

}  // namespace zoffload::internal
