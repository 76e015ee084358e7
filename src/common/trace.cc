#include "common/trace.h"

#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/errno_status.h"
#include "common/log.h"
#include "common/strings.h"

namespace zoffload::internal {

Tracer::Tracer(std::string path) : path_(std::move(path)) {}

Tracer::~Tracer() {
  if (Status s = Write(); !s.ok()) Log(LogLevel::kWarning, StrCat("trace: ", s.message()));
}

void Tracer::Record(const std::string& track, const std::string& name, Clock::time_point start,
                    Clock::time_point end, const std::string& detail) {
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  std::lock_guard lock(mu_);
  int id = 0;
  while (id < static_cast<int>(tracks_.size()) && tracks_[id] != track) ++id;
  if (id == static_cast<int>(tracks_.size())) tracks_.push_back(track);
  events_.push_back({id, name, detail, duration_cast<microseconds>(start - origin_).count(),
                     duration_cast<microseconds>(end - start).count()});
}

size_t Tracer::events() const {
  std::lock_guard lock(mu_);
  return events_.size();
}

Status Tracer::Write() {
  nlohmann::json list = nlohmann::json::array();
  {
    std::lock_guard lock(mu_);
    for (size_t t = 0; t < tracks_.size(); ++t) {
      list.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", t},
                      {"args", {{"name", tracks_[t]}}}});
    }
    for (const Event& e : events_) {
      nlohmann::json event = {{"ph", "X"},      {"name", e.name},   {"pid", 1},
                              {"tid", e.track}, {"ts", e.start_us}, {"dur", e.duration_us}};
      if (!e.detail.empty()) event["args"] = {{"detail", e.detail}};
      list.push_back(std::move(event));
    }
  }
  const std::string tmp = path_ + ".tmp";
  std::ofstream out(tmp);
  out << nlohmann::json{{"traceEvents", list}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  out.close();
  if (!out) return Status(StatusCode::kIoError, StrCat("trace: cannot write ", tmp), errno);
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    return StatusFromErrno(errno, StrCat("trace: rename ", tmp, " to ", path_));
  }
  return Status::Ok();
}

}  // namespace zoffload::internal
