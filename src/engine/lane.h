// Lane: a thread that handles items one at a time, in the order they were pushed (through a
// lock-free queue: pushing never blocks). Stop lets it finish what is queued.
#pragma once

#include <atomic>
#include <cstdint>
#include <semaphore>
#include <thread>

#include <boost/lockfree/queue.hpp>

namespace zoffload::internal {

template <typename T>
class Lane {
 public:
  ~Lane() { Stop(); }
  template <typename F>
  void Start(F handle) {
    thread_ = std::thread([this, handle = std::move(handle)] {
      while (true) {
        queued_.acquire();
        T item;
        if (!queue_.pop(item)) {
          if (stopping_) return;
          continue;
        }
        handle(item);
        handled_.fetch_add(1);
        handled_.notify_all();
      }
    });
  }
  bool running() const { return thread_.joinable(); }
  void Push(const T& item) {
    pushed_.fetch_add(1);
    queue_.push(item);
    queued_.release();
  }
  // Blocks until every item pushed so far has been handled.
  void AwaitAll() {
    const uint64_t count = pushed_.load();
    for (uint64_t done = handled_.load(); done < count; done = handled_.load()) {
      handled_.wait(done);
    }
  }
  void Stop() {
    if (!thread_.joinable()) return;
    stopping_ = true;
    queued_.release();
    thread_.join();
  }

 private:
  boost::lockfree::queue<T> queue_{64};
  std::counting_semaphore<> queued_{0};
  std::atomic<uint64_t> pushed_{0}, handled_{0};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace zoffload::internal
