// msgpack plumbing shared by payload.cpp and frame.cpp (internal).
#pragma once
#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif
#include <msgpack.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "stagelink/payload.hpp"

namespace stagelink::detail {

// TensorRef travels as msgpack ext type 1 holding a big-endian u32.
inline constexpr int8_t kExtTensorRef = 1;
// A list (or tuple) of 32-bit integers -- token ids, codec codes, -1 paddings -- may travel as
// msgpack ext type 2: one byte giving the width w (1, 2 or 4: unsigned values; 0x81, 0x82 or
// 0x84: two's-complement signed ones of width w & 0xf), then the values, w bytes each,
// little-endian. Readers build the same list an array of those integers gives; the Python layer
// writes it for lists of 16 or more such ints (no per-value type tag to write or branch on).
inline constexpr int8_t kExtIdList = 2;
inline constexpr uint8_t kIdListSigned = 0x80;
// Value i of an id list's values of width w (checked by the reader: 1, 2 or 4), unsigned.
[[gnu::always_inline]] inline uint32_t id_at(const uint8_t* d, uint32_t w, size_t i) {
  if (w == 1) return d[i];
  if (w == 2) return uint32_t(d[2 * i]) | uint32_t(d[2 * i + 1]) << 8;
  const uint8_t* q = d + 4 * i;
  return uint32_t(q[0]) | uint32_t(q[1]) << 8 | uint32_t(q[2]) << 16 | uint32_t(q[3]) << 24;
}
// The same value read as a signed one of that width.
[[gnu::always_inline]] inline int32_t signed_id_at(const uint8_t* d, uint32_t w, size_t i) {
  const uint32_t shift = 32 - 8 * w;
  return int32_t(id_at(d, w, i) << shift) >> shift;
}
// The id-list header byte (width | kIdListSigned when signed) that holds every one of n values
// written as 4-byte little-endian ones at d: unsigned when none is negative (width by their OR),
// else signed (width by the OR of their magnitudes' bits below the sign: v, or ~v for a negative
// v).
inline uint8_t id_list_width(const uint8_t* d, size_t n) {
  uint32_t all = 0, mag = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = id_at(d, 4, i);
    all |= u;
    mag |= u ^ uint32_t(int32_t(u) >> 31);
  }
  if (all >> 31) return uint8_t((mag < 0x80 ? 1 : mag < 0x8000 ? 2 : 4) | kIdListSigned);
  return uint8_t(all < 0x100 ? 1 : all < 0x10000 ? 2 : 4);
}
// Narrows n values written as 4-byte little-endian ones at d to width w (1 or 2) in place: each
// value's low w bytes, so a signed value keeps its two's complement (the writer checked that w
// holds every value). Writes only below what it has read: the narrowed values end at d + n * w.
inline void narrow_ids(uint8_t* d, size_t n, uint32_t w) {
  if (w == 1)
    for (size_t i = 0; i < n; ++i) d[i] = d[4 * i];
  else
    for (size_t i = 0; i < n; ++i) d[2 * i] = d[4 * i], d[2 * i + 1] = d[4 * i + 1];
}
// A list (or tuple) of floats -- audio samples, scores, embeddings handed on as Python lists --
// may travel as msgpack ext type 3: the values as IEEE-754 doubles, 8 little-endian bytes each
// (every bit kept: -0.0, NaN payloads, infinities). The Python layer writes it for lists of 16 or
// more floats; readers build the list of doubles an array of float64 gives.
inline constexpr int8_t kExtFloatList = 3;
[[gnu::always_inline]] inline double float_at(const uint8_t* d, size_t i) {
  uint64_t bits;
  std::memcpy(&bits, d + 8 * i, 8);
  if constexpr (std::endian::native == std::endian::big) bits = __builtin_bswap64(bits);
  double v;
  std::memcpy(&v, &bits, 8);
  return v;
}
// Value i of a float list written (float_at's inverse).
[[gnu::always_inline]] inline void put_float(uint8_t* d, size_t i, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  if constexpr (std::endian::native == std::endian::big) bits = __builtin_bswap64(bits);
  std::memcpy(d + 8 * i, &bits, 8);
}

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
    if (n == 0) return;  // msgpack-c passes (nullptr, 0) for an empty str or bin
    if (n > out->size() - len) out->resize(std::max(out->size() * 2, len + n + 64));
    std::memcpy(out->data() + len, p, n);
    len += n;
  }
  void finish() { out->resize(len); }
  // An integer in its shortest msgpack form, written in place (msgpack-c's packer takes a call
  // and a memcpy per value: this is what lists of token ids are made of).
  void write_int(int64_t v) {
    reserve(9);
    write_int_reserved(v);
  }
  // Room for n more bytes: the *_reserved writes then need no check of their own.
  void reserve(size_t n) {
    if (n > out->size() - len) out->resize(std::max(out->size() * 2, len + n + 64));
  }
  // write_int after reserve(9) (a list of n ids: one reserve(9 * n), then n of these).
  [[gnu::always_inline]] void write_int_reserved(int64_t v) {
    uint8_t* b = at();
    len += size_t(put_int(b, v) - b);
  }
  // Where the next byte goes (valid until the next reserve or write).
  uint8_t* at() { return reinterpret_cast<uint8_t*>(out->data() + len); }
  // v at d in its shortest msgpack form; returns the byte after it. A caller writing a run of
  // ints keeps its own cursor: stores through a byte pointer may alias anything, so writing
  // through the sink would reload its buffer and length for every value.
  [[gnu::always_inline]] static uint8_t* put_int(uint8_t* d, int64_t v) {
    if (v >= 0 && v <= 0x7f) { d[0] = uint8_t(v); return d + 1; }
    if (v < 0 && v >= -32) { d[0] = uint8_t(int8_t(v)); return d + 1; }
    if (v >= 0 && v <= 0xff) { d[0] = 0xcc; d[1] = uint8_t(v); return d + 2; }
    if (v >= 0 && v <= 0xffff) { d[0] = 0xcd; d[1] = uint8_t(v >> 8); d[2] = uint8_t(v); return d + 3; }
    if (v >= 0 && v <= 0xffffffffll) {
      d[0] = 0xce;
      const uint32_t be = __builtin_bswap32(uint32_t(v));
      std::memcpy(d + 1, &be, 4);
      return d + 5;
    }
    d[0] = v >= 0 ? 0xcf : 0xd3;  // uint64 / int64
    const uint64_t be = __builtin_bswap64(uint64_t(v));
    std::memcpy(d + 1, &be, 8);
    return d + 9;
  }
};
// msgpack-c's packer, but a double is always a float64. msgpack-c 4 packs a double that holds a
// whole number as an int (2.0 and -0.0 come back as the int 2 and 0: a Python float turned into an
// int, a C++ double into a uint64), so pack_double here writes 0xcb and the 8 bytes itself. Every
// double stagelink packs goes through this pack_double (never msgpack-c's adaptors).
struct Packer : msgpack::packer<ByteSink> {
  explicit Packer(ByteSink& s) : msgpack::packer<ByteSink>(s), sink(s) {}
  Packer& pack_double(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    uint8_t b[9];
    b[0] = 0xcb;
    bits = __builtin_bswap64(bits);
    std::memcpy(b + 1, &bits, 8);
    sink.write(reinterpret_cast<const char*>(b), 9);
    return *this;
  }
  ByteSink& sink;
};

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
  // Any value, handed to a builder: read_value's walk, for callers that build their own objects
  // (the Python binding builds lists and dicts straight from the bytes). B provides, each
  // returning false to stop (after setting its own error or calling fail()):
  //   using Out = ...;
  //   nil(Out&), boolean(Out&, bool), uint(Out&, uint64_t), sint(Out&, int64_t), real(Out&, double),
  //   str(Out&, std::string_view), bin(Out&, std::span<const std::byte>), tensor(Out&, uint32_t),
  //   array(Out&, uint32_t n, F elem)      with elem(Out&) reading the next element,
  //   map(Out&, uint32_t n, K key, F elem) with key(std::string_view&) reading the next key
  //                                        (valid until the next read) and elem as for arrays.
  template <class B>
  bool read_any(B& b, typename B::Out& out, int depth = 0);
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
    if (left() >= 3 && (*p_ == 0xcc || *p_ == 0xcd)) {  // uint8, uint16: token ids and the like
      v = *p_ == 0xcc ? p_[1] : uint64_t(p_[1]) << 8 | p_[2];
      p_ += *p_ == 0xcc ? 2 : 3;
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
  void skip_rest() { p_ = end_; }
  // The next value when it is a non-negative integer of at most 32 bits (fixint, uint8, uint16,
  // uint32); false, consuming nothing, otherwise. Lets builders take lists of ids without a call
  // per item.
  bool try_small_uint(uint64_t& v) {
    if (p_ == end_) return false;
    if (*p_ <= 0x7f) { v = *p_++; return true; }
    if (*p_ == 0xcc && left() >= 2) { v = p_[1]; p_ += 2; return true; }
    if (*p_ == 0xcd && left() >= 3) { v = uint64_t(p_[1]) << 8 | p_[2]; p_ += 3; return true; }
    if (*p_ == 0xce && left() >= 5) {
      v = uint64_t(p_[1]) << 24 | uint64_t(p_[2]) << 16 | uint64_t(p_[3]) << 8 | p_[4];
      p_ += 5;
      return true;
    }
    return false;
  }
  bool fail(const char* why);

 private:
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
  bool read_key(std::string_view& k, std::string& scratch);
  const uint8_t* p_;
  const uint8_t* begin_;
  const uint8_t* end_;
};

namespace mp_tag {
inline bool is_str(uint8_t t) { return (t & 0xe0) == 0xa0 || (t >= 0xd9 && t <= 0xdb); }
inline bool is_uint(uint8_t t) { return t <= 0x7f || (t >= 0xcc && t <= 0xcf); }
inline bool is_int(uint8_t t) { return t >= 0xe0 || (t >= 0xd0 && t <= 0xd3); }
inline bool is_array(uint8_t t) { return (t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd; }
inline bool is_map(uint8_t t) { return (t & 0xf0) == 0x80 || t == 0xde || t == 0xdf; }
}  // namespace mp_tag

template <class B>
bool MpReader::read_any(B& b, typename B::Out& out, int depth) {
  using Out = typename B::Out;
  if (!need(1)) return false;
  const uint8_t t = *p_;
  if (mp_tag::is_uint(t)) {
    uint64_t v;
    return read_u64(v) && b.uint(out, v);
  }
  if (mp_tag::is_int(t)) {
    int64_t v;
    if (!read_i64(v)) return false;
    return v >= 0 ? b.uint(out, uint64_t(v)) : b.sint(out, v);
  }
  if (mp_tag::is_str(t)) {
    std::string_view s;
    return read_str(s) && b.str(out, s);
  }
  if (mp_tag::is_array(t)) {
    if (depth >= kMaxDepth) return fail("msgpack nesting deeper than 64");
    uint32_t n;
    if (!read_array(n)) return false;
    return b.array(out, n, [&](Out& e) { return read_any(b, e, depth + 1); });
  }
  if (mp_tag::is_map(t)) {
    if (depth >= kMaxDepth) return fail("msgpack nesting deeper than 64");
    uint32_t n;
    if (!read_map(n)) return false;
    std::string scratch;
    return b.map(out, n, [&](std::string_view& k) { return read_key(k, scratch); },
                 [&](Out& e) { return read_any(b, e, depth + 1); });
  }
  ++p_;
  switch (t) {
    case 0xc0: return b.nil(out);
    case 0xc2: return b.boolean(out, false);
    case 0xc3: return b.boolean(out, true);
    case 0xc4: case 0xc5: case 0xc6: {
      uint32_t n;
      if (!len_prefix(t, 0xc4, n) || !need(n)) return false;
      const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(p_), n);
      p_ += n;
      return b.bin(out, bytes);
    }
    case 0xca: {
      if (!need(4)) return false;
      const uint32_t bits = be<uint32_t>();
      float f;
      std::memcpy(&f, &bits, 4);
      return b.real(out, double(f));
    }
    case 0xcb: {
      if (!need(8)) return false;
      const uint64_t bits = be<uint64_t>();
      double d;
      std::memcpy(&d, &bits, 8);
      return b.real(out, d);
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: case 0xc7: case 0xc8: case 0xc9: {
      uint32_t n;
      if (t >= 0xd4) n = 1u << (t - 0xd4);
      else if (!len_prefix(t, 0xc7, n)) return false;
      if (!need(size_t(n) + 1)) return false;
      const int8_t type = int8_t(*p_++);
      if (type == kExtIdList) {
        const uint32_t code = n ? *p_ : 0, w = code & ~uint32_t(kIdListSigned);
        if ((w != 1 && w != 2 && w != 4) || (n - 1) % w) {
          --p_;
          return fail("malformed id list");
        }
        const uint8_t* values = p_ + 1;
        p_ += n;
        if (depth >= kMaxDepth) return fail("msgpack nesting deeper than 64");
        return b.id_list(out, w, code & kIdListSigned, values, (n - 1) / w);
      }
      if (type == kExtFloatList) {
        if (n % 8) {
          --p_;
          return fail("malformed float list");
        }
        const uint8_t* values = p_;
        p_ += n;
        if (depth >= kMaxDepth) return fail("msgpack nesting deeper than 64");
        return b.float_list(out, values, n / 8);
      }
      if (type != kExtTensorRef || n != 4) {
        --p_;
        return fail("unknown msgpack ext type");
      }
      return b.tensor(out, be<uint32_t>());
    }
    default:
      --p_;
      return fail("malformed msgpack");
  }
}

}  // namespace stagelink::detail
