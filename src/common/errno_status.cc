#include "common/errno_status.h"

#include <cerrno>
#include <cstring>

#include "common/strings.h"

namespace zoffload::internal {

StatusCode StatusCodeFromErrno(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR:
    case ENODEV:
    case ENXIO:
      return StatusCode::kNotFound;
    case EEXIST:
      return StatusCode::kAlreadyExists;
    case EACCES:
    case EPERM:
    case EROFS:
      return StatusCode::kPermissionDenied;
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EFBIG:
    case EMFILE:
    case ENFILE:
      return StatusCode::kResourceExhausted;
    case EINVAL:
    case EBADF:
    case ENAMETOOLONG:
    case EISDIR:
      return StatusCode::kInvalidArgument;
    case EAGAIN:
    case EINTR:
    case EBUSY:
    case ETIMEDOUT:
      return StatusCode::kUnavailable;
    case ENOSYS:
    case EOPNOTSUPP:
    case ENOTTY:
      return StatusCode::kUnimplemented;
    case ECANCELED:
      return StatusCode::kCancelled;
    case EIO:
    case ENOLINK:
    case EREMOTEIO:
      return StatusCode::kIoError;
    default:
      return StatusCode::kInternal;
  }
}

Status StatusFromErrno(int err, std::string_view context) {
  assert(err > 0 && "StatusFromErrno takes a positive errno; use StatusFromUringRes for -errno");
  if (err <= 0) {
    return InternalError(StrCat(context, ": bad errno sign (", err, ") passed to StatusFromErrno"));
  }
  const char* name = strerrorname_np(err);
  std::string message = StrCat(context, ": ", std::strerror(err), " (", name ? name : "?", ")");
  if (err == ENOSPC || err == EDQUOT) message += " — disk full";
  const StatusCode code = StatusCodeFromErrno(err);
  return Status(code, std::move(message), err, code == StatusCode::kUnavailable);
}

Status StatusFromUringRes(int res, std::string_view context) {
  assert(res < 0 && "StatusFromUringRes takes a negative -errno result");
  if (res >= 0) {
    return InternalError(
        StrCat(context, ": bad result sign (", res, ") passed to StatusFromUringRes"));
  }
  return StatusFromErrno(-res, context);
}

}  // namespace zoffload::internal
