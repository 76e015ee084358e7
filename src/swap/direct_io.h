// O_DIRECT support and alignment of the file system under a directory.
//
// The NVMe tier needs the device's logical block size (never assumed to be 512): buffers,
// offsets and lengths of O_DIRECT requests must be multiples of it. The answer comes from
// statx(STATX_DIOALIGN) where the kernel has it, else from the block device in sysfs, and is
// always confirmed by a real O_DIRECT write and read of one block in a scratch file.
#pragma once

#include <cstdint>
#include <string>

#include "zoffload/status.h"

namespace zoffload::internal {

struct DirectIoInfo {
  bool supported = false;         ///< O_DIRECT open, write and read all worked
  uint32_t offset_alignment = 0;  ///< bytes; file offsets and lengths are multiples of this
  uint32_t memory_alignment = 0;  ///< bytes; buffer addresses are multiples of this
  std::string source;             ///< "statx", "sysfs" or "probe"
  std::string refusal;            ///< why O_DIRECT is not usable, when !supported
};

/// Probes `dir` with a scratch file (removed before returning). Errors: the directory is
/// missing (NOT_FOUND), not writable (PERMISSION_DENIED) or full (RESOURCE_EXHAUSTED).
/// O_DIRECT being refused is not an error: `supported` is false and `refusal` says why.
Result<DirectIoInfo> ProbeDirectIo(const std::string& dir);

}  // namespace zoffload::internal
