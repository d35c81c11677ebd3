#include <cstring>

#include "core/msgpack_io.hpp"

#include "stagelink/payload.hpp"

namespace stagelink {

const char* errc_name(Errc c) noexcept {
  switch (c) {
    case Errc::ok: return "ok";
    case Errc::timeout: return "timeout";
    case Errc::not_found: return "not_found";
    case Errc::closed: return "closed";
    case Errc::cancelled: return "cancelled";
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::corrupt: return "corrupt";
    case Errc::exhausted: return "exhausted";
    case Errc::peer_dead: return "peer_dead";
    case Errc::io: return "io";
    case Errc::unsupported: return "unsupported";
    case Errc::exists: return "exists";
    case Errc::permission_denied: return "permission_denied";
  }
  return "unknown";
}

namespace {
struct DTypeInfo { const char* name; size_t size; };
constexpr DTypeInfo kDTypes[kDTypeCount] = {
    {"uint8", 1}, {"int8", 1}, {"uint16", 2}, {"int16", 2}, {"uint32", 4},
    {"int32", 4}, {"uint64", 8}, {"int64", 8}, {"float16", 2}, {"bfloat16", 2},
    {"float32", 4}, {"float64", 8}, {"bool", 1}, {"complex64", 8}, {"complex128", 16},
    {"float8_e4m3fn", 1}, {"float8_e5m2", 1}, {"float8_e4m3fnuz", 1}, {"float8_e5m2fnuz", 1},
    {"float8_e8m0fnu", 1}, {"complex32", 4}, {"float4_e2m1fn_x2", 1},
};
}  // namespace

size_t dtype_size(DType d) noexcept {
  auto i = static_cast<size_t>(d);
  return i < kDTypeCount ? kDTypes[i].size : 1;
}
const char* dtype_name(DType d) noexcept {
  auto i = static_cast<size_t>(d);
  return i < kDTypeCount ? kDTypes[i].name : "invalid";
}
Result<DType> dtype_from_name(std::string_view name) {
  for (int i = 0; i < kDTypeCount; ++i)
    if (name == kDTypes[i].name) return static_cast<DType>(i);
  return make_error(Errc::invalid_argument, "unknown dtype '" + std::string(name) + "'");
}

Tensor Tensor::copy_of(std::span<const std::byte> bytes, DType dt, std::vector<int64_t> shape) {
  auto store = std::make_shared<std::vector<std::byte>>(bytes.begin(), bytes.end());
  Tensor t;
  t.dtype = dt;
  t.shape = shape.empty() ? std::vector<int64_t>{int64_t(bytes.size() / dtype_size(dt))} : shape;
  t.data = std::span<const std::byte>(store->data(), store->size());
  t.keepalive = store;
  return t;
}
Tensor Tensor::view_of(std::span<const std::byte> bytes, DType dt, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dt;
  t.shape = shape.empty() ? std::vector<int64_t>{int64_t(bytes.size() / dtype_size(dt))} : shape;
  t.data = bytes;
  return t;
}

const Value* Value::find(std::string_view key) const {
  if (!is<Map>()) return nullptr;
  for (auto& [k, v] : as<Map>())
    if (k == key) return &v;
  return nullptr;
}
bool Value::get_u64(uint64_t& out) const {
  if (is<uint64_t>()) { out = as<uint64_t>(); return true; }
  if (is<int64_t>() && as<int64_t>() >= 0) { out = uint64_t(as<int64_t>()); return true; }
  return false;
}
bool Value::get_i64(int64_t& out) const {
  if (is<int64_t>()) { out = as<int64_t>(); return true; }
  if (is<uint64_t>() && as<uint64_t>() <= uint64_t(INT64_MAX)) { out = int64_t(as<uint64_t>()); return true; }
  return false;
}

bool Payload::ext_has(std::string_view key) const {
  if (packed_ext.empty()) return ext.find(key) != nullptr;
  detail::MpReader rd(packed_ext.data(), packed_ext.size());
  uint32_t n = 0;
  if (!rd.read_map(n)) return false;
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view k;
    if (!rd.read_str(k)) return false;
    if (k == key) return true;
    if (!rd.skip()) return false;
  }
  return false;
}

size_t Payload::tensor_bytes() const {
  size_t n = 0;
  for (auto& t : tensors) n += t.nbytes();
  return n;
}

// ---- msgpack ----
namespace detail {
void pack_value(Packer& pk, const Value& v) {
  std::visit(
      [&](auto&& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::monostate>) pk.pack_nil();
        else if constexpr (std::is_same_v<T, bool>) x ? pk.pack_true() : pk.pack_false();
        else if constexpr (std::is_same_v<T, int64_t>) pk.pack_int64(x);
        else if constexpr (std::is_same_v<T, uint64_t>) pk.pack_uint64(x);
        else if constexpr (std::is_same_v<T, double>) pk.pack_double(x);
        else if constexpr (std::is_same_v<T, std::string>) {
          pk.pack_str(uint32_t(x.size()));
          pk.pack_str_body(x.data(), uint32_t(x.size()));
        } else if constexpr (std::is_same_v<T, Value::Bytes>) {
          pk.pack_bin(uint32_t(x.size()));
          pk.pack_bin_body(reinterpret_cast<const char*>(x.data()), uint32_t(x.size()));
        } else if constexpr (std::is_same_v<T, Value::List>) {
          pk.pack_array(uint32_t(x.size()));
          for (auto& e : x) pack_value(pk, e);
        } else if constexpr (std::is_same_v<T, Value::Map>) {
          pk.pack_map(uint32_t(x.size()));
          for (auto& [k, e] : x) {
            pk.pack_str(uint32_t(k.size()));
            pk.pack_str_body(k.data(), uint32_t(k.size()));
            pack_value(pk, e);
          }
        } else if constexpr (std::is_same_v<T, TensorRef>) {
          char be[4] = {char(x.index >> 24), char(x.index >> 16), char(x.index >> 8), char(x.index)};
          pk.pack_ext(4, kExtTensorRef);
          pk.pack_ext_body(be, 4);
        }
      },
      v.storage());
}
}  // namespace detail

// ---- MpReader ----
namespace detail {
bool MpReader::fail(const char* why) {
  if (error.empty()) error = std::string(why) + " at byte " + std::to_string(pos());
  return false;
}

bool MpReader::len_prefix(uint8_t tag, uint8_t t8, uint32_t& n) {
  switch (tag - t8) {
    case 0:
      if (!need(1)) return false;
      n = *p_++;
      return true;
    case 1:
      if (!need(2)) return false;
      n = be<uint16_t>();
      return true;
    default:
      if (!need(4)) return false;
      n = be<uint32_t>();
      return true;
  }
}

// Array and map headers: fix form (high nibble `fix`), then 16- and 32-bit lengths (tags t16,
// t16 + 1). Each element takes at least `min_bytes` bytes, which bounds n by what is left.
bool MpReader::read_container(uint8_t fix, uint8_t t16, size_t min_bytes, uint32_t& n, const char* what) {
  if (!need(1)) return false;
  const uint8_t t = *p_++;
  if ((t & 0xf0) == fix) n = t & 0x0f;
  else if (t == t16) { if (!need(2)) return false; n = be<uint16_t>(); }
  else if (t == t16 + 1) { if (!need(4)) return false; n = be<uint32_t>(); }
  else { --p_; return fail(what); }
  return n <= left() / min_bytes ? true : fail("msgpack container longer than its buffer");
}
bool MpReader::read_array_slow(uint32_t& n) { return read_container(0x90, 0xdc, 1, n, "expected a msgpack array"); }
bool MpReader::read_map_slow(uint32_t& n) { return read_container(0x80, 0xde, 2, n, "expected a msgpack map"); }

bool MpReader::read_str_slow(std::string_view& s) {
  if (!need(1)) return false;
  const uint8_t t = *p_++;
  uint32_t n;
  if ((t & 0xe0) == 0xa0) n = t & 0x1f;
  else if (t >= 0xd9 && t <= 0xdb) { if (!len_prefix(t, 0xd9, n)) return false; }
  else { --p_; return fail("expected a msgpack string"); }
  if (!need(n)) return false;
  s = std::string_view(reinterpret_cast<const char*>(p_), n);
  p_ += n;
  return true;
}

bool MpReader::read_u64_slow(uint64_t& v) {
  if (!need(1)) return false;
  const uint8_t t = *p_++;
  if (t <= 0x7f) { v = t; return true; }
  switch (t) {
    case 0xcc: if (!need(1)) return false; v = *p_++; return true;
    case 0xcd: if (!need(2)) return false; v = be<uint16_t>(); return true;
    case 0xce: if (!need(4)) return false; v = be<uint32_t>(); return true;
    case 0xcf: if (!need(8)) return false; v = be<uint64_t>(); return true;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
      --p_;
      int64_t x;
      if (!read_i64(x)) return false;
      if (x < 0) return fail("expected a non-negative integer");
      v = uint64_t(x);
      return true;
    }
    default: --p_; return fail("expected a msgpack integer");
  }
}

bool MpReader::read_i64_slow(int64_t& v) {
  if (!need(1)) return false;
  const uint8_t t = *p_++;
  if (t <= 0x7f) { v = t; return true; }
  if (t >= 0xe0) { v = int8_t(t); return true; }
  switch (t) {
    case 0xd0: if (!need(1)) return false; v = int8_t(*p_++); return true;
    case 0xd1: if (!need(2)) return false; v = be<int16_t>(); return true;
    case 0xd2: if (!need(4)) return false; v = be<int32_t>(); return true;
    case 0xd3: if (!need(8)) return false; v = be<int64_t>(); return true;
    case 0xcc: case 0xcd: case 0xce: case 0xcf: {
      --p_;
      uint64_t x;
      if (!read_u64(x)) return false;
      if (x > uint64_t(INT64_MAX)) return fail("integer does not fit int64");
      v = int64_t(x);
      return true;
    }
    default: --p_; return fail("expected a msgpack integer");
  }
}

// Map keys: strings, or integers as their decimal string.
bool MpReader::read_key(std::string_view& k, std::string& scratch) {
  if (!need(1)) return false;
  const uint8_t kt = *p_;
  if (mp_tag::is_str(kt)) return read_str(k);
  if (mp_tag::is_uint(kt)) {
    uint64_t v;
    if (!read_u64(v)) return false;
    scratch = std::to_string(v);
  } else if (mp_tag::is_int(kt)) {
    int64_t v;
    if (!read_i64(v)) return false;
    scratch = std::to_string(v);
  } else {
    return fail("msgpack map key is neither string nor integer");
  }
  k = scratch;
  return true;
}

namespace {
// read_any's builder for Value trees.
struct ValueBuilder {
  using Out = Value;
  bool nil(Value& o) { o = Value(); return true; }
  bool boolean(Value& o, bool b) { o = Value(b); return true; }
  bool uint(Value& o, uint64_t v) { o = Value(v); return true; }
  bool sint(Value& o, int64_t v) { o = Value(v); return true; }
  bool real(Value& o, double v) { o = Value(v); return true; }
  bool str(Value& o, std::string_view s) { o = Value(std::string(s)); return true; }
  bool bin(Value& o, std::span<const std::byte> b) { o = Value::copy_bytes(b); return true; }
  bool tensor(Value& o, uint32_t i) { o = Value(TensorRef{i}); return true; }
  bool id_list(Value& o, uint32_t w, bool sign, const uint8_t* d, uint32_t n) {
    Value::List l;
    l.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      if (!sign) {
        l.emplace_back(uint64_t(id_at(d, w, i)));
        continue;
      }
      const int32_t v = signed_id_at(d, w, i);  // as an array gives them: unsigned unless negative
      v < 0 ? l.emplace_back(int64_t(v)) : l.emplace_back(uint64_t(v));
    }
    o = Value(std::move(l));
    return true;
  }
  bool float_list(Value& o, const uint8_t* d, uint32_t n) {
    Value::List l;
    l.reserve(n);
    for (uint32_t i = 0; i < n; ++i) l.emplace_back(float_at(d, i));
    o = Value(std::move(l));
    return true;
  }
  template <class F>
  bool array(Value& o, uint32_t n, F elem) {
    Value::List l;
    l.reserve(std::min<uint32_t>(n, 1024));  // grows with what is actually there
    for (uint32_t i = 0; i < n; ++i)
      if (!elem(l.emplace_back())) return false;
    o = Value(std::move(l));
    return true;
  }
  template <class K, class F>
  bool map(Value& o, uint32_t n, K key, F elem) {
    Value::Map m;
    m.reserve(std::min<uint32_t>(n, 1024));
    for (uint32_t i = 0; i < n; ++i) {
      auto& [k, v] = m.emplace_back();
      std::string_view ks;
      if (!key(ks)) return false;
      k.assign(ks);
      if (!elem(v)) return false;
    }
    o = Value(std::move(m));
    return true;
  }
};
}  // namespace

bool MpReader::read_value(Value& out, int depth) {
  ValueBuilder b;
  return read_any(b, out, depth);
}

namespace {
// read_any's builder that builds nothing: skip() checks a value's bounds and moves past it.
struct SkipBuilder {
  using Out = char;
  bool nil(char&) { return true; }
  bool boolean(char&, bool) { return true; }
  bool uint(char&, uint64_t) { return true; }
  bool sint(char&, int64_t) { return true; }
  bool real(char&, double) { return true; }
  bool str(char&, std::string_view) { return true; }
  bool bin(char&, std::span<const std::byte>) { return true; }
  bool tensor(char&, uint32_t) { return true; }
  bool id_list(char&, uint32_t, bool, const uint8_t*, uint32_t) { return true; }
  bool float_list(char&, const uint8_t*, uint32_t) { return true; }
  template <class F>
  bool array(char& o, uint32_t n, F elem) {
    for (uint32_t i = 0; i < n; ++i)
      if (!elem(o)) return false;
    return true;
  }
  template <class K, class F>
  bool map(char& o, uint32_t n, K key, F elem) {
    std::string_view k;
    for (uint32_t i = 0; i < n; ++i)
      if (!key(k) || !elem(o)) return false;
    return true;
  }
};
}  // namespace

bool MpReader::skip(int depth) {
  SkipBuilder b;
  char ignored = 0;
  return read_any(b, ignored, depth);
}
}  // namespace detail

Value Value::copy_bytes(std::span<const std::byte> b) {
  Bytes out(b.size());
  if (!b.empty()) std::memcpy(out.data(), b.data(), b.size());
  return Value(std::move(out));
}

std::vector<std::byte> value_to_msgpack(const Value& v) {
  std::vector<std::byte> out(64);
  detail::ByteSink sink(&out, 0);
  detail::Packer pk(sink);
  detail::pack_value(pk, v);
  sink.finish();
  return out;
}

Result<Value> value_from_msgpack(std::span<const std::byte> buf) {
  if (buf.empty()) return make_error(Errc::corrupt, "empty msgpack buffer");
  detail::MpReader rd(buf.data(), buf.size());
  Value v;
  if (!rd.read_value(v)) return make_error(Errc::corrupt, "msgpack decode failed: " + rd.error);
  if (!rd.at_end())
    return make_error(Errc::corrupt, "trailing bytes after msgpack value (" + std::to_string(rd.left()) + ")");
  return v;
}

bool is_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* const end = p + s.size();
  while (p < end) {
    const unsigned c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    // Lead byte: how many continuation bytes follow, and the range the second byte must lie in
    // (which excludes overlong forms, surrogates and code points past U+10FFFF).
    size_t n;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) n = 1;
    else if (c >= 0xe0 && c <= 0xef) {
      n = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      return false;
    }
    if (size_t(end - p) <= n || p[1] < lo || p[1] > hi) return false;
    for (size_t i = 2; i <= n; ++i)
      if ((p[i] & 0xc0) != 0x80) return false;
    p += n + 1;
  }
  return true;
}

}  // namespace stagelink
