// Status from system-call failures, minding the sign convention of each API.
//
// libc returns -1 and sets a positive `errno`; liburing (and cqe->res) return `-errno`.
// Mixing them up turns ENOSPC into a generic error, so each helper asserts its sign.
#pragma once

#include <string_view>

#include "zoffload/status.h"

namespace zoffload::internal {

/// Status for a libc failure: `err` is the positive errno. `context` says what was being
/// done to what ("open /mnt/nvme/x.swp").
Status StatusFromErrno(int err, std::string_view context);

/// Status for a liburing/io_uring failure: `res` is the negative return or cqe->res.
Status StatusFromUringRes(int res, std::string_view context);

/// The code an errno maps to (ENOENT -> kNotFound, ENOSPC -> kResourceExhausted, ...).
StatusCode StatusCodeFromErrno(int err);

}  // namespace zoffload::internal
