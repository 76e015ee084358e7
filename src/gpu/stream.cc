#include "gpu/stream.h"

#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/strings.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal {

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) {
    const cudaError_t err = cudaEventDestroy(event_);
    if (err != cudaSuccess)
      Log(LogLevel::kWarning, StrCat("cudaEventDestroy: ", cudaGetErrorString(err)));
  }
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    CudaEvent dying(std::move(*this));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

Result<CudaEvent> CudaEvent::Create(bool timing) {
  cudaEvent_t event = nullptr;
  // Blocking sync: a thread waiting here sleeps instead of spinning on a core (the driver's
  // default with one context), which CPU Adam needs while the copies go on.
  const unsigned flags =
      (timing ? cudaEventDefault : cudaEventDisableTiming) | cudaEventBlockingSync;
  ZO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, flags));
  return CudaEvent(event);
}

Status CudaEvent::Record(cudaStream_t stream) {
  ZO_CUDA_RETURN_IF_ERROR(cudaEventRecord(event_, stream));
  return Status::Ok();
}

Result<bool> CudaEvent::Done() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  ZO_CUDA_RETURN_IF_ERROR(err);
  return true;
}

Status CudaEvent::Synchronize() const {
  ZO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
  return Status::Ok();
}

Result<float> CudaEvent::ElapsedMs(const CudaEvent& start, const CudaEvent& end) {
  float ms = 0;
  ZO_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) {
    const cudaError_t err = cudaStreamDestroy(stream_);
    if (err != cudaSuccess) {
      Log(LogLevel::kWarning, StrCat("cudaStreamDestroy: ", cudaGetErrorString(err)));
    }
  }
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    CudaStream dying(std::move(*this));
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Result<CudaStream> CudaStream::Create(int priority) {
  cudaStream_t stream = nullptr;
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority));
  return CudaStream(stream);
}

Status CudaStream::Synchronize() const {
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status OrderAfter(cudaStream_t waiter, cudaStream_t producer, CudaEvent& event) {
  if (waiter == producer) return Status::Ok();
  ZO_RETURN_IF_ERROR(event.Record(producer));
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(waiter, event.get(), 0));
  return Status::Ok();
}

namespace {

// Events of device futures, reused. A future's state may be destroyed on a CUDA callback
// thread (its last copy sits in a Then callback), where cudaEventDestroy is not permitted:
// its event goes back here instead, and is recorded again by a later future.
class EventPool {
 public:
  static EventPool& Get() {
    static EventPool* pool = new EventPool();  // never destroyed: callbacks may outlive main
    return *pool;
  }
  Result<CudaEvent> Take() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        CudaEvent event = std::move(free_.back());
        free_.pop_back();
        return event;
      }
    }
    return CudaEvent::Create();
  }
  void Give(CudaEvent event) {
    std::lock_guard lock(mu_);
    free_.push_back(std::move(event));
  }

 private:
  std::mutex mu_;
  std::vector<CudaEvent> free_;
};

// A future's device side: an event recorded after the work, on the work's stream.
class EventSignal final : public DeviceSignal {
 public:
  EventSignal(CudaEvent event, cudaStream_t stream) : event_(std::move(event)), stream_(stream) {}
  ~EventSignal() override { EventPool::Get().Give(std::move(event_)); }
  Result<bool> Done() override { return event_.Done(); }
  Status Wait() override { return event_.Synchronize(); }
  Status OrderBefore(void* stream) override {
    ZO_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_.get(), 0));
    return Status::Ok();
  }
  Status Notify(std::function<void()> fn) override {
    // After everything on the stream so far, which includes the work.
    auto* call = new std::function<void()>(std::move(fn));
    const cudaError_t err = cudaLaunchHostFunc(
        stream_,
        [](void* data) {
          std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(data));
          (*f)();
        },
        call);
    if (err != cudaSuccess) {
      delete call;
      ZO_CUDA_RETURN_IF_ERROR(err);
    }
    return Status::Ok();
  }

 private:
  CudaEvent event_;
  cudaStream_t stream_;
};

}  // namespace

Future<> FutureAfterWork(cudaStream_t stream) {
  Result<CudaEvent> event = EventPool::Get().Take();
  if (!event.ok()) return Future<>::Ready(event.status());
  if (Status s = event->Record(stream); !s.ok()) return Future<>::Ready(s);
  return DeviceFuture(std::make_unique<EventSignal>(std::move(event).value(), stream));
}

}  // namespace zoffload::internal
