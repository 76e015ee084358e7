// Future<T>: zoffload's one completion type. NVMe requests, host <-> device copies and tensor
// leases all return one.
//
// 1. A future holds a Result<T> (a Status for Future<>) once its work has finished. Ready()
//    polls; Wait() blocks and returns the status; Get() blocks and takes the value (once).
// 2. Then(f) chains without flags: f receives the status (Future<>) or the result (it takes the
//    value) on the thread that finishes the work (an I/O thread, a CUDA callback thread), or at
//    once when it has finished. f returns a Status, a Result<U> or a Future<U>; Then's future
//    finishes with what f returns (a returned future is waited for, not nested). f must not
//    block; after device work it must not call CUDA either.
// 3. Device work (a copy on a CUDA stream) finishes on the device: OrderBefore(stream) makes a
//    CUDA stream wait for it with no host synchronization; other work is waited for on the host.
// 4. Copies of a future share its work. The last copy of host work (an NVMe request, a chain)
//    waits for it when destroyed, so memory the work uses is never freed while the work may
//    still touch it. Device work is not waited for: stream order keeps it safe, and whoever
//    owns its memory synchronizes the stream before freeing it.
//
// Thread-safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "zoffload/export.h"
#include "zoffload/status.h"

ZO_API_BEGIN
namespace zoffload {

template <typename T = void>
class Future;

namespace internal {

/// What a future holds once finished: a Status for Future<>, else a Result<T>.
template <typename T>
using FutureValue = std::conditional_t<std::is_void_v<T>, Status, Result<T>>;

template <typename T>
const Status& StatusOf(const FutureValue<T>& value) {
  if constexpr (std::is_void_v<T>) {
    return value;
  } else {
    return value.status();
  }
}

/// Work that finishes on a device (a CUDA event recorded after it). Implemented under src/gpu.
class DeviceSignal {
 public:
  virtual ~DeviceSignal() = default;
  virtual Result<bool> Done() = 0;
  virtual Status Wait() = 0;
  /// Work enqueued on `stream` (a cudaStream_t) from now on starts after the signalled work.
  virtual Status OrderBefore(void* stream) = 0;
  /// Calls `fn` once the work has finished, from a CUDA callback thread.
  virtual Status Notify(std::function<void()> fn) = 0;
};

Future<void> DeviceFuture(std::unique_ptr<DeviceSignal> signal);
template <typename T, typename Finish>
Future<T> DeferredFuture(Future<> after, Finish finish);

template <typename T>
struct FutureState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool taken = false;  // Get or Then took the value
  std::optional<FutureValue<T>> value;
  std::vector<std::function<void()>> then;  // run once done
  // Set at creation, then read-only: the work finishes on a device ...
  std::unique_ptr<DeviceSignal> device;
  bool notify_armed = false;  // (mu) device->Notify was asked to finish this state
  // ... or once `after` has and `finish` ran on a thread that waits for this one (deferred).
  std::function<bool()> after_ready;
  std::function<void()> finish;
  std::once_flag finish_once;
  std::atomic<int> handles{0};  // Future copies

  void Complete(FutureValue<T> v) {
    std::vector<std::function<void()>> run;
    {
      std::lock_guard lock(mu);
      if (done) return;
      value.emplace(std::move(v));
      done = true;
      run.swap(then);
    }
    cv.notify_all();
    for (auto& f : run) f();
  }

  bool Ready() {
    {
      std::lock_guard lock(mu);
      if (done) return true;
    }
    if (device != nullptr) {
      const Result<bool> d = device->Done();
      return !d.ok() || *d;
    }
    if (after_ready) return after_ready();
    return false;
  }

  // Blocks until finished (mu not held).
  void Await() {
    {
      std::lock_guard lock(mu);
      if (done) return;
    }
    if constexpr (std::is_void_v<T>) {
      if (device != nullptr) {
        const Status s = device->Wait();
        Complete(s);
        return;
      }
    }
    if (finish) std::call_once(finish_once, finish);
    std::unique_lock lock(mu);
    cv.wait(lock, [this] { return done; });
  }

  // Runs `f` once finished: now, or on the finishing thread. `self` is this state, kept alive
  // until a device callback has run.
  static void OnDone(const std::shared_ptr<FutureState>& self, std::function<void()> f) {
    FutureState& s = *self;
    std::unique_lock lock(s.mu);
    if (s.done) {
      lock.unlock();
      f();
      return;
    }
    s.then.push_back(std::move(f));
    if constexpr (std::is_void_v<T>) {
      if (s.device != nullptr && !s.notify_armed) {
        s.notify_armed = true;
        lock.unlock();
        // The callback thread may not call CUDA: errors of the work surface in Wait.
        const Status armed = s.device->Notify([self] { self->Complete(Status::Ok()); });
        if (!armed.ok()) s.Complete(armed);
      }
    }
  }
};

template <typename R>
struct ThenTraits;
template <>
struct ThenTraits<Status> {
  using type = void;
};
template <typename U>
struct ThenTraits<Result<U>> {
  using type = U;
};
template <typename U>
struct ThenTraits<Future<U>> {
  using type = U;
};

}  // namespace internal

/// A value of type T (a status for Future<>) that is being produced.
template <typename T>
class [[nodiscard]] Future {
 public:
  using Value = internal::FutureValue<T>;

  Future() = default;
  Future(const Future& other) : Future(other.state_) {}
  Future(Future&& other) noexcept : state_(std::move(other.state_)) {}
  Future& operator=(Future other) noexcept {
    Drop();
    state_ = std::move(other.state_);
    return *this;
  }
  ~Future() { Drop(); }

  /// A future that has already finished with `value`.
  static Future Ready(Value value) {
    auto state = std::make_shared<internal::FutureState<T>>();
    state->value.emplace(std::move(value));
    state->done = true;
    return Future(std::move(state));
  }

  /// False for a default-constructed future (no work).
  bool valid() const { return state_ != nullptr; }
  /// True when Wait would not block (also for no work).
  bool Ready() const { return state_ == nullptr || state_->Ready(); }

  /// Blocks until the work has finished; its status (OK for no work).
  Status Wait() const {
    if (state_ == nullptr) return Status::Ok();
    state_->Await();
    std::lock_guard lock(state_->mu);
    if (state_->taken) return Status::Ok();
    return internal::StatusOf<T>(*state_->value);
  }

  /// Blocks until the work has finished; its value, taken (a second Get fails).
  Value Get() {
    if (state_ == nullptr) return FailedPreconditionError("future: no work");
    state_->Await();
    std::lock_guard lock(state_->mu);
    if constexpr (std::is_void_v<T>) {
      return *state_->value;
    } else {
      if (state_->taken) return FailedPreconditionError("future: the value was taken");
      state_->taken = true;
      return std::move(*state_->value);
    }
  }

  /// Work enqueued on `stream` (a cudaStream_t) after this call starts after this future's
  /// work: on the device for device work, else by waiting here. The work's error, if any.
  Status OrderBefore(void* stream) const {
    if (state_ != nullptr && state_->device != nullptr) {
      {
        std::lock_guard lock(state_->mu);
        if (state_->done) return internal::StatusOf<T>(*state_->value);
      }
      return state_->device->OrderBefore(stream);
    }
    return Wait();
  }

  /// A future of what `f` returns when given this future's value (see the file comment).
  template <typename F>
  auto Then(F&& f) const {
    using R = std::invoke_result_t<F, Value>;
    using U = typename internal::ThenTraits<R>::type;
    if (state_ == nullptr) return Future<U>::Ready(FailedPreconditionError("future: no work"));
    auto next = std::make_shared<internal::FutureState<U>>();
    Future<U> result(next);
    // The callback holds a copy of this future, so dropping this one does not wait: the
    // returned future's last copy does (the chain finishes only after this work).
    internal::FutureState<T>::OnDone(
        state_, [from = *this, next, f = std::forward<F>(f)]() mutable {
          Value v = from.Get();
          if constexpr (std::is_same_v<R, Future<U>>) {
            Future<U> inner = f(std::move(v));
            if (!inner.valid()) {
              next->Complete(FailedPreconditionError("future: Then returned no work"));
              return;
            }
            // `inner` rides in its own callback: dropping the last copy here would wait for it.
            auto inner_state = inner.state_;
            internal::FutureState<U>::OnDone(
                inner_state, [inner, next]() mutable { next->Complete(inner.Get()); });
          } else {
            next->Complete(f(std::move(v)));
          }
        });
    return result;
  }

 private:
  template <typename>
  friend class Future;
  template <typename>
  friend class Promise;
  friend Future<void> internal::DeviceFuture(std::unique_ptr<internal::DeviceSignal>);
  template <typename U, typename Finish>
  friend Future<U> internal::DeferredFuture(Future<> after, Finish finish);

  explicit Future(std::shared_ptr<internal::FutureState<T>> state) : state_(std::move(state)) {
    if (state_ != nullptr) ++state_->handles;
  }
  void Drop() {
    if (state_ == nullptr) return;
    // The last copy waits for host work.
    if (--state_->handles == 0 && state_->device == nullptr) state_->Await();
    state_.reset();
  }

  std::shared_ptr<internal::FutureState<T>> state_;
};

/// Produces a future's value from code that is not the future's work itself.
template <typename T = void>
class Promise {
 public:
  Promise() : state_(std::make_shared<internal::FutureState<T>>()) {}
  /// The future this promise finishes (call once).
  Future<T> GetFuture() { return Future<T>(state_); }
  void Set(internal::FutureValue<T> value) { state_->Complete(std::move(value)); }

 private:
  std::shared_ptr<internal::FutureState<T>> state_;
};

namespace internal {

/// A future finished by device work (CopyEngine makes them).
inline Future<void> DeviceFuture(std::unique_ptr<internal::DeviceSignal> signal) {
  auto state = std::make_shared<internal::FutureState<void>>();
  state->device = std::move(signal);
  return Future<void>(std::move(state));
}

/// A future whose value `finish(status of after)` computes on the first thread that waits for it
/// (Wait, Get or the last copy's destructor), once `after` has finished. For finishing work
/// that may block or call CUDA, which Then's callback threads may not.
template <typename T, typename Finish>
Future<T> DeferredFuture(Future<> after, Finish finish) {
  auto state = std::make_shared<internal::FutureState<T>>();
  std::weak_ptr<internal::FutureState<T>> weak = state;
  state->after_ready = [after] { return after.Ready(); };
  state->finish = [weak, after, finish = std::move(finish)]() mutable {
    const Status s = after.Wait();
    if (auto self = weak.lock()) self->Complete(finish(s));
  };
  return Future<T>(std::move(state));
}

}  // namespace internal
}  // namespace zoffload
ZO_API_END
