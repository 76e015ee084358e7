#include "report_verdicts.h"

#include <cstdint>

#include "common/strings.h"

namespace zoffload::internal {
namespace {

using Json = nlohmann::ordered_json;

// Enough locked memory for zoffload's pinned buffers in host mode and io_uring's registered
// buffers on older kernels: below it, pinning falls back or fails.
constexpr uint64_t kMemlockEnough = uint64_t{1} << 30;

std::string Text(const Json& j, const char* key, const std::string& fallback = "") {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : fallback;
}

// "8.00 MiB (8388608 bytes)" -> 8388608; "unlimited" -> max.
uint64_t LimitBytes(const std::string& text) {
  if (text == "unlimited") return UINT64_MAX;
  const size_t open = text.find('(');
  return open == std::string::npos ? 0 : std::strtoull(text.c_str() + open + 1, nullptr, 10);
}

}  // namespace

std::vector<Verdict> Verdicts(const Json& r) {
  std::vector<Verdict> out;
  // CPU Adam.
  const std::string simd = r.contains("simd") ? Text(r["simd"], "dispatch_target") : "";
  const int threads = r.contains("openmp") ? r["openmp"].value("max_threads", 0) : 0;
  if (simd == "SCALAR" || simd.empty()) {
    out.push_back({"CPU Adam", "limited", "no SIMD instruction set found: scalar code",
                   "run on an x86-64 CPU with AVX2 or AVX-512 (Adam runs several times faster)"});
  } else {
    out.push_back({"CPU Adam", "ready", StrCat(simd, ", ", threads, " threads"), ""});
  }
  // NVMe offload, per path.
  const bool uring = r.contains("io_uring") && r["io_uring"].value("usable", false);
  if (r.contains("paths")) {
    for (const Json& p : r["paths"]) {
      const std::string path = Text(p, "path", "?");
      const std::string component = StrCat("NVMe offload at ", path);
      if (p.contains("error")) {
        out.push_back({component, "missing", Text(p, "error"),
                       "give an existing, writable directory on a local disk (--path)"});
      } else if (!p.value("o_direct", false)) {
        out.push_back({component, "limited",
                       StrCat("O_DIRECT refused (", Text(p, "refusal", "unsupported"),
                              "): every byte also goes through the page cache"),
                       "put nvme_path on a local disk file system (ext4, xfs), not tmpfs or a "
                       "network mount"});
      } else if (!uring) {
        out.push_back({component, "limited",
                       StrCat("O_DIRECT on ", Text(p, "block_device", "?"),
                              ", but io_uring is unusable: the slower POSIX thread pool is used"),
                       "allow io_uring (sysctl kernel.io_uring_disabled=0; a container's seccomp "
                       "profile may block it)"});
      } else {
        out.push_back({component, "ready",
                       StrCat("io_uring, O_DIRECT on ", Text(p, "block_device", "?")), ""});
      }
    }
  }
  // Locked memory.
  if (r.contains("memlock")) {
    const std::string soft = Text(r["memlock"], "soft");
    const uint64_t bytes = LimitBytes(soft);
    if (bytes >= kMemlockEnough) {
      out.push_back({"pinned memory", "ready", StrCat("memlock limit ", soft), ""});
    } else {
      out.push_back({"pinned memory", "limited", StrCat("memlock limit ", soft),
                     "raise it: `ulimit -l unlimited` in the shell that trains, or memlock in "
                     "/etc/security/limits.conf (docker: --ulimit memlock=-1)"});
    }
  }
  // GPU and NCCL.
  if (r.contains("cuda")) {
    const Json& c = r["cuda"];
    if (!c.value("built", false)) {
      out.push_back({"GPU", "missing", "this build has no CUDA",
                     "rebuild with the CUDA toolkit installed (nvcc on PATH); host mode works "
                     "meanwhile"});
    } else if (!c.contains("gpus") || !c["gpus"].is_array() || c["gpus"].empty()) {
      std::string why = Text(c, "error", "no GPU found");
      std::string action = "train in host mode, or run on a machine with an NVIDIA GPU";
      if (const size_t colon = why.rfind(": "); why.starts_with("no usable GPU: ") &&
                                                colon != std::string::npos &&
                                                colon > std::string("no usable GPU").size()) {
        action = why.substr(colon + 2);  // the message's own advice
        why = why.substr(0, colon);
      }
      if (why.starts_with("no usable GPU: ")) why = why.substr(15);
      out.push_back({"GPU", "missing", why, action});
    } else {
      const Json& g = c["gpus"][0];
      out.push_back({"GPU", "ready",
                     StrCat(c["gpus"].size(), " x ", Text(g, "name", "GPU"), ", ",
                            Text(g, "memory"), ", ", Text(g, "pcie_link", "PCIe link unknown")),
                     ""});
    }
    const std::string nccl = Text(c, "nccl_version");
    const bool gpus = c.contains("gpus") && c["gpus"].is_array() && !c["gpus"].empty();
    if (c.value("built", false) && !nccl.empty() && std::isdigit(nccl[0])) {
      if (gpus) {
        out.push_back({"NCCL (ZeRO across GPUs)", "ready", StrCat("NCCL ", nccl), ""});
      } else {
        out.push_back({"NCCL (ZeRO across GPUs)", "missing",
                       StrCat("NCCL ", nccl, " loads, but there is no usable GPU"), "see GPU"});
      }
    } else {
      out.push_back({"NCCL (ZeRO across GPUs)", "missing",
                     nccl.empty() ? "not built with CUDA" : nccl,
                     nccl.empty() ? "install the CUDA toolkit (with NCCL) and rebuild"
                                  : "make libnccl.so.2 loadable (LD_LIBRARY_PATH; torch's "
                                    "wheel brings one)"});
    }
  }
  return out;
}

std::string FormatVerdict(const Verdict& v, bool color) {
  const char* paint = v.status == "ready"     ? "\x1b[32m"
                      : v.status == "limited" ? "\x1b[33m"
                                              : "\x1b[31m";
  std::string status = v.status;
  status.resize(8, ' ');
  if (color) status = StrCat(paint, status, "\x1b[0m");
  return StrCat("  ", status, " ", v.component, ": ", v.detail,
                v.action.empty() ? "" : StrCat(" — ", v.action));
}

Json ToJson(const std::vector<Verdict>& verdicts) {
  Json list = Json::array();
  for (const Verdict& v : verdicts) {
    list.push_back({{"component", v.component},
                    {"status", v.status},
                    {"detail", v.detail},
                    {"action", v.action}});
  }
  return list;
}

}  // namespace zoffload::internal
