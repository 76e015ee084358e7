// zoffload._zoffload: the OffloadEngine, the ZeRO optimizer of one rank and the config for
// Python, over nanobind.
//
// 1. Arrays cross as DLPack (nb::ndarray): torch, numpy and cupy all work and nothing links
//    libtorch. Each array is checked (device, dtype, contiguity, size) before its pointer goes
//    to the engine; parameters must stay alive as long as the engine (zoffload.torch keeps them).
// 2. Streams cross as integers (torch.cuda.current_stream().cuda_stream; 0: the default).
// 3. A Status becomes a Python exception with the same message, one class per code, each also
//    a subclass of the matching built-in (DataLoss is an OSError, ResourceExhausted a
//    MemoryError, ...); every class derives from zoffload.Error.
// 4. The GIL is released during the engine's work.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zoffload/config.h"
#include "zoffload/cpu_adam.h"
#include "zoffload/engine.h"
#include "zoffload/status.h"
#include "zoffload/zero.h"

namespace nb = nanobind;

namespace zoffload::python {
namespace {

// ---- Status -> exception -----------------------------------------------------------------

// A failed Status on its way to the translator (thrown only inside this module).
struct StatusError : std::runtime_error {
  StatusError(StatusCode c, const std::string& message, bool from_config)
      : std::runtime_error(message), code(c), config(from_config) {}
  StatusCode code;
  bool config;
};

struct ExceptionClasses {
  PyObject* error = nullptr;
  PyObject* config = nullptr;
  PyObject* by_code[static_cast<int>(StatusCode::kCancelled) + 1] = {};
};
ExceptionClasses& Classes() {
  static ExceptionClasses classes;
  return classes;
}

void Throw(const Status& status, bool from_config = false) {
  throw StatusError(status.code(), status.ToString(), from_config);
}

template <typename T>
T Unwrap(Result<T> result, bool from_config = false) {
  if (!result.ok()) Throw(result.status(), from_config);
  return std::move(result).value();
}

void Check(const Status& status) {
  if (!status.ok()) Throw(status);
}

[[noreturn]] void Fail(StatusCode code, const std::string& message) {
  throw StatusError(code, message, false);
}

void MakeExceptions(nb::module_& m) {
  ExceptionClasses& c = Classes();
  auto make = [&m](const char* name, std::vector<PyObject*> bases, const char* doc) {
    PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(bases.size()));
    for (size_t i = 0; i < bases.size(); ++i) {
      Py_INCREF(bases[i]);
      PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), bases[i]);
    }
    const std::string qualified = std::string("zoffload.") + name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, tuple, nullptr);
    Py_DECREF(tuple);
    if (cls == nullptr) throw nb::python_error();
    m.attr(name) = nb::handle(cls);
    return cls;
  };
  c.error = make("Error", {PyExc_RuntimeError}, "Base class of every zoffload error.");
  auto sub = [&](StatusCode code, const char* name, PyObject* builtin, const char* doc) {
    std::vector<PyObject*> bases = {c.error};
    if (builtin != nullptr) bases.push_back(builtin);
    c.by_code[static_cast<int>(code)] = make(name, bases, doc);
  };
  c.config = make("ConfigError", {c.error, PyExc_ValueError},
                  "A config that does not parse or validate; the message names the JSON path.");
  sub(StatusCode::kInvalidArgument, "InvalidArgument", PyExc_ValueError,
      "Bad input from the caller (a size, a name, a dtype).");
  sub(StatusCode::kNotFound, "NotFound", PyExc_LookupError,
      "A file, directory, parameter or device that does not exist.");
  sub(StatusCode::kAlreadyExists, "AlreadyExists", PyExc_ValueError,
      "Creating something that exists (a parameter given twice).");
  sub(StatusCode::kPermissionDenied, "PermissionDenied", PyExc_PermissionError,
      "EACCES, EPERM, a read-only file system, io_uring disabled by policy.");
  sub(StatusCode::kResourceExhausted, "ResourceExhausted", PyExc_MemoryError,
      "Disk full, out of memory, the pinned-memory limit or a byte budget hit.");
  sub(StatusCode::kFailedPrecondition, "FailedPrecondition", nullptr,
      "The engine is not in the state the call needs (step() before every gradient).");
  sub(StatusCode::kOutOfRange, "OutOfRange", PyExc_IndexError, "An index past the end.");
  sub(StatusCode::kUnimplemented, "Unimplemented", PyExc_NotImplementedError,
      "The kernel or device lacks a feature.");
  sub(StatusCode::kUnavailable, "Unavailable", nullptr, "A transient failure; try again.");
  sub(StatusCode::kDataLoss, "DataLoss", PyExc_OSError,
      "A checksum mismatch, a torn write or an inconsistent manifest.");
  sub(StatusCode::kIoError, "IoError", PyExc_OSError, "EIO and other device errors.");
  sub(StatusCode::kInternal, "Internal", nullptr, "A broken invariant inside zoffload.");
  sub(StatusCode::kCancelled, "Cancelled", nullptr, "The operation was abandoned.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      ExceptionClasses& classes = Classes();
      PyObject* cls = e.config ? classes.config : classes.by_code[static_cast<int>(e.code)];
      PyErr_SetString(cls != nullptr ? cls : classes.error, e.what());
    }
  });
}

// ---- arrays ---------------------------------------------------------------------------------

using Array = nb::ndarray<nb::c_contig>;
using AnyArray = nb::ndarray<>;

std::string DescribeDType(const nb::dlpack::dtype& t) {
  using Code = nb::dlpack::dtype_code;
  const std::pair<Code, const char*> kinds[] = {
      {Code::Int, "int"},       {Code::UInt, "uint"},       {Code::Float, "float"},
      {Code::Bfloat, "bfloat"}, {Code::Complex, "complex"}, {Code::Bool, "bool"}};
  std::string kind = "dlpack code " + std::to_string(t.code) + " of ";
  for (const auto& [code, name] : kinds) {
    if (t.code == static_cast<uint8_t>(code)) kind = name;
  }
  return kind + std::to_string(t.bits);
}

DType ToDType(const AnyArray& a, const std::string& what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && t.bits == 32 && t.code == uint8_t(nb::dlpack::dtype_code::Float))
    return DType::kFp32;
  if (t.lanes == 1 && t.bits == 16 && t.code == uint8_t(nb::dlpack::dtype_code::Float))
    return DType::kFp16;
  if (t.lanes == 1 && t.bits == 16 && t.code == uint8_t(nb::dlpack::dtype_code::Bfloat))
    return DType::kBf16;
  Fail(StatusCode::kInvalidArgument,
       what + " has dtype " + DescribeDType(t) + "; zoffload takes float32, bfloat16 or float16");
}

bool Contiguous(const AnyArray& a) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

const char* DeviceName(int type) {
  return type == nb::device::cpu::value    ? "cpu"
         : type == nb::device::cuda::value ? "cuda"
                                           : "another device";
}

// Checks `a` (named `what`) is dense, on `want_cuda`'s device and a supported dtype; its dtype.
DType CheckArray(const AnyArray& a, const std::string& what, bool want_cuda) {
  const int type = a.device_type();
  const bool cuda = type == nb::device::cuda::value;
  if (type != nb::device::cpu::value && !cuda) {
    Fail(StatusCode::kInvalidArgument,
         what + " is on " + DeviceName(type) + "; zoffload takes cpu or cuda memory");
  }
  if (cuda != want_cuda) {
    Fail(StatusCode::kInvalidArgument, what + " is on " + DeviceName(type) +
                                           ", but the engine's parameters are on " +
                                           (want_cuda ? "cuda" : "cpu"));
  }
  if (!Contiguous(a)) {
    Fail(StatusCode::kInvalidArgument,
         what + " is not contiguous; pass .contiguous() (zoffload reads it as one block)");
  }
  return ToDType(a, what);
}

// ---- the engine ---------------------------------------------------------------------------

ParamGroup GroupFrom(const nb::dict& d, const ParamGroup& base) {
  ParamGroup g = base;
  for (auto [key, value] : d) {
    const std::string k = nb::cast<std::string>(key);
    if (k == "lr") {
      g.lr = nb::cast<double>(value);
    } else if (k == "betas") {
      auto betas = nb::cast<std::tuple<double, double>>(value);
      g.beta1 = std::get<0>(betas);
      g.beta2 = std::get<1>(betas);
    } else if (k == "eps") {
      g.eps = nb::cast<double>(value);
    } else if (k == "weight_decay") {
      g.weight_decay = nb::cast<double>(value);
    }  // other keys (params, a scheduler's initial_lr, ...) are not the engine's
  }
  return g;  // the engine checks the values
}

nb::dict GroupDict(const ParamGroup& g) {
  nb::dict d;
  d["lr"] = g.lr;
  d["betas"] = nb::make_tuple(g.beta1, g.beta2);
  d["eps"] = g.eps;
  d["weight_decay"] = g.weight_decay;
  return d;
}

nb::dict StatsDict(const EngineStepStats& s) {
  nb::dict d;
  d["step"] = s.step;
  d["skipped"] = s.skipped;
  d["grad_norm"] = s.grad_norm;
  d["clip_coef"] = s.clip_coef;
  d["loss_scale"] = s.loss_scale;
  d["seconds"] = s.seconds;
  d["wait_grads_seconds"] = s.wait_grads_seconds;
  d["update_seconds"] = s.update_seconds;
  d["adam_seconds"] = s.adam_seconds;
  d["upload_wait_seconds"] = s.upload_wait_seconds;
  d["io_wait_seconds"] = s.io_wait_seconds;
  d["bytes_to_host"] = s.bytes_to_host;
  d["bytes_to_gpu"] = s.bytes_to_gpu;
  d["nvme_bytes_read"] = s.nvme_bytes_read;
  d["nvme_bytes_written"] = s.nvme_bytes_written;
  d["speculation"] = s.speculation;
  d["speculation_why"] = s.speculation_why;
  d["speculated_elements"] = s.speculated_elements;
  return d;
}

// A config parsed once (zoffload.torch builds its optimizer from it and reads its fields from
// `json`, the normalized text).
struct ParsedConfig {
  Config config;
  std::string json;  // every key written out
  static ParsedConfig Parse(const std::string& text, bool warn_unused) {
    ParseOptions options;
    options.warn_unused = warn_unused;
    ParsedConfig parsed{Unwrap(ParseConfig(text, options), /*from_config=*/true), ""};
    parsed.json = SerializeConfig(parsed.config);
    return parsed;
  }
};

// `bytes` of an optimizer's own memory at `buffer` as a uint8 array, or None for null. The
// array shares the optimizer's ownership: after close() it still points at live memory, which
// goes when the last such array does.
template <typename T>
nb::object BytesOf(void* buffer, uint64_t bytes, std::shared_ptr<T> owner) {
  if (buffer == nullptr) return nb::none();
  auto* keep = new std::shared_ptr<T>(std::move(owner));
  nb::capsule capsule(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<T>*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(buffer, {bytes}, capsule));
}

using Params = std::vector<std::tuple<std::string, AnyArray, int>>;

// What Engine and Zero keep of the parameters they were given: each one's size and dtype (what
// is handed over later is checked against them), and the arrays the optimizer writes into.
class Registered {
 protected:
  // The specs of `params` (each array checked: on cuda or in host memory, as `cuda` says),
  // remembered; `hold`: the optimizer writes into the arrays, which then live as long as this.
  std::vector<ParameterSpec> Register(const Params& params, bool cuda, bool hold) {
    std::vector<ParameterSpec> specs;
    for (const auto& [name, array, group] : params) {
      ParameterSpec s;
      s.name = name;
      s.dtype = CheckArray(array, "parameter '" + name + "'", cuda);
      s.data = array.data();
      s.elements = array.size();
      for (size_t d = 0; d < array.ndim(); ++d) s.shape.push_back(array.shape(d));
      s.group = group;
      elements_.emplace(name, std::make_pair(array.size(), s.dtype));
      specs.push_back(std::move(s));
      if (hold) held_.push_back(array);
    }
    return specs;
  }
  std::pair<uint64_t, DType> Lookup(const std::string& name, const std::string& who) const {
    auto it = elements_.find(name);
    if (it == elements_.end()) Fail(StatusCode::kNotFound, who + ": no parameter '" + name + "'");
    return it->second;
  }

 private:
  std::unordered_map<std::string, std::pair<uint64_t, DType>> elements_;
  std::vector<AnyArray> held_;
};

class Engine : Registered {
 public:
  // params: (name, array, group index) each; groups: torch-style dicts.
  // From load_config's normalized text (the unused keys were warned about when the user's
  // config was parsed).
  Engine(const std::string& config_json, const Params& params, const std::vector<nb::dict>& groups)
      : Engine(ParsedConfig::Parse(config_json, false), params, groups) {}
  Engine(const ParsedConfig& parsed, const Params& params, const std::vector<nb::dict>& groups) {
    config_ = parsed.config;
    if (params.empty()) Fail(StatusCode::kInvalidArgument, "engine: no parameters given");
    const bool cuda = std::get<1>(params.front()).device_type() == nb::device::cuda::value;
    std::vector<ParameterSpec> specs = Register(params, cuda, true);
    EngineOptions options;
    options.host_params = !cuda;
    options.require_gpu = cuda;
    const ParamGroup base = ParamGroup::FromConfig(config_.optimizer);
    for (const nb::dict& g : groups) options.groups.push_back(GroupFrom(g, base));
    cuda_ = cuda;
    nb::gil_scoped_release release;
    engine_ = Unwrap(OffloadEngine::Create(config_, std::move(specs), std::move(options)));
  }

  void GradientReady(const std::string& name, const AnyArray& grad, uintptr_t stream) {
    OffloadEngine& e = Live();
    // The engine checks the name, size and dtype; device and layout are visible only here.
    const DType dtype = CheckArray(grad, "the gradient of '" + name + "'", cuda_);
    nb::gil_scoped_release release;
    Check(e.GradientReady(name, grad.data(), grad.size(), dtype, reinterpret_cast<void*>(stream)));
  }

  nb::dict Step() {
    OffloadEngine& e = Live();
    EngineStepStats stats;
    {
      nb::gil_scoped_release release;
      stats = Unwrap(e.Step());
    }
    return StatsDict(stats);
  }

  void WaitParameters(uintptr_t stream) {
    OffloadEngine& e = Live();
    nb::gil_scoped_release release;
    Check(e.WaitParameters(reinterpret_cast<void*>(stream)));
  }

  void Flush(uintptr_t stream) {
    OffloadEngine& e = Live();
    nb::gil_scoped_release release;
    Check(e.Flush(reinterpret_cast<void*>(stream)));
  }

  void Save(const std::filesystem::path& dir) {
    OffloadEngine& e = Live();
    nb::gil_scoped_release release;
    Check(e.Save(dir.string()));
  }

  void Load(const std::filesystem::path& dir) {
    OffloadEngine& e = Live();
    nb::gil_scoped_release release;
    Check(e.Load(dir.string()));
  }

  double GradientNorm() {
    OffloadEngine& e = Live();
    nb::gil_scoped_release release;
    return Unwrap(e.GradientNorm());
  }

  void SetGradientClipping(double max_norm) { Check(Live().SetGradientClipping(max_norm)); }

  void SetGroup(int index, const nb::dict& group) {
    OffloadEngine& e = Live();
    if (index < 0 || index >= e.group_count()) {
      Fail(StatusCode::kOutOfRange, "engine: no parameter group " + std::to_string(index) +
                                        " (there are " + std::to_string(e.group_count()) + ")");
    }
    Check(e.SetGroup(index, GroupFrom(group, e.group(index))));
  }

  nb::dict Group(int index) {
    OffloadEngine& e = Live();
    if (index < 0 || index >= e.group_count()) {
      Fail(StatusCode::kOutOfRange, "engine: no parameter group " + std::to_string(index));
    }
    return GroupDict(e.group(index));
  }

  // (master float32[n], m, v): m and v as the state keeps them (float32 for fp32 state; the raw
  // bytes, uint8, for bf16 and int8 state).
  nb::tuple ReadState(const std::string& name) {
    OffloadEngine& e = Live();
    const uint64_t n = Lookup(name).first;
    const StatePrecision p = config_.zoffload.optimizer_state;
    const uint64_t moment_bytes = AdamMomentBytes(p, n);
    auto master = std::make_unique<float[]>(n);
    auto m = std::make_unique<uint8_t[]>(moment_bytes);
    auto v = std::make_unique<uint8_t[]>(moment_bytes);
    {
      nb::gil_scoped_release release;
      Check(e.ReadState(name, master.get(), m.get(), v.get()));
    }
    auto own = [](auto ptr) {
      using T = typename decltype(ptr)::element_type;
      T* raw = ptr.release();
      return std::make_pair(
          raw, nb::capsule(raw, [](void* q) noexcept { delete[] static_cast<T*>(q); }));
    };
    auto [mp, mo] = own(std::move(master));
    auto [mm, mmo] = own(std::move(m));
    auto [vm, vmo] = own(std::move(v));
    auto out_master = nb::ndarray<nb::numpy, float, nb::ndim<1>>(mp, {n}, mo);
    if (p == StatePrecision::kFp32) {
      return nb::make_tuple(
          out_master,
          nb::ndarray<nb::numpy, float, nb::ndim<1>>(reinterpret_cast<float*>(mm), {n}, mmo),
          nb::ndarray<nb::numpy, float, nb::ndim<1>>(reinterpret_cast<float*>(vm), {n}, vmo));
    }
    return nb::make_tuple(out_master,
                          nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(mm, {moment_bytes}, mmo),
                          nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(vm, {moment_bytes}, vmo));
  }

  // Restores a parameter's state from read_state's arrays (host memory).
  void LoadState(const std::string& name, const AnyArray& master, const AnyArray& m,
                 const AnyArray& v) {
    OffloadEngine& e = Live();
    const uint64_t n = Lookup(name).first;
    const uint64_t moment_bytes = AdamMomentBytes(config_.zoffload.optimizer_state, n);
    auto check = [&](const AnyArray& a, const char* which, uint64_t bytes) {
      const std::string what = std::string(which) + " of '" + name + "'";
      if (a.device_type() != nb::device::cpu::value || !Contiguous(a)) {
        Fail(StatusCode::kInvalidArgument, what + " must be contiguous host memory");
      }
      if (a.nbytes() != bytes) {
        Fail(StatusCode::kInvalidArgument, what + " has " + std::to_string(a.nbytes()) +
                                               " bytes; the state has " + std::to_string(bytes));
      }
    };
    check(master, "the master", 4 * n);
    if (ToDType(master, "the master of '" + name + "'") != DType::kFp32 || master.size() != n) {
      Fail(StatusCode::kInvalidArgument,
           "the master of '" + name + "' must be " + std::to_string(n) + " float32 elements");
    }
    // Moments: float32 of n elements for fp32 state, else the state's raw bytes (uint8). A
    // float64 array of n/2 elements has the right byte count and the wrong values.
    const bool fp32 = config_.zoffload.optimizer_state == StatePrecision::kFp32;
    for (const auto& [a, which] : {std::pair{&m, "m"}, std::pair{&v, "v"}}) {
      check(*a, which, moment_bytes);
      const nb::dlpack::dtype t = a->dtype();
      const bool right = fp32 ? (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32)
                              : (t.code == uint8_t(nb::dlpack::dtype_code::UInt) && t.bits == 8);
      if (!right || t.lanes != 1) {
        Fail(StatusCode::kInvalidArgument,
             std::string(which) + " of '" + name + "' has dtype " + DescribeDType(t) + "; " +
                 (fp32 ? "fp32 state takes float32"
                       : "bf16 and int8 state take its raw bytes (uint8)"));
      }
    }
    nb::gil_scoped_release release;
    Check(e.LoadState(name, static_cast<const float*>(master.data()), m.data(), v.data()));
  }

  // The engine's own memory for a gradient (host mode), as bytes, or None; the array keeps
  // this object alive, and must not be used after close().
  nb::object GradientBuffer(const std::string& name) {
    OffloadEngine& e = Live();
    const auto [n, dtype] = Lookup(name);
    return BytesOf(Unwrap(e.GradientBuffer(name)), n * DTypeBytes(dtype), engine_);
  }

  void set_steps(int64_t steps) { Check(Live().SetSteps(steps)); }

  void Close() {
    nb::gil_scoped_release release;
    engine_.reset();
  }

  float loss_scale() { return Live().loss_scale(); }
  int64_t steps() { return Live().steps(); }
  bool on_gpu() { return Live().on_gpu(); }
  uint64_t total_elements() { return Live().total_elements(); }
  uint64_t host_bytes() { return Live().host_bytes(); }
  uint64_t gpu_bytes() { return Live().gpu_bytes(); }
  int group_count() { return Live().group_count(); }
  nb::dict last_step() { return StatsDict(Live().last_step()); }

 private:
  std::pair<uint64_t, DType> Lookup(const std::string& name) const {
    return Registered::Lookup(name, "engine");
  }
  OffloadEngine& Live() {
    if (engine_ == nullptr) Fail(StatusCode::kFailedPrecondition, "engine: closed");
    return *engine_;
  }

  Config config_;
  bool cuda_ = false;
  std::shared_ptr<OffloadEngine> engine_;  // shared with gradient_buffer's arrays
};

// One rank's ZeRO stage 1-3 optimizer (include/zoffload/zero.h; host parameters);
// zoffload.torch makes it under torch.distributed.
class Zero : Registered {
 public:
  Zero(const ParsedConfig& parsed, const Params& params, const std::vector<nb::dict>& groups,
       const std::string& run, int rank, int world, const std::string& nccl_id, int device) {
    const Config& config = parsed.config;
    if (params.empty()) Fail(StatusCode::kInvalidArgument, "ZeRO: no parameters given");
    for (const auto& [name, array, group] : params) {
      if (array.device_type() == nb::device::cuda::value) {
        Fail(StatusCode::kUnimplemented,
             "parameter '" + name +
                 "' is on cuda: Zero takes host (cpu) arrays; zoffload.torch hands GPU "
                 "parameters over through host memory");
      }
    }
    // Stages 1-2: step() writes into the arrays; stage 3 reads them once.
    std::vector<ParameterSpec> specs = Register(params, false, config.zero_optimization.stage < 3);
    ZeroOptions options;
    const ParamGroup base = ParamGroup::FromConfig(config.optimizer);
    for (const nb::dict& g : groups) options.groups.push_back(GroupFrom(g, base));
    ZeroRank me;
    me.rank = rank;
    me.world = world;
    me.run = run;
    me.nccl_id = nccl_id;
    me.device = device;
    nb::gil_scoped_release release;
    zero_ = Unwrap(ZeroOptimizer::Create(config, std::move(specs), me, std::move(options)));
  }

  // As Engine.GradientBuffer.
  nb::object GradientBuffer(const std::string& name) {
    ZeroOptimizer& z = Live();
    const auto [n, dtype] = Lookup(name);
    return BytesOf(Unwrap(z.GradientBuffer(name)), n * DTypeBytes(dtype), zero_);
  }

  void GradientReady(const std::string& name, const AnyArray& grad) {
    ZeroOptimizer& z = Live();
    const DType dtype = CheckArray(grad, "the gradient of '" + name + "'", false);
    nb::gil_scoped_release release;
    Check(z.GradientReady(name, grad.data(), grad.size(), dtype));
  }

  nb::dict Step() {
    ZeroOptimizer& z = Live();
    EngineStepStats stats;
    {
      nb::gil_scoped_release release;
      stats = Unwrap(z.Step());
    }
    return StatsDict(stats);
  }

  // The parameter's current values into `out` (cpu, its size and dtype).
  void Gather(const std::string& name, const AnyArray& out) {
    ZeroOptimizer& z = Live();
    const auto [n, dtype] = Lookup(name);
    const std::string what = "the output for '" + name + "'";
    if (CheckArray(out, what, false) != dtype || out.size() != n) {
      Fail(StatusCode::kInvalidArgument, what + " must hold " + std::to_string(n) + " " +
                                             std::string(ToString(dtype)) + " elements");
    }
    nb::gil_scoped_release release;
    Check(z.GatherParameter(name, out.data()));
  }

  nb::ndarray<nb::numpy, float, nb::ndim<1>> Master(const std::string& name) {
    ZeroOptimizer& z = Live();
    const uint64_t n = Lookup(name).first;
    auto* master = new float[n];
    nb::capsule owner(master, [](void* q) noexcept { delete[] static_cast<float*>(q); });
    {
      nb::gil_scoped_release release;
      Check(z.GatherMaster(name, master));
    }
    return nb::ndarray<nb::numpy, float, nb::ndim<1>>(master, {n}, owner);
  }

  void Save(const std::filesystem::path& dir) {
    ZeroOptimizer& z = Live();
    nb::gil_scoped_release release;
    Check(z.Save(dir.string()));
  }

  void Load(const std::filesystem::path& dir) {
    ZeroOptimizer& z = Live();
    nb::gil_scoped_release release;
    Check(z.Load(dir.string()));
  }

  nb::dict Group(int index) {
    ZeroOptimizer& z = Live();
    if (index < 0 || index >= z.group_count()) {
      Fail(StatusCode::kOutOfRange, "ZeRO: no parameter group " + std::to_string(index));
    }
    return GroupDict(z.group(index));
  }

  void SetGroup(int index, const nb::dict& group) {
    ZeroOptimizer& z = Live();
    if (index < 0 || index >= z.group_count()) {
      Fail(StatusCode::kOutOfRange, "ZeRO: no parameter group " + std::to_string(index));
    }
    Check(z.SetGroup(index, GroupFrom(group, z.group(index))));
  }

  void Close() {
    nb::gil_scoped_release release;
    zero_.reset();
  }

  int stage() { return Live().stage(); }
  int64_t steps() { return Live().steps(); }
  float loss_scale() { return Live().loss_scale(); }
  uint64_t partition_elements() { return Live().partition_elements(); }
  uint64_t owned_elements() { return Live().owned_elements(); }

 private:
  std::pair<uint64_t, DType> Lookup(const std::string& name) const {
    return Registered::Lookup(name, "ZeRO");
  }
  ZeroOptimizer& Live() {
    if (zero_ == nullptr) Fail(StatusCode::kFailedPrecondition, "ZeRO: closed");
    return *zero_;
  }

  std::shared_ptr<ZeroOptimizer> zero_;  // shared with gradient_buffer's arrays
};

void DefineModule(nb::module_& m) {
  m.doc() = "zoffload's C++ engine (use zoffload and zoffload.torch).";
  MakeExceptions(m);

  m.def(
      "read_config_json",
      [](const std::string& source, bool is_file) {
        return Unwrap(ReadConfigJson(source, is_file), /*from_config=*/true);
      },
      nb::arg("source"), nb::arg("is_file"),
      "A config's JSON as the C++ parser reads it (is_file: source is a path, read only if it "
      "is a regular file of at most 16 MiB; else the JSON text): strict (duplicate keys, "
      "nesting, numbers that would change), returned as compact JSON text.");
  nb::class_<ParsedConfig>(m, "ParsedConfig",
                           "A config parsed and validated once (parse_config_object), for "
                           "Engine and Zero.")
      .def_ro("json", &ParsedConfig::json, "The config normalized, every field filled.");
  m.def(
      "parse_config_object",
      [](const std::string& json) { return ParsedConfig::Parse(json, true); }, nb::arg("json"),
      "Parses and validates a config (JSON text) once. Raises ConfigError naming the JSON path "
      "at fault.");
  m.def(
      "parse_config", [](const std::string& json) { return ParsedConfig::Parse(json, true).json; },
      nb::arg("json"),
      "Parses and validates a config (JSON text); returns it normalized, every field filled.\n"
      "Raises ConfigError naming the JSON path at fault.");
  m.def(
      "export_safetensors",
      [](const std::filesystem::path& checkpoint, const std::filesystem::path& out,
         bool overwrite) {
        nb::gil_scoped_release release;
        Check(ExportSafetensors(checkpoint.string(), out.string(), overwrite));
      },
      nb::arg("checkpoint"), nb::arg("out"), nb::arg("overwrite") = false,
      "Writes the fp32 master weights of a checkpoint (Engine.save / OffloadOptimizer.save) to "
      "`out` as safetensors, named and shaped as the parameters were registered: the file "
      "safetensors.torch.load_file and transformers' from_pretrained read. Each parameter is "
      "verified against its checksum first; the file appears whole or not at all. Raises "
      "AlreadyExists if `out` exists and not `overwrite`.");
  nb::class_<Engine>(m, "Engine",
                     "The OffloadEngine: fp32 masters and Adam state off the GPU, updated on "
                     "the CPU from gradients handed over as they are produced.")
      .def(nb::init<const ParsedConfig&, const Params&, const std::vector<nb::dict>&>(),
           nb::arg("config"), nb::arg("params"), nb::arg("groups"),
           "As below, from a config parsed once (parse_config_object).")
      .def(nb::init<const std::string&, const Params&, const std::vector<nb::dict>&>(),
           nb::arg("config_json"), nb::arg("params"), nb::arg("groups"),
           "params: (name, array, group index) each, all on cuda (GPU mode) or all on cpu (host "
           "mode), contiguous float32/bfloat16/float16; groups: dicts with lr, betas, eps, "
           "weight_decay (missing keys: the config's optimizer.params). The arrays must stay "
           "alive while the engine is.")
      .def("gradient_ready", &Engine::GradientReady, nb::arg("name"), nb::arg("grad"),
           nb::arg("stream") = 0,
           "Hands over a parameter's gradient (its size, on its device), ordered after the work "
           "on `stream` (a cudaStream_t as int; 0: the default stream). The gradient may be "
           "freed once this returns.")
      .def("gradient_buffer", &Engine::GradientBuffer, nb::arg("name"),
           "Host mode: the engine's own memory for the parameter's gradient (uint8, pinned when "
           "a GPU is present), or None where the engine cannot take a gradient in place (GPU "
           "mode, gradient accumulation, overlap \"delayed\"). Write the gradient there between "
           "step() and gradient_ready(name, that memory viewed as the gradient): the engine then "
           "takes it without a copy. Not to be used after close().")
      .def("step", &Engine::Step,
           "The optimizer step; returns its statistics (phase times, bytes moved, grad norm, "
           "loss scale, skipped).")
      .def("wait_parameters", &Engine::WaitParameters, nb::arg("stream") = 0,
           "Makes `stream` wait (on the GPU) for the updated parameters.")
      .def("flush", &Engine::Flush, nb::arg("stream") = 0,
           "Overlap \"delayed\": waits for the update still running and sends its values to "
           "the model after the work on `stream`, so the parameters are the last step's. A "
           "no-op in the other modes.")
      .def("save", &Engine::Save, nb::arg("dir"),
           "Writes a checkpoint into directory `dir`, atomically (masters, moments, step "
           "count, loss scale, groups; CRC32C per parameter). Between steps.")
      .def("load", &Engine::Load, nb::arg("dir"),
           "Restores a checkpoint written by save for the same parameters; checksums are "
           "verified before anything changes. Call wait_parameters before the next forward.")
      .def("set_group", &Engine::SetGroup, nb::arg("index"), nb::arg("group"),
           "Changes a group's lr, betas, eps or weight_decay from the next step on.")
      .def("gradient_norm", &Engine::GradientNorm,
           "Overlap \"none\": the global L2 norm of this step's gradients (all handed over), "
           "unscaled by the fp16 loss scale; step() reuses it.")
      .def("set_gradient_clipping", &Engine::SetGradientClipping, nb::arg("max_norm"),
           "The max norm step() clips the global gradient norm to (0: none), from the next "
           "step on.")
      .def("group", &Engine::Group, nb::arg("index"), "A group's hyperparameters.")
      .def("read_state", &Engine::ReadState, nb::arg("name"),
           "(master float32, m, v) of a parameter; m and v are float32 for fp32 state, raw "
           "bytes (uint8) for bf16 and int8 state.")
      .def("load_state", &Engine::LoadState, nb::arg("name"), nb::arg("master"), nb::arg("m"),
           nb::arg("v"),
           "Restores a parameter's state from read_state's arrays and writes the master, in the "
           "parameter's dtype, into the parameter (call wait_parameters before using it).")
      .def("close", &Engine::Close, "Frees the engine's memory now.")
      .def_prop_ro("loss_scale", &Engine::loss_scale,
                   "The fp16 loss scale to multiply the loss by (1 without fp16).")
      .def_prop_rw("steps", &Engine::steps, &Engine::set_steps,
                   "Optimizer steps taken (skipped ones not counted); settable when restoring.")
      .def_prop_ro("on_gpu", &Engine::on_gpu, "Whether parameters are in GPU memory.")
      .def_prop_ro("total_elements", &Engine::total_elements)
      .def_prop_ro("host_bytes", &Engine::host_bytes, "Host bytes the engine holds.")
      .def_prop_ro("gpu_bytes", &Engine::gpu_bytes,
                   "Device bytes the engine holds beyond the parameters.")
      .def_prop_ro("group_count", &Engine::group_count)
      .def_prop_ro("last_step", &Engine::last_step, "The last step's statistics.");
  m.def(
      "new_nccl_id", [] { return Unwrap(ZeroRank::NewNcclId()); },
      "A new NCCL unique id (hex) for Zero(nccl_id=...): made on one rank, handed to all.");
  nb::class_<Zero>(m, "Zero",
                   "One rank's ZeRO stage 1-3 optimizer over the host shared-memory backend or "
                   "NCCL: "
                   "this rank's partition of the optimizer state (and at stage 3 of the "
                   "parameters), gradients reduce-scattered, parameters all-gathered. Every "
                   "rank makes the same calls in the same order.")
      .def(nb::init<const ParsedConfig&, const Params&, const std::vector<nb::dict>&,
                    const std::string&, int, int, const std::string&, int>(),
           nb::arg("config"), nb::arg("params"), nb::arg("groups"), nb::arg("run"), nb::arg("rank"),
           nb::arg("world"), nb::arg("nccl_id") = "", nb::arg("device") = 0,
           "params: (name, cpu array, group index) each, one dtype for all; at stages 1-2 the "
           "arrays are updated in place by step() and must stay alive, at stage 3 they are read "
           "here only. run: the run's name, the same on every rank and unique per run (letters, "
           "digits, '.', '_', '-'; the shared-memory segment is named after it). A rank that does "
           "not arrive within the config's zoffload.comm_timeout_seconds (or whose process dies) "
           "makes the others fail, naming it. nccl_id (new_nccl_id on one rank, the same on all): "
           "the "
           "collectives run over NCCL on CUDA device `device` instead of shared memory.")
      .def("gradient_buffer", &Zero::GradientBuffer, nb::arg("name"),
           "One rank, one micro-batch, stages 2-3: the optimizer's own memory for the "
           "parameter's gradient (uint8, pinned when a GPU is present), or None; as "
           "Engine.gradient_buffer.")
      .def("gradient_ready", &Zero::GradientReady, nb::arg("name"), nb::arg("grad"),
           "This micro-batch's gradient of a parameter (collective at stages 2-3: buckets are "
           "reduce-scattered as they fill).")
      .def("step", &Zero::Step, "The optimizer step (collective); returns its statistics.")
      .def("gather", &Zero::Gather, nb::arg("name"), nb::arg("out"),
           "The parameter's current values into `out` (cpu, its size and dtype; collective).")
      .def("master", &Zero::Master, nb::arg("name"),
           "The parameter's fp32 master values (collective).")
      .def("set_group", &Zero::SetGroup, nb::arg("index"), nb::arg("group"),
           "Changes a group's lr, betas, eps or weight_decay from the next step on.")
      .def("group", &Zero::Group, nb::arg("index"), "A group's hyperparameters.")
      .def("save", &Zero::Save, nb::arg("dir"),
           "Writes a checkpoint (collective; rank 0 writes Engine.save's format with whole "
           "parameters, loadable at any world size and by the Engine). fp32 or bf16 state.")
      .def("load", &Zero::Load, nb::arg("dir"),
           "Restores a checkpoint saved at any world size, or by the Engine (collective; every "
           "rank verifies every checksum before anything changes).")
      .def("close", &Zero::Close, "Frees the optimizer's memory and the shared segment now.")
      .def_prop_ro("stage", &Zero::stage)
      .def_prop_ro("steps", &Zero::steps, "Optimizer steps taken (skipped ones not counted).")
      .def_prop_ro("loss_scale", &Zero::loss_scale,
                   "The fp16 loss scale to multiply the loss by (1 without fp16).")
      .def_prop_ro("partition_elements", &Zero::partition_elements,
                   "This rank's partition (padding included; the same on every rank).")
      .def_prop_ro("owned_elements", &Zero::owned_elements,
                   "The elements whose optimizer state this rank holds.");
}

}  // namespace
}  // namespace zoffload::python

NB_MODULE(_zoffload, m) { zoffload::python::DefineModule(m); }
