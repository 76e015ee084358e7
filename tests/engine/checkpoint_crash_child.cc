// The crash test's child process (checkpoint_crash_test.cc): resumes training from the
// checkpoint in CKPT if there is one, its optimizer state half on NVMe in SWAP, then steps and
// saves after every step until MAX_STEPS, reporting each phase on descriptor FD so that the
// parent can kill it at a moment of its choosing.
// Usage: checkpoint_crash_child SWAP CKPT FD MAX_STEPS
// Exit codes: 0 done, 2 usage, 3 engine, 4 load, 5 step, 6 save, 7 report.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/checkpoint_crash.h"
#include "engine/engine_test_util.h"

namespace zoffload::internal::testing {
namespace {

bool Report(int fd, char phase, int step) {
  const CrashMessage m{phase, step};
  return ::write(fd, &m, sizeof(m)) == static_cast<ssize_t>(sizeof(m));
}

int Run(const std::string& swap, const std::string& ckpt, int fd, int max_steps) {
  Model model(kCrashSeed);
  auto engine = HostEngine(kCrashCase, swap, model);
  if (!engine) return 3;
  const Status loaded = engine->Load(ckpt);
  if (!loaded.ok() && loaded.code() != StatusCode::kNotFound) {
    std::fprintf(stderr, "load: %s\n", loaded.ToString().c_str());
    return 4;
  }
  for (int step = static_cast<int>(engine->steps()) + 1; step <= max_steps; ++step) {
    if (!Report(fd, 'T', step)) return 7;
    if (Status s = RunStep(*engine, step, 1); !s.ok()) {
      std::fprintf(stderr, "step %d: %s\n", step, s.ToString().c_str());
      return 5;
    }
    if (!Report(fd, 'S', step)) return 7;
    if (Status s = engine->Save(ckpt); !s.ok()) {
      std::fprintf(stderr, "save %d: %s\n", step, s.ToString().c_str());
      return 6;
    }
    if (!Report(fd, 'C', step)) return 7;
  }
  return 0;
}

}  // namespace
}  // namespace zoffload::internal::testing

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s SWAP CKPT FD MAX_STEPS\n", argv[0]);
    return 2;
  }
  return zoffload::internal::testing::Run(argv[1], argv[2], std::atoi(argv[3]), std::atoi(argv[4]));
}
