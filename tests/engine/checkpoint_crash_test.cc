// Kills a training process (checkpoint_crash_child) at random moments of its steps and of its
// saves, over and over, each time resuming from what it left: the checkpoint must always load,
// and hold exactly the last committed step or the one being saved, bit for bit.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine/checkpoint_crash.h"
#include "engine/engine_test_util.h"
#include "test_util.h"

namespace zoffload::internal::testing {
namespace {

using Clock = std::chrono::steady_clock;

// A running child and the read end of its report pipe.
struct Child {
  pid_t pid = -1;
  int reports = -1;
};

Child Spawn(const std::string& swap, const std::string& ckpt, int max_steps) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec: the parent has threads.
    const int fd = ::dup(fds[1]);  // without O_CLOEXEC: the child keeps it
    char fd_text[16], steps_text[16];
    std::snprintf(fd_text, sizeof(fd_text), "%d", fd);
    std::snprintf(steps_text, sizeof(steps_text), "%d", max_steps);
    ::execl(ZO_CRASH_CHILD_BIN, ZO_CRASH_CHILD_BIN, swap.c_str(), ckpt.c_str(), fd_text, steps_text,
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  return {pid, fds[0]};
}

// Reads the child's next report; false at the end of the pipe (the child is gone).
bool NextReport(const Child& child, CrashMessage* m) {
  return ::read(child.reports, m, sizeof(*m)) == static_cast<ssize_t>(sizeof(*m));
}

// What the reports said, for the check after a kill.
struct Progress {
  int committed = 0;  // the last step whose save completed
  int saving = 0;     // the last step whose save began
  char last_phase = 0;
  void Note(const CrashMessage& m) {
    last_phase = m.phase;
    if (m.phase == 'S') saving = m.step;
    if (m.phase == 'C') committed = m.step;
  }
};

int WaitFor(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(EngineCheckpoint, KilledAtRandomMomentsTheCheckpointIsThePreviousOrTheNewOneBitExactly) {
  TempDir swap, verify_swap, reference_swap, root;
  const std::string ckpt = root.path() + "/ckpt";
  const Case host{1, false, kCrashCase.state, "host"};
  Model reference_model(kCrashSeed);
  auto reference = HostEngine(host, reference_swap.path(), reference_model);
  ASSERT_TRUE(reference);
  int reference_steps = 0;

  // An unharmed run of three steps times each phase.
  std::vector<double> step_us, save_us;
  {
    Child child = Spawn(swap.path(), ckpt, 3);
    ASSERT_GT(child.pid, 0);
    CrashMessage m;
    Clock::time_point began = Clock::now();
    while (NextReport(child, &m)) {
      const auto now = Clock::now();
      const double us = std::chrono::duration<double, std::micro>(now - began).count();
      if (m.phase == 'S') step_us.push_back(us);
      if (m.phase == 'C') save_us.push_back(us);
      began = now;
    }
    ::close(child.reports);
    const int status = WaitFor(child.pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    ASSERT_EQ(save_us.size(), 3u);
  }
  const double step_time = *std::min_element(step_us.begin(), step_us.end());
  const double save_time = *std::min_element(save_us.begin(), save_us.end());

  std::mt19937 rng(2026);
  int committed = 3;
  int in_step = 0, in_save = 0, took_new = 0, from_prev = 0;
  // Kills until 25 have landed inside a step and 25 inside a save (a kill late in its window
  // finds the next phase begun; more so on a loaded machine), at most 200.
  constexpr int kWant = 25, kMaxCycles = 200;
  int cycle = 0;
  for (; cycle < kMaxCycles && (in_step < kWant || in_save < kWant); ++cycle) {
    const char target = in_step < kWant && (cycle % 2 == 0 || in_save >= kWant) ? 'T' : 'S';
    SCOPED_TRACE(StrCat("cycle ", cycle, ", killed in ", target == 'T' ? "a step" : "a save"));
    Child child = Spawn(swap.path(), ckpt, 1 << 20);
    ASSERT_GT(child.pid, 0);
    // Past 0-2 such phases, a random moment inside the next one.
    const int skip = static_cast<int>(rng() % 3);
    Progress progress;
    CrashMessage m;
    for (int seen = 0; seen <= skip && NextReport(child, &m);) {
      progress.Note(m);
      if (m.phase == target) ++seen;
    }
    ASSERT_EQ(progress.last_phase, target) << "the child ended early";
    const double window = target == 'T' ? step_time : save_time;
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(
        std::uniform_real_distribution<double>(0, window)(rng)));
    ::kill(child.pid, SIGKILL);
    const int status = WaitFor(child.pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
    while (NextReport(child, &m)) progress.Note(m);
    ::close(child.reports);
    if (progress.last_phase == target) ++(target == 'T' ? in_step : in_save);
    if (progress.committed != 0) committed = progress.committed;

    // What it left loads, into an engine over other values, and is the last committed step
    // or the one being saved.
    Model model(kCrashSeed + 1);
    auto engine = HostEngine(host, verify_swap.path(), model);
    ASSERT_TRUE(engine);
    from_prev += std::filesystem::exists(ckpt + "/manifest.json") ? 0 : 1;
    const Status loaded = engine->Load(ckpt);
    ASSERT_TRUE(loaded.ok()) << loaded;
    const int steps = static_cast<int>(engine->steps());
    ASSERT_TRUE(steps == committed || (steps == committed + 1 && progress.saving == steps))
        << "loaded step " << steps << ", last committed " << committed << ", saving "
        << progress.saving;
    took_new += steps == committed + 1 ? 1 : 0;
    ASSERT_GE(steps, reference_steps);
    RunSteps(*reference, reference_steps + 1, steps, 1);
    reference_steps = steps;
    ASSERT_EQ(AllState(*engine, kCrashCase.state), AllState(*reference, kCrashCase.state));
    committed = steps;
    // A killed save's temporary directory is removed by the next save: one at most remains.
    int temporaries = 0;
    for (const auto& entry : std::filesystem::directory_iterator(root.path())) {
      temporaries += entry.path().filename().string().starts_with("ckpt.tmp-") ? 1 : 0;
    }
    EXPECT_LE(temporaries, 1);
  }
  EXPECT_GE(in_step, kWant) << "in " << cycle << " kills";
  EXPECT_GE(in_save, kWant) << "in " << cycle << " kills";
  std::printf(
      "killed %d times: %d inside a step and %d inside a save; %d loads found the save in "
      "progress complete, %d found only DIR.prev; reached step %d\n",
      cycle, in_step, in_save, took_new, from_prev, reference_steps);
}

}  // namespace
}  // namespace zoffload::internal::testing
