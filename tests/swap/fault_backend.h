// A fault-injecting wrapper at the IoBackend seam: it fails, truncates or delays chosen
// pieces of a real backend. A test double for faults only; the I/O itself stays real.
#pragma once

#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "swap/io_backend.h"

namespace zoffload::internal::testing {

struct FaultRule {
  enum class Action { kFail, kTruncate, kDelay };
  IoOp op = IoOp::kRead;
  Action action = Action::kFail;
  int skip = 0;                ///< let this many matching pieces through first
  int times = 1;               ///< then apply to this many (-1: all)
  int err = EIO;               ///< kFail: the errno the piece completes with
  uint32_t truncate_to = 512;  ///< kTruncate: bytes the kernel is asked for (a short transfer)
  int delay_ms = 0;            ///< kDelay: added before the completions are returned
};

/// Shared by every I/O thread's wrapper; counts matches across them.
class FaultPlan {
 public:
  explicit FaultPlan(std::vector<FaultRule> rules)
      : rules_(std::move(rules)), seen_(rules_.size()) {}

  /// The rule that applies to this piece, if any.
  const FaultRule* Match(IoOp op) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < rules_.size(); ++i) {
      const FaultRule& r = rules_[i];
      if (r.op != op) continue;
      const int n = seen_[i]++;
      if (n >= r.skip && (r.times < 0 || n < r.skip + r.times)) {
        ++applied_;
        return &r;
      }
    }
    return nullptr;
  }
  int applied() const {
    std::lock_guard<std::mutex> lock(mu_);
    return applied_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<FaultRule> rules_;
  std::vector<int> seen_;
  int applied_ = 0;
};

class FaultInjectingBackend final : public IoBackend {
 public:
  FaultInjectingBackend(std::unique_ptr<IoBackend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  Status Prepare(const IoPieceDesc& piece, uint64_t tag) override {
    const FaultRule* rule = plan_->Match(piece.op);
    if (rule == nullptr) return inner_->Prepare(piece, tag);
    switch (rule->action) {
      case FaultRule::Action::kFail:
        failed_.push_back({tag, -rule->err});
        return Status::Ok();
      case FaultRule::Action::kTruncate: {
        IoPieceDesc shorter = piece;
        shorter.len = std::min(piece.len, rule->truncate_to);
        return inner_->Prepare(shorter, tag);
      }
      case FaultRule::Action::kDelay:
        delay_ms_ += rule->delay_ms;
        return inner_->Prepare(piece, tag);
    }
    return Status::Ok();
  }
  Status Submit() override { return inner_->Submit(); }
  Status Reap(unsigned min_complete, std::vector<IoCompletion>* out) override {
    if (delay_ms_ > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
      delay_ms_ = 0;
    }
    const auto synthesized = static_cast<unsigned>(failed_.size());
    out->insert(out->end(), failed_.begin(), failed_.end());
    failed_.clear();
    return inner_->Reap(min_complete > synthesized ? min_complete - synthesized : 0, out);
  }
  Status RegisterFile(int slot, int fd) override { return inner_->RegisterFile(slot, fd); }
  Status RegisterBuffer(int slot, std::byte* data, size_t len) override {
    return inner_->RegisterBuffer(slot, data, len);
  }
  bool SupportsRegistration() const override { return inner_->SupportsRegistration(); }
  unsigned capacity() const override { return inner_->capacity(); }
  std::string_view name() const override { return inner_->name(); }

 private:
  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::vector<IoCompletion> failed_;
  int delay_ms_ = 0;
};

/// An IoEngineOptions::wrap_backend that injects `plan`'s faults.
inline auto InjectFaults(std::shared_ptr<FaultPlan> plan) {
  return [plan](std::unique_ptr<IoBackend> inner) -> std::unique_ptr<IoBackend> {
    return std::make_unique<FaultInjectingBackend>(std::move(inner), plan);
  };
}

}  // namespace zoffload::internal::testing
