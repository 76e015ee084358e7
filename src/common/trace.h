// Tracer: a Chrome trace-event JSON timeline (opens in Perfetto or chrome://tracing).
//
// Each event is a complete span ("ph": "X") on a named track (a thread row): "step" (the
// caller), "adam thread 3", "nvme slot 2", "nvme ring 0", ... Spans on one track must not
// overlap. Spans are kept in memory and written by Write (or on destruction), so recording
// costs a mutex and a vector append.
//
// Thread-safety: Span and Record may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal {

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  /// A tracer that writes to `path` (created or replaced) on Write or destruction.
  explicit Tracer(std::string path);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  /// Records a span [start, end) named `name` on `track`; `detail` shows as its argument.
  void Record(const std::string& track, const std::string& name, Clock::time_point start,
              Clock::time_point end, const std::string& detail = "");

  /// Writes the JSON file now (atomically: temp file and rename).
  Status Write();
  const std::string& path() const { return path_; }
  size_t events() const;

 private:
  struct Event {
    int track;
    std::string name, detail;
    int64_t start_us, duration_us;
  };
  std::string path_;
  Clock::time_point origin_ = Clock::now();
  mutable std::mutex mu_;
  std::vector<std::string> tracks_;
  std::vector<Event> events_;
};

}  // namespace zoffload::internal
