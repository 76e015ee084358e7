#include "zoffload/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <semaphore>
#include <thread>

#include <boost/lockfree/queue.hpp>

#include "build_info.h"
#include "common/aligned_buffer.h"
#include "common/strings.h"
#include "cpu_adam/adam_math.h"
#include "engine/checkpoint.h"
#include "engine/loss_scaler.h"
#include "engine/param_math.h"
#include "tiers/optimizer_state.h"
#include "tiers/runtime_context.h"
#include "zoffload/cpu_adam.h"
#if ZO_HAVE_CUDA
#include "engine/device_path.h"
#endif

namespace zoffload {

using internal::Accumulate;
using internal::AddInDtype;
using internal::AlignedBuffer;
using internal::CastFromFloat;
using internal::CheckGroup;
using internal::CopyFor;
using internal::FirstFew;
using internal::GroupHypers;
using internal::HostMemory;
using internal::OptimizerState;
using internal::OptimizerStateOptions;
using internal::OptimizerTensor;
using internal::ParamSink;
using internal::StepStats;
using internal::StrCat;
using internal::TensorGrads;
using internal::Tracer;

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kEngineTrack = "engine";
constexpr const char* kHandOverTrack = "gradients handed over";    // GradientReady calls
constexpr const char* kWorkerTrack = "updates during backward";    // overlap "backward"
constexpr const char* kNormTrack = "gradient norms as they land";  // the worker's norm parts

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A thread that handles items one at a time, in the order they were pushed (through a
// lock-free queue: pushing never blocks). Stop lets it finish what is queued.
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

}  // namespace

ParamGroup ParamGroup::FromConfig(const OptimizerConfig& optimizer) {
  const OptimizerParams& p = optimizer.params;
  return {p.lr, p.betas[0], p.betas[1], p.eps, p.weight_decay};
}

struct OffloadEngine::Impl : public ParamSink {
  struct Param {
    std::string name;
    void* data = nullptr;
    uint64_t n = 0;
    DType dtype = DType::kBf16;
    int group = 0;
    std::vector<uint64_t> shape;
    const float* initial = nullptr;  // the caller's fp32 values, during Create only
    HostMemory grads;                // accumulation 1: the gradient (dtype); > 1: the fp32 sum
    HostMemory landing;  // accumulation > 1 on the GPU: each micro-batch's gradient (dtype)
    // Overlap "delayed" with accumulation > 1: the new values (dtype) until they are uploaded
    // (with accumulation 1 they are written over the gradient in `grads`).
    HostMemory staged;
    int received = 0;      // gradients in this accumulation window
    bool pending = false;  // delayed: the new values wait in Out() for their upload
#if ZO_HAVE_CUDA
    // The last upload from Out() (delayed) or from where the gradient landed (up_in_place),
    // which the next gradient waits for.
    Future<> upload;
#endif
    uint64_t bytes() const { return n * DTypeBytes(dtype); }
    std::byte* Out() { return (staged.empty() ? grads : staged).data(); }
    // Where the last gradient landed (dtype): `grads` with accumulation 1, else `landing`.
    std::byte* Landed() { return (landing.empty() ? grads : landing).data(); }
  };

  Config config;
  EngineOptions options;
  std::unique_ptr<RuntimeContext> own_context;  // when the caller gave none
  internal::Runtime* rt = nullptr;
  std::vector<Param> params;
  std::map<std::string, size_t, std::less<>> index;
  std::vector<ParamGroup> groups;
  std::unique_ptr<OptimizerState> state;
  internal::LossScaler scaler{Fp16Config{}};
  int accumulation = 1;
  int64_t steps = 0;
  uint64_t total = 0;
  uint64_t grads_in_window = 0;  // GradientReady calls since the last Step
  EngineStepStats last;
  bool gpu = false;
  Overlap overlap = Overlap::kNone;
  // On the GPU with the state in host memory, each chunk's new values are written over its
  // gradient where it landed (the update has read it) and uploaded from there; a retried Step
  // after an error needs the gradients only with NVMe state, which goes through the staging
  // slots. `slot`: the staging slot of the chunk being updated (NVMe state).
  bool up_in_place = false;
  std::byte* slot = nullptr;
#if ZO_HAVE_CUDA
  std::unique_ptr<internal::DevicePath> device;
  // The device path's counters at the last Step.
  uint64_t last_to_host = 0, last_to_gpu = 0;
  double last_upload_wait = 0;
#endif
  // The worker thread, when there is work for it: items come from this thread (a gradient
  // piece as its D2H is enqueued: the worker waits for it to land) and are handled in order:
  // - a landed gradient piece (GPU, accumulation > 1): added into the fp32 sums;
  // - once a parameter's last gradient of the window is all on the host, for overlap
  //   "backward" (which then hands the parameter to the updater) and for overlap "none" on
  //   the GPU with accumulation > 1 (so that Step has no norm pass left): its norm part, read
  //   from the GPU's squares with accumulation 1, else made here with a few threads while
  //   backward runs;
  // - overlap "delayed": the step's whole update (kRunUpdate).
  using Item = internal::DevicePath::Piece;
  static constexpr uint32_t kRunUpdate = UINT32_MAX;
  Lane<Item> worker;
  bool pieces_to_worker = false;  // every landed piece goes to the worker
  // On the GPU with accumulation 1, each gradient's squares are made there as it goes down
  // (DevicePath item 5): the host has no norm pass in any overlap mode.
  bool gpu_squares = false;
  bool norm_on_landing = false;  // overlap "none" on the GPU, accumulation > 1: the sums' squares
  int landing_threads = 1;       // for those, and overlap "backward"'s where the GPU makes none
  // Overlap "backward": the updater thread takes each parameter once the worker has checked
  // its gradient (its norm part, inf/NaN before anything is written), in that order, and
  // updates it (the upload of each chunk follows at once), while the worker checks the next.
  Lane<size_t> updater;
  // Per window (the gradients between two Steps), overlap "backward" (and `squares` in every
  // mode that has them): fixed at its first gradient, then the worker's (read after
  // AwaitWorker; with gpu_squares and no worker reading them, Step reads them).
  AdamHyper window_base;
  std::vector<AdamHyper> window_hypers;
  std::vector<GradSquares> squares;    // each parameter's gradient
  std::vector<uint64_t> landed_bytes;  // of its last micro-batch (GPU)
  // Accumulation > 1 on the GPU: the bytes of each parameter's micro-batches the worker has
  // added into its sum this window (the next micro-batch lands where the last one did).
  std::unique_ptr<std::atomic<uint64_t>[]> summed;
  std::vector<size_t> nonfinite;  // parameters whose gradient had inf/NaN
  // Overlap "none": the window's norm, once GradientNorm has computed it (a caller clipping
  // before Step); Step takes it instead of a second norm pass. Any new gradient drops it.
  std::optional<GradNorm> window_norm;
  Status worker_status;    // the updater's first error (overlap "backward")
  StepStats window_stats;  // CPU Adam time
  // Overlap "delayed": the update launched at a Step runs on the worker during the next
  // window; each parameter's next gradient waits until the update has read this one.
  std::vector<size_t> arrival;  // parameters in the order their window's last gradient came
  std::unique_ptr<std::atomic<int64_t>[]> consumed;  // the update (by number) past each one
  int64_t launched = 0;                              // updates launched
  bool outstanding = false;                          // one is launched and not yet collected
  std::atomic<bool> update_done{false};
  bool in_update = false;  // the worker is in a delayed update (the sink writes to Out())
  std::vector<TensorGrads> job_grads;
  std::vector<AdamHyper> job_hypers;
  AdamHyper job_base;
  std::vector<size_t> job_order;
  GradNorm job_norm;  // with gpu_squares
  Result<AdamStepResult> job_result{AdamStepResult{}};
  StepStats job_stats;

  ~Impl() override {
    // The worker first (it finishes what is queued, waiting for each piece to land), then the
    // updater (what the worker sent it: its updates upload through the device path), then
    // the device path.
    worker.Stop();
    updater.Stop();
#if ZO_HAVE_CUDA
    device.reset();
#endif
  }

  Result<Param*> Find(std::string_view name) {
    auto it = index.find(name);
    if (it == index.end()) {
      return NotFoundError(
          StrCat("no parameter '", name, "' is registered (", params.size(), " parameters)"));
    }
    return &params[it->second];
  }

  // The tag of an item: the parameter, whether it adds to the sum, and whether it is the
  // parameter's last gradient of the window.
  static uint32_t Tag(size_t param, bool add, bool last) {
    return static_cast<uint32_t>(param << 2 | (add ? 2u : 0u) | (last ? 1u : 0u));
  }

  void Handle(const Item& item) {
    if (item.tag == kRunUpdate) return RunUpdate();
    const size_t i = item.tag >> 2;
    Param& p = params[i];
#if ZO_HAVE_CUDA
    if (item.host != nullptr) {
      // A piece of a gradient, posted as its D2H was enqueued: it must be on the host first. A
      // failed D2H is not used (Step reports it: WaitLanded), but counted all the same.
      const bool ok = device->AwaitPiece().ok();
      if (accumulation > 1) {  // the piece landed in p.landing
        if (ok) {
          const size_t element = DTypeBytes(p.dtype);
          const uint64_t first = static_cast<uint64_t>(item.host - p.landing.data()) / element;
          Accumulate(p.grads.as<float>() + first, item.host, p.dtype, item.bytes / element,
                     (item.tag & 2) != 0);
        }
        summed[i].fetch_add(item.bytes);
        summed[i].notify_all();
      }
      if (!ok) return;
    }
#endif
    if (overlap != Overlap::kDelayed && (item.tag & 1) != 0) {
      landed_bytes[i] += item.bytes;
      if (landed_bytes[i] == p.bytes()) {
        const auto start = Clock::now();
#if ZO_HAVE_CUDA
        squares[i] = gpu_squares ? device->Squares(i) : SquaresOf(i, landing_threads);
#else
        squares[i] = SquaresOf(i, landing_threads);
#endif
        if (Tracer* tracer = rt->tracer()) tracer->Record(kNormTrack, p.name, start, Clock::now());
        if (overlap == Overlap::kBackward) {
          updater.Push(i);
        }
      }
    }
  }

  // Blocks until the worker has handled every item sent so far, and the updater every
  // parameter the worker sent it.
  void AwaitWorker() {
    worker.AwaitAll();  // what it sends the updater is pushed by then
    updater.AwaitAll();
  }

  // Host mode, overlap "none", gradient_accumulation_steps 1 (or unset): a parameter may take
  // more gradients than declared before Step, added into its gradient in its dtype as torch
  // adds into .grad (a loop that accumulates by repeated backward, as every torch optimizer
  // allows). On the GPU and in the overlap modes the declared count is the count.
  bool AddsAsTorch() const { return !gpu && accumulation == 1 && overlap == Overlap::kNone; }

  // Every parameter has its gradient_accumulation_steps gradients of the window (at least
  // those where AddsAsTorch); else
  // FAILED_PRECONDITION from `what` naming the first five without (then `consequence`).
  Status CheckWindowComplete(std::string_view what, std::string_view consequence) const {
    std::vector<std::string> missing;
    for (const Param& p : params) {
      if (AddsAsTorch() ? p.received < accumulation : p.received != accumulation) {
        missing.push_back(StrCat("'", p.name, "' (", p.received, " of ", accumulation, ")"));
      }
    }
    if (missing.empty()) return Status::Ok();
    return FailedPreconditionError(StrCat(what, ": ", missing.size(), " of ", params.size(),
                                          " parameters lack gradients: ", FirstFew(missing, ", "),
                                          consequence));
  }

  // Counts a gradient of `p` handed over (its hand-over began at `start`); the window's norm,
  // if GradientNorm made one, no longer holds.
  Status Received(Param& p, Clock::time_point start) {
    window_norm.reset();
    ++p.received;
    ++grads_in_window;
    if (Tracer* tracer = rt->tracer()) tracer->Record(kHandOverTrack, p.name, start, Clock::now());
    return Status::Ok();
  }

  // Waits until the window's gradients are all in host memory (and summed), and, on the GPU,
  // reads their squares where the GPU made them and no worker has.
  Status AwaitGradients() {
#if ZO_HAVE_CUDA
    if (gpu) ZO_RETURN_IF_ERROR(device->WaitLanded().WithContext("Step: gradients to the host"));
#endif
    AwaitWorker();  // accumulation, and the updates of the overlap modes
#if ZO_HAVE_CUDA
    if (gpu_squares && overlap != Overlap::kBackward) {  // backward's worker read them
      for (size_t i = 0; i < params.size(); ++i) squares[i] = device->Squares(i);
    }
#endif
    return Status::Ok();
  }

  TensorGrads GradsOf(size_t i, const AdamHyper* hyper) {
    const Param& p = params[i];
    return {p.grads.data(), accumulation > 1 ? DType::kFp32 : p.dtype, nullptr, CopyFor(p.dtype),
            hyper};
  }

  // Parameter i's part of the norm (its gradient as the update reads it).
  GradSquares SquaresOf(size_t i, int threads) {
    const TensorGrads g = GradsOf(i, nullptr);
    AdamShard shard;
    shard.n = params[i].n;
    shard.grads = g.grads;
    shard.grad_dtype = g.dtype;
    return GradientSquares(shard, threads);
  }

  // Overlap "backward", on the updater: parameter i's update, once its gradient is checked.
  void UpdateOne(size_t i) {
    if (!squares[i].finite) {
      nonfinite.push_back(i);
      return;
    }
    const auto start = Clock::now();
    if (worker_status.ok()) {
      const TensorGrads g = GradsOf(i, &window_hypers[params[i].group]);
      worker_status = state->UpdateTensor(i, g, window_base, this, &window_stats);
    }
    if (Tracer* tracer = rt->tracer()) {
      tracer->Record(kWorkerTrack, params[i].name, start, Clock::now());
    }
  }

  // Overlap "delayed", on the worker: the launched update, over the window's gradients in
  // the order they came (the order the next window's gradients will wait in).
  void RunUpdate() {
    in_update = true;
    job_result =
        state->Step(job_grads, job_base, 1.0f, static_cast<float>(config.gradient_clipping), this,
                    job_order, gpu_squares ? &job_norm : nullptr);
    in_update = false;
    job_stats = state->last_step();
    update_done.store(true);
    for (size_t i = 0; i < params.size(); ++i) {  // skipped or failed: none was read
      consumed[i].store(launched);
      consumed[i].notify_all();
    }
  }

  AdamHyper NextBase() const {
    AdamHyper base = HyperFromConfig(config.optimizer);
    base.step = steps + 1;
    return base;
  }

  // The first gradient of a window.
  void BeginWindow() {
    if (overlap == Overlap::kBackward) {
      window_base = NextBase();
      window_hypers = GroupHypers(groups, window_base);
      nonfinite.clear();
      worker_status = Status::Ok();
      window_stats = StepStats{};
    }
    std::fill(squares.begin(), squares.end(), GradSquares{});
    std::fill(landed_bytes.begin(), landed_bytes.end(), 0);
    if (summed != nullptr) {  // the worker is done with the last window (Step waited)
      for (size_t i = 0; i < params.size(); ++i) summed[i].store(0);
    }
    arrival.clear();
  }

  // Overlap "delayed": the outcome of the launched update, once it has finished.
  Status Collect(EngineStepStats* stats) {
    if (!outstanding) return Status::Ok();
    AwaitWorker();
    outstanding = false;
    ZO_RETURN_IF_ERROR(job_result.status().WithContext(StrCat("update ", launched)));
    if (job_result->skipped) {
      for (Param& p : params) p.pending = false;  // nothing new to upload
    } else {
      ++steps;
    }
    if (stats != nullptr) {
      stats->skipped = job_result->skipped;
      stats->grad_norm = job_result->grad_norm;
      stats->clip_coef = job_result->clip_coef;
      if (!job_result->skipped) stats->adam_seconds = job_stats.adam_seconds;
    }
    return Status::Ok();
  }

  // Overlap "delayed": blocks until the launched update is past parameter i (it has read its
  // gradient and written its new values).
  void AwaitConsumed(size_t i) {
    const int64_t want = launched;
    for (int64_t seen = consumed[i].load(); seen < want; seen = consumed[i].load()) {
      consumed[i].wait(seen);
    }
  }

  // Overlap "delayed": parameter i's new values to the model (after the work on `stream`).
  Status UploadPending(size_t i, void* stream) {
    Param& p = params[i];
    if (!p.pending) return Status::Ok();
    AwaitConsumed(i);
    if (update_done.load() && (!job_result.ok() || job_result->skipped)) {
      p.pending = false;  // Collect reports the error
      return job_result.status();
    }
    p.pending = false;
#if ZO_HAVE_CUDA
    if (gpu) {
      ZO_ASSIGN_OR_RETURN(p.upload, device->UploadFrom(p.data, p.Out(), p.bytes(), stream));
      return Status::Ok();
    }
#else
    (void)stream;
#endif
    std::memcpy(p.data, p.Out(), p.bytes());
    return Status::Ok();
  }

  Status UploadAllPending(void* stream) {
    for (size_t i = 0; i < params.size(); ++i) ZO_RETURN_IF_ERROR(UploadPending(i, stream));
    return Status::Ok();
  }

  // Save and Load run between steps.
  Status BetweenSteps(std::string_view what) const {
    if (grads_in_window == 0) return Status::Ok();
    return FailedPreconditionError(StrCat(what, ": ", grads_in_window,
                                          " gradients of the coming step are in; call it "
                                          "between Step and the next step's first gradient"));
  }

  // ParamSink: chunk by chunk over the landed gradient (host state) or into pinned staging
  // (NVMe state) and up (GPU), or into the parameter (host mode).
  Result<void*> Begin(size_t t, uint64_t first, uint64_t) override {
    Param& p = params[t];
    if (in_update) {
#if ZO_HAVE_CUDA
      // In `staged`, after the last values went up from there (with accumulation 1, Out() is
      // where the gradient landed, after that upload).
      if (first == 0 && !p.staged.empty() && p.upload.valid()) {
        ZO_RETURN_IF_ERROR(p.upload.Wait());
      }
#endif
      return static_cast<void*>(p.Out() + first * DTypeBytes(p.dtype));
    }
#if ZO_HAVE_CUDA
    if (gpu && up_in_place) return static_cast<void*>(p.Landed() + first * DTypeBytes(p.dtype));
    if (gpu) {
      ZO_ASSIGN_OR_RETURN(slot, device->AcquireSlot());
      return static_cast<void*>(slot);
    }
#endif
    return static_cast<void*>(static_cast<std::byte*>(p.data) + first * DTypeBytes(p.dtype));
  }

  Status End(size_t t, uint64_t first, uint64_t n, const float* master) override {
    Param& p = params[t];
    const size_t element = DTypeBytes(p.dtype);
    if (in_update) {  // the chunk's gradient has been read: its new values go in its place
      if (p.dtype == DType::kFp32) std::memcpy(p.Out() + first * element, master, 4 * n);
      if (first + n == p.n) {
        consumed[t].store(launched);
        consumed[t].notify_all();
      }
      return Status::Ok();
    }
#if ZO_HAVE_CUDA
    if (gpu) {
      std::byte* from = up_in_place ? p.Landed() + first * element : slot;
      if (p.dtype == DType::kFp32) std::memcpy(from, master, 4 * n);
      void* to = static_cast<std::byte*>(p.data) + first * element;
      if (!up_in_place) return device->Upload(to, n * element);
      // The parameter's next gradient lands there after this upload (Add waits for it).
      ZO_ASSIGN_OR_RETURN(p.upload, device->UploadFrom(to, from, n * element));
      return Status::Ok();
    }
#endif
    if (p.dtype == DType::kFp32) {
      std::memcpy(static_cast<std::byte*>(p.data) + first * element, master, 4 * n);
    }
    return Status::Ok();
  }

  // Where parameter memory must live: the engine's GPU, or the host in host mode.
  Status CheckMemory(const void* ptr, const std::string& what) const {
#if ZO_HAVE_CUDA
    if (!rt->has_gpu()) return Status::Ok();
    ZO_ASSIGN_OR_RETURN(const int where, internal::DevicePath::DeviceOf(ptr));
    const int want = gpu ? rt->options().device : -1;
    if (where != want) {
      auto name = [](int d) { return d < 0 ? std::string("host memory") : StrCat("GPU ", d); };
      return InvalidArgumentError(StrCat(what, " is in ", name(where), "; the engine ",
                                         gpu ? "runs on " : "runs in host mode and needs ",
                                         name(want)));
    }
#else
    (void)ptr, (void)what;
#endif
    return Status::Ok();
  }

  Status Initialize();
};

Status OffloadEngine::Impl::Initialize() {
  uint64_t largest = 0;
  for (const Param& p : params) largest = std::max(largest, p.n);
  AlignedBuffer masters, raw;
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    const float* initial = p.initial;  // the given fp32 values win
    if (initial == nullptr) {
      if (masters.empty()) {
        ZO_ASSIGN_OR_RETURN(masters, AlignedBuffer::Allocate(4 * largest, 64));
      }
      const void* values = p.data;
#if ZO_HAVE_CUDA
      if (gpu) {
        if (raw.empty()) {
          ZO_ASSIGN_OR_RETURN(raw, AlignedBuffer::Allocate(4 * largest, 64));
        }
        ZO_RETURN_IF_ERROR(device->CopyToHost(raw.data(), p.data, p.bytes())
                               .WithContext(StrCat("reading parameter '", p.name, "'")));
        values = raw.data();
      }
#endif
      Accumulate(masters.as<float>(), values, p.dtype, p.n, false);
      initial = masters.as<float>();
    }
    ZO_RETURN_IF_ERROR(state->Write(i, initial).WithContext(StrCat("initializing '", p.name, "'")));
  }
  return Status::Ok();
}

// ---- OffloadEngine ------------------------------------------------------------------------

namespace {}  // namespace

OffloadEngine::OffloadEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadEngine::~OffloadEngine() = default;

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::Create(const Config& config,
                                                             std::vector<ParameterSpec> specs,
                                                             EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  Impl& e = *impl;
  e.config = config;
  // The parser's rules, for a config built in code (e.config: nvme_paths normalized).
  ZO_RETURN_IF_ERROR(ValidateConfig(e.config).WithContext("engine"));
  ZO_ASSIGN_OR_RETURN(OptimizerStateOptions so, OptimizerStateOptions::FromConfig(e.config));
  if (options.staging_slots < 2) {
    return InvalidArgumentError(
        StrCat("engine: staging_slots must be at least 2, got ", options.staging_slots));
  }
  e.groups = options.groups.empty()
                 ? std::vector<ParamGroup>{ParamGroup::FromConfig(config.optimizer)}
                 : options.groups;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    ZO_RETURN_IF_ERROR(CheckGroup(e.groups[g], StrCat("engine: parameter group ", g)));
  }
  e.accumulation = static_cast<int>(config.gradient_accumulation_steps.value_or(1));
  e.overlap = config.zoffload.overlap;
  e.scaler = internal::LossScaler(config.fp16);
  if (specs.empty()) return InvalidArgumentError("engine: no parameters given");
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParameterSpec& s = specs[i];
    if (s.name.empty())
      return InvalidArgumentError(StrCat("engine: parameter #", i, " has no name"));
    if (s.elements == 0 || s.data == nullptr) {
      return InvalidArgumentError(StrCat("engine: parameter '", s.name,
                                         "' needs memory and at least 1 element (got ", s.elements,
                                         " elements at ", s.data, ")"));
    }
    if (s.group < 0 || s.group >= static_cast<int>(e.groups.size())) {
      return InvalidArgumentError(StrCat("engine: parameter '", s.name, "' is in group ", s.group,
                                         "; there are ", e.groups.size(), " groups"));
    }
    uint64_t shape_elements = 1;
    std::string shape;
    for (uint64_t d : s.shape) {
      shape_elements *= d;
      shape += StrCat(shape.empty() ? "" : ", ", d);
    }
    if (!s.shape.empty() && shape_elements != s.elements) {
      return InvalidArgumentError(StrCat("engine: parameter '", s.name, "' has shape [", shape,
                                         "] (", shape_elements, " elements) but ", s.elements,
                                         " elements"));
    }
    if (!e.index.emplace(s.name, i).second) {
      return InvalidArgumentError(StrCat("engine: parameter '", s.name, "' is given twice"));
    }
    Impl::Param p;
    p.name = s.name;
    p.data = s.data;
    p.n = s.elements;
    p.dtype = s.dtype;
    p.group = s.group;
    p.shape = s.shape.empty() ? std::vector<uint64_t>{s.elements} : s.shape;
    p.initial = s.initial;
    e.total += p.n;
    e.params.push_back(std::move(p));
  }
  e.options = std::move(options);
  RuntimeContext* context = e.options.context;
  if (context == nullptr) {
    ZO_ASSIGN_OR_RETURN(e.own_context,
                        RuntimeContext::Create(RuntimeOptions::FromConfig(e.config)));
    context = e.own_context.get();
  }
  e.rt = &context->impl();
  SetCpuAdamCoreBinding(config.zoffload.cpu_adam_bind_cores);
  e.gpu = !e.options.host_params && e.rt->has_gpu();
  if (e.options.require_gpu && !e.gpu) {
    return FailedPreconditionError(
        e.options.host_params
            ? "engine: host_params and require_gpu contradict each other"
            : "engine: the parameters are in GPU memory, but no GPU is usable here (a build "
              "without CUDA, or no device; zoffload-report says which)");
  }
  uint64_t widest = 2;  // bytes per element of the widest parameter dtype
  for (const Impl::Param& p : e.params) {
    ZO_RETURN_IF_ERROR(e.CheckMemory(p.data, StrCat("engine: parameter '", p.name, "'")));
    widest = std::max<uint64_t>(widest, DTypeBytes(p.dtype));
  }
  std::vector<OptimizerTensor> tensors;
  for (const Impl::Param& p : e.params) tensors.push_back({p.name, p.n});
  ZO_ASSIGN_OR_RETURN(e.state, OptimizerState::Create(std::move(tensors), *context, so));
  const bool delayed = e.overlap == Overlap::kDelayed;
  for (Impl::Param& p : e.params) {
    const std::string what = StrCat("the gradient of '", p.name, "'");
    if (e.accumulation == 1) {
      // Pinned also in host mode with a GPU present: the caller's D2H may land there
      // (GradientBuffer).
      ZO_ASSIGN_OR_RETURN(p.grads, e.rt->AllocateHost(p.bytes(), what, e.rt->has_gpu()));
    } else {
      ZO_ASSIGN_OR_RETURN(p.grads, e.rt->AllocateHost(4 * p.n, StrCat(what, " (fp32 sum)"), false));
      if (e.gpu) {
        ZO_ASSIGN_OR_RETURN(p.landing, e.rt->AllocateHost(p.bytes(), what, true));
      }
      if (delayed) {
        ZO_ASSIGN_OR_RETURN(
            p.staged,
            e.rt->AllocateHost(p.bytes(), StrCat("the new values of '", p.name, "'"), e.gpu));
      }
    }
  }
  e.gpu_squares = e.gpu && e.accumulation == 1;
  e.norm_on_landing = e.gpu && e.accumulation > 1 && e.overlap == Overlap::kNone;
  e.pieces_to_worker = e.gpu && (e.accumulation > 1 || e.overlap == Overlap::kBackward);
  if (e.gpu && e.accumulation > 1) {
    e.summed = std::make_unique<std::atomic<uint64_t>[]>(e.params.size());
    for (size_t i = 0; i < e.params.size(); ++i) e.summed[i].store(0);
  }
  if (e.overlap == Overlap::kBackward || e.norm_on_landing || e.gpu_squares) {
    e.squares.resize(e.params.size());
  }
  if (e.overlap == Overlap::kBackward || e.norm_on_landing) {
    e.landed_bytes.resize(e.params.size());
  }
  // A quarter of the update's threads: backward's own thread keeps its core.
  const int threads = e.config.zoffload.cpu_adam_threads;
  e.landing_threads = std::max(1, (threads > 0 ? threads : DefaultAdamThreads()) / 4);
  if (delayed) {
    e.consumed = std::make_unique<std::atomic<int64_t>[]>(e.params.size());
    for (size_t i = 0; i < e.params.size(); ++i) e.consumed[i].store(0);
  }
#if ZO_HAVE_CUDA
  if (e.gpu) {
    // Buckets no larger than all the gradients together.
    const uint64_t bucket = std::min<uint64_t>(
        static_cast<uint64_t>(config.zero_optimization.reduce_bucket_size) * widest,
        e.total * widest);
    internal::DevicePath::Landed landed;
    if (e.pieces_to_worker) {
      landed = [&e](internal::DevicePath::Piece piece) { e.worker.Push(piece); };
    }
    e.up_in_place = so.home == internal::StateHome::kHost;
    ZO_ASSIGN_OR_RETURN(e.device, internal::DevicePath::Create(
                                      *e.rt, bucket, e.up_in_place ? 0 : e.options.staging_slots,
                                      e.state->chunk_elements() * widest, std::move(landed),
                                      e.gpu_squares ? e.params.size() : 0));
  }
#endif
  if (e.pieces_to_worker || e.overlap != Overlap::kNone) {
    e.worker.Start([&e](const Impl::Item& item) { e.Handle(item); });
    if (e.overlap == Overlap::kBackward) e.updater.Start([&e](size_t i) { e.UpdateOne(i); });
  }
  ZO_RETURN_IF_ERROR(e.Initialize());
  for (Impl::Param& p : e.params) p.initial = nullptr;
  return std::unique_ptr<OffloadEngine>(new OffloadEngine(std::move(impl)));
}

Status OffloadEngine::GradientReady(std::string_view name, const void* grad, uint64_t elements,
                                    DType dtype, void* stream) {
  Impl& e = *impl_;
  ZO_ASSIGN_OR_RETURN(Impl::Param * p, e.Find(name));
  const auto start = Clock::now();
  if (dtype != p->dtype || elements != p->n || grad == nullptr) {
    return InvalidArgumentError(
        StrCat("gradient of '", p->name, "': ", elements, " ", ToString(dtype), " elements at ",
               grad, "; the parameter has ", p->n, " ", ToString(p->dtype), " elements"));
  }
  ZO_RETURN_IF_ERROR(e.CheckMemory(grad, StrCat("gradient of '", p->name, "'")));
  if (p->received >= e.accumulation) {
    // One more micro-batch than declared: added into the gradient in its dtype, as torch adds
    // into .grad, where the engine can (see AddsAsTorch).
    if (!e.AddsAsTorch()) {
      return FailedPreconditionError(StrCat(
          "gradient of '", p->name, "': it already has its ", e.accumulation,
          " gradient(s) of this step (gradient_accumulation_steps); call Step first, or declare "
          "the micro-batches per step in the config's gradient_accumulation_steps (an undeclared "
          "count adds up only in host mode with overlap \"none\")"));
    }
    if (grad == p->grads.data()) {
      return InvalidArgumentError(StrCat("gradient of '", p->name,
                                         "': a later micro-batch's gradient cannot be written "
                                         "into the engine's buffer, which holds the sum so far"));
    }
    AddInDtype(p->grads.data(), grad, p->dtype, p->n);
    return e.Received(*p, start);
  }
  const bool add = p->received > 0;
  const bool last = p->received + 1 == e.accumulation;
  const size_t i = static_cast<size_t>(p - e.params.data());
  if (e.grads_in_window == 0) e.BeginWindow();
  // Delayed: the last update's values for this parameter go up now that backward is done
  // with it (and before its new gradient may land where they wait): at the window's last
  // micro-batch, so that every micro-batch's forward sees the same (one step older) values
  // and the next forward runs after the uploads (Step's caller waits for them).
  if (last) ZO_RETURN_IF_ERROR(e.UploadPending(i, stream));
#if ZO_HAVE_CUDA
  if (e.gpu) {
    const Future<>* upload = p->upload.valid() ? &p->upload : nullptr;
    if (e.accumulation == 1) {
      const internal::DevicePath::SquaresTo squares{p->dtype, i};
      ZO_RETURN_IF_ERROR(e.device->Add(grad, p->bytes(), p->grads.data(), Impl::Tag(i, add, last),
                                       stream, upload, &squares));
    } else {
      // A new micro-batch lands where the last one did: the worker must have added it in.
      const uint64_t want = static_cast<uint64_t>(p->received) * p->bytes();
      for (uint64_t seen = e.summed[i].load(); seen < want; seen = e.summed[i].load()) {
        e.summed[i].wait(seen);
      }
      ZO_RETURN_IF_ERROR(e.device->Add(grad, p->bytes(), p->landing.data(), Impl::Tag(i, add, last),
                                       stream, upload));
    }
  }
#else
  (void)stream;
#endif
  if (!e.gpu) {
    // Delayed, accumulation > 1: the first micro-batch goes over the sum the update reads.
    if (e.overlap == Overlap::kDelayed && !add && !last && p->pending) e.AwaitConsumed(i);
    if (e.accumulation == 1) {
      if (grad != p->grads.data()) std::memcpy(p->grads.data(), grad, p->bytes());  // else in place
    } else {
      Accumulate(p->grads.as<float>(), grad, p->dtype, p->n, add);
    }
    if (e.overlap == Overlap::kBackward && last) {
      e.worker.Push({nullptr, p->bytes(), Impl::Tag(i, add, last)});
    }
  }
  if (last) e.arrival.push_back(i);
  return e.Received(*p, start);
}

Result<void*> OffloadEngine::GradientBuffer(std::string_view name) {
  Impl& e = *impl_;
  ZO_ASSIGN_OR_RETURN(Impl::Param * p, e.Find(name));
  if (e.gpu || e.accumulation > 1 || e.overlap == Overlap::kDelayed) return nullptr;
  return static_cast<void*>(p->grads.data());
}

Result<EngineStepStats> OffloadEngine::Step() {
  Impl& e = *impl_;
  const auto start = Clock::now();
  ZO_RETURN_IF_ERROR(e.CheckWindowComplete("Step", "; nothing was updated"));
  EngineStepStats stats;
  Tracer* tracer = e.rt->tracer();
  ZO_RETURN_IF_ERROR(e.AwaitGradients());
  stats.wait_grads_seconds = Since(start);
  if (tracer != nullptr) tracer->Record(kEngineTrack, "wait for gradients", start, Clock::now());
  const float scale = e.scaler.scale();
  stats.loss_scale = scale;
  const auto update_start = Clock::now();
  Status outcome;  // an error found after the state has changed (overlap "backward")
  switch (e.overlap) {
    case Overlap::kNone: {
      const AdamHyper base = e.NextBase();
      const std::vector<AdamHyper> hypers = GroupHypers(e.groups, base);
      std::vector<TensorGrads> grads;
      for (size_t i = 0; i < e.params.size(); ++i) {
        grads.push_back(e.GradsOf(i, &hypers[e.params[i].group]));
      }
      const bool known = e.gpu_squares || e.norm_on_landing;
      if (known && !e.window_norm) e.window_norm = NormOf(e.squares);
      auto result =
          e.state->Step(grads, base, scale, static_cast<float>(e.config.gradient_clipping), &e, {},
                        e.window_norm ? &*e.window_norm : nullptr);
      e.window_norm.reset();
      ZO_RETURN_IF_ERROR(result.status().WithContext("Step"));
      e.scaler.Update(result->skipped);
      if (!result->skipped) ++e.steps;
      const StepStats& s = e.state->last_step();
      stats.skipped = result->skipped;
      stats.grad_norm = result->grad_norm;
      stats.clip_coef = result->clip_coef;
      if (!result->skipped) {
        stats.adam_seconds = s.adam_seconds;
        stats.io_wait_seconds = s.io_wait_seconds;
        stats.nvme_bytes_read = s.bytes_read;
        stats.nvme_bytes_written = s.bytes_written;
      }
      break;
    }
    case Overlap::kBackward: {
      // Each parameter was updated as its gradient landed; the norm is their parts added in
      // parameter order, as the exact step adds them.
      ZO_RETURN_IF_ERROR(e.worker_status.WithContext("Step (overlap \"backward\")"));
      stats.grad_norm = NormOf(e.squares).l2;
      stats.adam_seconds = e.window_stats.adam_seconds;
      ++e.steps;
      if (!e.nonfinite.empty()) {
        std::vector<std::string> names;
        for (size_t i : e.nonfinite) names.push_back(StrCat("'", e.params[i].name, "'"));
        outcome = DataLossError(StrCat(
            "Step: the gradients of ", e.nonfinite.size(), " parameters (", FirstFew(names, ", "),
            ") hold inf/NaN and were not applied; under zoffload.overlap \"backward\" the "
            "other parameters were already updated during backward (overlap \"none\" skips "
            "the whole step instead)"));
      }
      break;
    }
    case Overlap::kDelayed: {
      // The update launched at the last Step has finished (each gradient of this window
      // waited for it); this Step reports it, then launches this window's.
      ZO_RETURN_IF_ERROR(e.Collect(&stats).WithContext("Step (overlap \"delayed\")"));
      e.job_base = e.NextBase();
      e.job_hypers = GroupHypers(e.groups, e.job_base);
      e.job_grads.clear();
      for (size_t i = 0; i < e.params.size(); ++i) {
        e.job_grads.push_back(e.GradsOf(i, &e.job_hypers[e.params[i].group]));
      }
      e.job_order = e.arrival;
      if (e.gpu_squares) e.job_norm = NormOf(e.squares);
      ++e.launched;
      for (Impl::Param& p : e.params) p.pending = true;
      e.update_done.store(false);
      e.outstanding = true;
      e.worker.Push({nullptr, 0, Impl::kRunUpdate});
      if (e.launched <= e.config.zoffload.delayed_warmup_steps) {
        // A warm-up step is exact: its values go up before the next forward.
        ZO_RETURN_IF_ERROR(e.Collect(&stats).WithContext("Step (delayed warm-up)"));
        ZO_RETURN_IF_ERROR(e.UploadAllPending(nullptr));
      }
      break;
    }
  }
  stats.update_seconds = Since(update_start);
  if (tracer != nullptr) tracer->Record(kEngineTrack, "update", update_start, Clock::now());
  for (Impl::Param& p : e.params) p.received = 0;
  e.grads_in_window = 0;
  stats.step = e.steps;
#if ZO_HAVE_CUDA
  if (e.gpu) {
    stats.upload_wait_seconds = e.device->upload_wait_seconds() - e.last_upload_wait;
    stats.bytes_to_host = e.device->bytes_to_host() - e.last_to_host;
    stats.bytes_to_gpu = e.device->bytes_to_gpu() - e.last_to_gpu;
    e.last_upload_wait = e.device->upload_wait_seconds();
    e.last_to_host = e.device->bytes_to_host();
    e.last_to_gpu = e.device->bytes_to_gpu();
  }
#endif
  stats.seconds = Since(start);
  e.last = stats;
  ZO_RETURN_IF_ERROR(outcome);
  return stats;
}

Status OffloadEngine::Flush(void* stream) {
  Impl& e = *impl_;
  if (e.overlap != Overlap::kDelayed) return Status::Ok();
  ZO_RETURN_IF_ERROR(e.Collect(nullptr).WithContext("Flush"));
  return e.UploadAllPending(stream);
}

Status OffloadEngine::WaitParameters(void* stream) {
#if ZO_HAVE_CUDA
  if (impl_->gpu) return impl_->device->WaitParameters(stream);
#else
  (void)stream;
#endif
  return Status::Ok();
}

float OffloadEngine::loss_scale() const { return impl_->scaler.scale(); }
int OffloadEngine::group_count() const { return static_cast<int>(impl_->groups.size()); }
const ParamGroup& OffloadEngine::group(int index) const { return impl_->groups.at(index); }

Status OffloadEngine::SetGroup(int index, const ParamGroup& group) {
  if (index < 0 || index >= group_count()) {
    return OutOfRangeError(StrCat("SetGroup: no group ", index, " (", group_count(), " groups)"));
  }
  ZO_RETURN_IF_ERROR(CheckGroup(group, StrCat("SetGroup ", index)));
  if (impl_->overlap == Overlap::kBackward && impl_->grads_in_window > 0 &&
      !(impl_->groups[index] == group)) {
    return FailedPreconditionError(StrCat(
        "SetGroup ", index,
        ": under zoffload.overlap \"backward\" this window's updates "
        "have begun with the group as it was; change it between Step and the first gradient"));
  }
  impl_->groups[index] = group;
  return Status::Ok();
}

Result<double> OffloadEngine::GradientNorm() {
  Impl& e = *impl_;
  if (e.overlap != Overlap::kNone) {
    return FailedPreconditionError(
        StrCat("GradientNorm: under zoffload.overlap \"", ToString(e.overlap),
               "\" the update does not wait for the step's norm; clipping from the training loop "
               "(clip_grad_norm_) needs overlap \"none\""));
  }
  ZO_RETURN_IF_ERROR(e.CheckWindowComplete("GradientNorm", " (call it after the last backward)"));
  ZO_RETURN_IF_ERROR(e.AwaitGradients());
  if (!e.window_norm) {
    if (e.gpu_squares || e.norm_on_landing) {
      e.window_norm = NormOf(e.squares);
    } else {
      std::vector<TensorGrads> grads;
      for (size_t i = 0; i < e.params.size(); ++i) grads.push_back(e.GradsOf(i, nullptr));
      ZO_ASSIGN_OR_RETURN(e.window_norm, e.state->Norm(grads));
    }
  }
  const double raw = e.window_norm->l2;
  return e.window_norm->finite ? raw / e.scaler.scale() : internal::NonfiniteNorm(raw);
}

Status OffloadEngine::SetGradientClipping(double max_norm) {
  Impl& e = *impl_;
  if (!(max_norm >= 0) || !std::isfinite(max_norm)) {
    return InvalidArgumentError(
        StrCat("SetGradientClipping: the max norm must be finite and >= 0, got ", max_norm));
  }
  if (max_norm > 0 && e.overlap == Overlap::kBackward) {
    return FailedPreconditionError(
        StrCat("SetGradientClipping ", max_norm,
               ": zoffload.overlap \"backward\" updates each parameter before the global norm "
               "exists; use overlap \"none\" to clip"));
  }
  e.config.gradient_clipping = max_norm;
  return Status::Ok();
}

Status OffloadEngine::ReadState(std::string_view name, float* master, void* m, void* v) {
  ZO_ASSIGN_OR_RETURN(Impl::Param * p, impl_->Find(name));
  ZO_RETURN_IF_ERROR(impl_->Collect(nullptr).WithContext("ReadState"));
  return impl_->state->Read(static_cast<size_t>(p - impl_->params.data()), master, m, v);
}

Status OffloadEngine::LoadState(std::string_view name, const float* master, const void* m,
                                const void* v) {
  Impl& e = *impl_;
  ZO_ASSIGN_OR_RETURN(Impl::Param * p, e.Find(name));
  ZO_RETURN_IF_ERROR(e.BetweenSteps("LoadState"));  // the sink may write where gradients land
  ZO_RETURN_IF_ERROR(Flush().WithContext("LoadState"));
#if ZO_HAVE_CUDA
  // With host state the sink writes where the gradient landed, from which Flush may have
  // just sent a delayed update's values up. (In a step that upload is done: the gradient
  // read there landed after it.)
  if (e.up_in_place && p->upload.valid()) ZO_RETURN_IF_ERROR(p->upload.Wait());
#endif
  const size_t t = static_cast<size_t>(p - e.params.data());
  ZO_RETURN_IF_ERROR(e.state->Write(t, master, m, v).WithContext(StrCat("LoadState '", name, "'")));
  // The model's parameter follows the master, through the same sink as a step's chunks.
  const uint64_t chunk = e.state->chunk_elements();
  for (uint64_t first = 0; first < p->n; first += chunk) {
    const uint64_t n = std::min(chunk, p->n - first);
    ZO_ASSIGN_OR_RETURN(void* out, e.Begin(t, first, n));
    CastFromFloat(master + first, out, p->dtype, n);
    ZO_RETURN_IF_ERROR(e.End(t, first, n, master + first));
  }
  return Status::Ok();
}

Status OffloadEngine::SetSteps(int64_t steps) {
  if (steps < 0) return InvalidArgumentError(StrCat("SetSteps: ", steps, " < 0"));
  ZO_RETURN_IF_ERROR(impl_->Collect(nullptr).WithContext("SetSteps"));
  impl_->steps = steps;
  return Status::Ok();
}

Status OffloadEngine::Save(const std::string& dir) {
  Impl& e = *impl_;
  ZO_RETURN_IF_ERROR(e.BetweenSteps("Save"));
  ZO_RETURN_IF_ERROR(e.Collect(nullptr).WithContext("Save"));
  const StatePrecision precision = e.config.zoffload.optimizer_state;
  internal::CheckpointMeta meta =
      internal::CheckpointHeader(e.steps, e.scaler.state(), e.config, e.groups);
  for (const Impl::Param& p : e.params) {
    meta.entries.push_back(internal::EntryFor(p.name, p.n, p.shape, p.dtype, p.group, precision));
  }
  return internal::WriteCheckpoint(dir, std::move(meta),
                                   [&e](size_t i, float* master, std::byte* m, std::byte* v) {
                                     return e.state->Read(i, master, m, v);
                                   });
}

Status OffloadEngine::Load(const std::string& dir) {
  Impl& e = *impl_;
  ZO_RETURN_IF_ERROR(e.BetweenSteps("Load"));
  std::string from;
  ZO_ASSIGN_OR_RETURN(internal::CheckpointMeta meta, internal::ReadCheckpointMeta(dir, &from));
  std::vector<internal::RegisteredParam> registered;
  for (const Impl::Param& p : e.params) registered.push_back({p.name, p.n, p.dtype});
  ZO_ASSIGN_OR_RETURN(
      std::vector<const internal::CheckpointEntry*> saved,
      internal::MatchCheckpoint(meta, from, registered, e.config.zoffload.optimizer_state,
                                e.groups.size()));
  uint64_t largest = 0;
  for (const auto* c : saved) largest = std::max(largest, c->bytes());
  ZO_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(largest, 64));
  auto read = [&](const internal::CheckpointEntry& c) {
    auto* m = buffer.data() + 4 * c.elements;
    return internal::ReadCheckpointEntry(from, c, buffer.as<float>(), m, m + c.moment_bytes);
  };
  // Every checksum first: a damaged checkpoint changes nothing.
  for (const auto* c : saved) ZO_RETURN_IF_ERROR(read(*c));
  for (size_t i = 0; i < e.params.size(); ++i) {
    const internal::CheckpointEntry& c = *saved[i];
    ZO_RETURN_IF_ERROR(read(c));
    auto* m = buffer.data() + 4 * c.elements;
    ZO_RETURN_IF_ERROR(LoadState(c.name, buffer.as<float>(), m, m + c.moment_bytes));
  }
  e.groups = meta.groups;
  e.steps = meta.steps;
  e.scaler.Restore({meta.loss_scale, meta.overflows, meta.good_steps});
  return Status::Ok();
}

bool OffloadEngine::on_gpu() const { return impl_->gpu; }
int64_t OffloadEngine::steps() const { return impl_->steps; }
uint64_t OffloadEngine::total_elements() const { return impl_->total; }
const EngineStepStats& OffloadEngine::last_step() const { return impl_->last; }

uint64_t OffloadEngine::host_bytes() const {
  uint64_t total = impl_->state->host_bytes();
  for (const Impl::Param& p : impl_->params) {
    total += p.grads.size() + p.landing.size() + p.staged.size();
  }
#if ZO_HAVE_CUDA
  if (impl_->device != nullptr) total += impl_->device->host_bytes();
#endif
  return total;
}

uint64_t OffloadEngine::gpu_bytes() const {
#if ZO_HAVE_CUDA
  if (impl_->device != nullptr) return impl_->device->gpu_bytes();
#endif
  return 0;
}

}  // namespace zoffload
