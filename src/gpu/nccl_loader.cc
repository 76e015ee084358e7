// NCCL, loaded when first used: this file defines the NCCL functions zoffload calls, hidden
// inside libzoffload, each forwarding to the library found at its first call.
//
// 1. Nothing of NCCL is loaded when libzoffload is: a process that imports zoffload and then
//    torch (whose wheel brings a newer libnccl.so.2 and needs its newer symbols) gets torch's
//    NCCL, not the toolkit's one this build saw.
// 2. The first call looks, in order, for a libnccl.so.2 already in the process (torch's), the
//    one the loader finds (LD_LIBRARY_PATH, the system), and last the one this build was
//    compiled against (ZO_NCCL_LIBRARY). NCCL 2.x keeps its ABI, so any of them serves.
// 3. If none loads, every call returns ncclSystemError, and ncclGetLastError says what was
//    tried: a Status naming it, never an abort at load time.
//
// Thread-safety: the library is found once (a function-local static).
#include <dlfcn.h>

#include <string>

// The definitions below are hidden: torch (or anything loaded later) must never bind to them.
#pragma GCC visibility push(hidden)
#include <nccl.h>
#pragma GCC visibility pop

namespace {

struct Library {
  void* handle = nullptr;
  std::string error;  // what was tried, when nothing loaded
};

const Library& Nccl() {
  static const Library library = [] {
    Library l;
    l.handle = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (l.handle != nullptr) return l;
    l.handle = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (l.handle != nullptr) return l;
    l.error = std::string("NCCL could not be loaded: libnccl.so.2: ") + ::dlerror();
    l.handle = ::dlopen(ZO_NCCL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (l.handle == nullptr) l.error += std::string("; ") + ::dlerror();
    return l;
  }();
  return library;
}

void* Symbol(const char* name) {
  const Library& l = Nccl();
  return l.handle == nullptr ? nullptr : ::dlsym(l.handle, name);
}

}  // namespace

#define ZO_NCCL_FORWARD(name, params, args)                                  \
  ncclResult_t name params {                                                 \
    static const auto fn = reinterpret_cast<decltype(&name)>(Symbol(#name)); \
    return fn == nullptr ? ncclSystemError : fn args;                        \
  }

ZO_NCCL_FORWARD(ncclGetVersion, (int* version), (version))
ZO_NCCL_FORWARD(ncclGetUniqueId, (ncclUniqueId * id), (id))
ZO_NCCL_FORWARD(ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank),
                (comm, nranks, id, rank))
ZO_NCCL_FORWARD(ncclCommInitAll, (ncclComm_t * comm, int ndev, const int* devlist),
                (comm, ndev, devlist))
ZO_NCCL_FORWARD(ncclCommDestroy, (ncclComm_t comm), (comm))
ZO_NCCL_FORWARD(ncclCommAbort, (ncclComm_t comm), (comm))
ZO_NCCL_FORWARD(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t* error), (comm, error))
ZO_NCCL_FORWARD(ncclBroadcast,
                (const void* send, void* recv, size_t count, ncclDataType_t type, int root,
                 ncclComm_t comm, cudaStream_t stream),
                (send, recv, count, type, root, comm, stream))
// The reductions share one signature.
#define ZO_NCCL_REDUCTION(name)                                                     \
  ZO_NCCL_FORWARD(name,                                                             \
                  (const void* send, void* recv, size_t count, ncclDataType_t type, \
                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),           \
                  (send, recv, count, type, op, comm, stream))
ZO_NCCL_REDUCTION(ncclAllReduce)
ZO_NCCL_REDUCTION(ncclReduceScatter)
ZO_NCCL_FORWARD(ncclAllGather,
                (const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                 cudaStream_t stream),
                (send, recv, count, type, comm, stream))

const char* ncclGetErrorString(ncclResult_t result) {
  static const auto fn =
      reinterpret_cast<decltype(&ncclGetErrorString)>(Symbol("ncclGetErrorString"));
  return fn == nullptr ? "NCCL is not loaded" : fn(result);
}

const char* ncclGetLastError(ncclComm_t comm) {
  static const auto fn = reinterpret_cast<decltype(&ncclGetLastError)>(Symbol("ncclGetLastError"));
  return fn == nullptr ? Nccl().error.c_str() : fn(comm);
}
