// Errors as values: Status and Result<T>.
//
// Every fallible zoffload call returns a Status or a Result<T>; no exception crosses the
// public API. A Status carries a code, a message that names what failed (file, key, size),
// the errno it came from (0 when none) and whether retrying the same call may succeed.
//
// Thread-safety: Status and Result are values; distinct objects may be used from distinct
// threads, one object must not be mutated concurrently.
#pragma once

#include <cassert>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "zoffload/export.h"

ZO_API_BEGIN
namespace zoffload {

/// What kind of failure a Status reports.
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     ///< bad input from the caller (config, size, key)
  kNotFound,            ///< a file, directory, key or device does not exist
  kAlreadyExists,       ///< creating something that exists
  kPermissionDenied,    ///< EACCES, EPERM, EROFS, io_uring disabled by policy
  kResourceExhausted,   ///< disk full, out of memory, pinned-memory or byte budget hit
  kFailedPrecondition,  ///< the system is not in the state the call needs
  kOutOfRange,          ///< an offset or index past the end
  kUnimplemented,       ///< the kernel or device lacks a feature (ENOSYS, EOPNOTSUPP)
  kUnavailable,         ///< transient (EAGAIN, EINTR, EBUSY); see Status::retryable()
  kDataLoss,            ///< checksum mismatch, torn write, inconsistent manifest
  kIoError,             ///< EIO and other device errors
  kInternal,            ///< a broken invariant or an unexpected library failure
  kCancelled,           ///< the operation was abandoned by its owner
};

/// Short name of a code ("INVALID_ARGUMENT").
std::string_view StatusCodeName(StatusCode code);

/// The result of an operation that returns no value.
class [[nodiscard]] Status {
 public:
  /// OK.
  Status() = default;
  /// An error. `code` must not be kOk.
  Status(StatusCode code, std::string message, int sys_errno = 0, bool retryable = false);

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  /// Human-readable description; empty when ok().
  const std::string& message() const { return message_; }
  /// The positive errno this status came from, or 0.
  int sys_errno() const { return sys_errno_; }
  /// True when the same call may succeed if repeated.
  bool retryable() const { return retryable_; }

  /// "CODE: message" (or "OK").
  std::string ToString() const;

  /// Returns a copy whose message is prefixed by `context` ("context: message").
  Status WithContext(std::string_view context) const;

  /// Explicitly discards the status. Spelled out so that ignoring an error is visible.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_ && a.sys_errno_ == b.sys_errno_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  int sys_errno_ = 0;
  bool retryable_ = false;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

// Convenience constructors.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status FailedPreconditionError(std::string message);
Status ResourceExhaustedError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status DataLossError(std::string message);
Status InternalError(std::string message);

/// Either a value of type T or an error Status.
template <typename T>
class [[nodiscard]] Result {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "Result<Status> is meaningless");

 public:
  /// An error. `status` must not be ok.
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "Result constructed from an OK Status without a value");
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "Result built from OK Status");
  }
  /// A value.
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  template <typename U>
  requires(std::is_constructible_v<T, U&&> && !std::is_same_v<std::decay_t<U>, Status> &&
           !std::is_same_v<std::decay_t<U>, T> && !std::is_same_v<std::decay_t<U>, Result<T>>)
      Result(U&& value)
      : value_(std::forward<U>(value)) {}  // NOLINT: implicit by design

  bool ok() const { return value_.has_value(); }
  /// The error, or OK when a value is held.
  const Status& status() const { return status_; }

  /// The value; must be ok().
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  /// The value, or `fallback` on error.
  T value_or(T fallback) const& { return ok() ? *value_ : std::move(fallback); }

  /// Discards the result, error included.
  void IgnoreError() const {}

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace zoffload
ZO_API_END

#define ZO_INTERNAL_CONCAT2(a, b) a##b
#define ZO_INTERNAL_CONCAT(a, b) ZO_INTERNAL_CONCAT2(a, b)

/// Returns from the enclosing function if `expr` (a Status) is an error.
#define ZO_RETURN_IF_ERROR(expr)                               \
  do {                                                         \
    ::zoffload::Status zo_internal_status_ = (expr);           \
    if (!zo_internal_status_.ok()) return zo_internal_status_; \
  } while (false)

/// `ZO_ASSIGN_OR_RETURN(auto x, MakeX());` — declares/assigns the value of a Result or
/// returns its error from the enclosing function.
#define ZO_ASSIGN_OR_RETURN(lhs, expr) \
  ZO_INTERNAL_ASSIGN_OR_RETURN(ZO_INTERNAL_CONCAT(zo_internal_result_, __LINE__), lhs, expr)
#define ZO_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
