// msgpack plumbing shared by payload.cpp and frame.cpp (internal).
#pragma once
#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif
#include <msgpack.hpp>

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "stagelink/payload.hpp"

namespace stagelink::detail {

// TensorRef travels as msgpack ext type 1 holding a big-endian u32.
inline constexpr int8_t kExtTensorRef = 1;

// Appends to *out from byte `len` on. The vector's size is the room in use and grows by
// doubling; writes are a bounds check and a memcpy (msgpack-c writes 1-9 bytes per call).
// finish() trims the vector to the bytes written.
struct ByteSink {
  std::vector<std::byte>* out;
  size_t len;
  ByteSink(std::vector<std::byte>* o, size_t at) : out(o), len(at) {
    if (out->size() < len) out->resize(len);
  }
  void write(const char* p, size_t n) {
    if (n > out->size() - len) out->resize(std::max(out->size() * 2, len + n + 64));
    std::memcpy(out->data() + len, p, n);
    len += n;
  }
  void finish() { out->resize(len); }
};
using Packer = msgpack::packer<ByteSink>;

// Append v to the packer's buffer.
void pack_value(Packer& pk, const Value& v);

// Bounds-checked msgpack reader for the decode hot paths (frame headers, wire metadata).
// msgpack-c packs; its generic visitor parse cost ~2,900 instructions for a 30-byte frame
// header, this reader ~300. Never reads past [p, end); every length is checked against the
// bytes left; nesting is capped at kMaxDepth; a failure leaves a message in `error`.
class MpReader {
 public:
  static constexpr int kMaxDepth = 64;
  MpReader(const std::byte* p, size_t n)
      : p_(reinterpret_cast<const uint8_t*>(p)), begin_(p_), end_(p_ + n) {}
  size_t pos() const { return size_t(p_ - begin_); }
  size_t left() const { return size_t(end_ - p_); }
  bool at_end() const { return p_ == end_; }
  std::string error;

  // Any value into a Value (non-negative integers as uint64, negative as int64, map keys that
  // are integers as their decimal string, ext type 1 as TensorRef).
  // The one-byte forms (fixarray, fixmap, fixstr, positive fixint: what frame headers and
  // metadata hold) are decoded inline; every other form, and every error, out of line.
  bool read_value(Value& out, int depth = 0);
  bool read_array(uint32_t& n) {
    if (p_ != end_ && (*p_ & 0xf0) == 0x90 && uint32_t(*p_ & 0x0f) < left()) {
      n = *p_++ & 0x0f;
      return true;
    }
    return read_array_slow(n);
  }
  bool read_map(uint32_t& n) {
    if (p_ != end_ && (*p_ & 0xf0) == 0x80 && 2 * uint32_t(*p_ & 0x0f) < left()) {
      n = *p_++ & 0x0f;
      return true;
    }
    return read_map_slow(n);
  }
  bool read_u64(uint64_t& v) {
    if (p_ != end_ && *p_ <= 0x7f) {
      v = *p_++;
      return true;
    }
    return read_u64_slow(v);
  }
  bool read_i64(int64_t& v) {
    if (p_ != end_ && *p_ <= 0x7f) {
      v = *p_++;
      return true;
    }
    return read_i64_slow(v);
  }
  bool read_str(std::string_view& s) {
    if (p_ != end_ && (*p_ & 0xe0) == 0xa0 && uint32_t(*p_ & 0x1f) < left()) {
      const size_t n = *p_++ & 0x1f;
      s = std::string_view(reinterpret_cast<const char*>(p_), n);
      p_ += n;
      return true;
    }
    return read_str_slow(s);
  }
  bool skip(int depth = 0);

 private:
  bool fail(const char* why);
  bool need(size_t n) { return left() >= n ? true : fail("truncated msgpack value"); }
  template <class T> T be() {  // caller checked need(sizeof(T))
    T v;
    std::memcpy(&v, p_, sizeof v);
    p_ += sizeof v;
    if constexpr (sizeof(T) == 2) v = T(__builtin_bswap16(uint16_t(v)));
    else if constexpr (sizeof(T) == 4) v = T(__builtin_bswap32(uint32_t(v)));
    else if constexpr (sizeof(T) == 8) v = T(__builtin_bswap64(uint64_t(v)));
    return v;
  }
  bool read_array_slow(uint32_t& n);
  bool read_map_slow(uint32_t& n);
  bool read_u64_slow(uint64_t& v);
  bool read_i64_slow(int64_t& v);
  bool read_str_slow(std::string_view& s);
  bool len_prefix(uint8_t tag, uint8_t t8, uint32_t& n);
  bool read_container(uint8_t fix, uint8_t t16, size_t min_bytes, uint32_t& n, const char* what);  // str8/bin8/...: 1, 2 or 4 byte length
  const uint8_t* p_;
  const uint8_t* begin_;
  const uint8_t* end_;
};

}  // namespace stagelink::detail
