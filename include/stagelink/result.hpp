// Result<T> and Error: the one error style of the C++ API (see docs/errors.md).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <variant>

namespace stagelink {

enum class Errc : uint8_t {
  ok = 0,
  timeout,           // a deadline passed before the thing waited for happened
  not_found,         // no such key / entry / segment
  closed,            // the object was closed
  cancelled,         // cleanup(), abort or shutdown cancelled the operation
  invalid_argument,  // bad key, bad config, bad size
  corrupt,           // a frame, metadata or shared structure failed validation
  exhausted,         // arena, directory or /dev/shm full
  peer_dead,         // the process on the other side died
  io,                // a system call failed
  unsupported,       // not built, not implemented yet, or not possible here
  exists,            // a key is still in use
  permission_denied, // a shared object owned by another user, or readable by others; an unknown peer
};

const char* errc_name(Errc c) noexcept;

struct Error {
  Errc code = Errc::ok;
  std::string message;
  std::string to_string() const { return std::string(errc_name(code)) + ": " + message; }
};

inline Error make_error(Errc c, std::string msg) { return Error{c, std::move(msg)}; }

// An expected-like holder of a T or an Error. [[nodiscard]]: ignoring a failure must be explicit.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T v) : v_(std::in_place_index<0>, std::move(v)) {}
  Result(Error e) : v_(std::in_place_index<1>, std::move(e)) {}
  bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &std::get<0>(v_); }
  const T* operator->() const { return &std::get<0>(v_); }
  T& operator*() & { return value(); }
  const Error& error() const& { return std::get<1>(v_); }
  Error&& error() && { return std::get<1>(std::move(v_)); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error e) : err_(std::move(e)), ok_(false) {}
  bool ok() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  const Error& error() const& { return err_; }
  Error&& error() && { return std::move(err_); }

 private:
  Error err_;
  bool ok_ = true;
};

using Status = Result<void>;

}  // namespace stagelink

#define SL_CONCAT_(a, b) a##b
#define SL_CONCAT(a, b) SL_CONCAT_(a, b)
// SL_TRY(expr): return the error of a failed Result/Status from the enclosing function.
#define SL_TRY(expr)                                             \
  do {                                                           \
    auto&& sl_try_r_ = (expr);                                   \
    if (!sl_try_r_.ok()) return std::move(sl_try_r_).error();    \
  } while (0)
// SL_ASSIGN(decl, expr): declare decl from the value of a Result, or return its error.
#define SL_ASSIGN(decl, expr)                                    \
  auto SL_CONCAT(sl_r_, __LINE__) = (expr);                      \
  if (!SL_CONCAT(sl_r_, __LINE__).ok())                          \
    return std::move(SL_CONCAT(sl_r_, __LINE__)).error();        \
  decl = std::move(SL_CONCAT(sl_r_, __LINE__)).value()
