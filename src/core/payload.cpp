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
  }
  return "unknown";
}

namespace {
struct DTypeInfo { const char* name; size_t size; };
constexpr DTypeInfo kDTypes[kDTypeCount] = {
    {"uint8", 1}, {"int8", 1}, {"uint16", 2}, {"int16", 2}, {"uint32", 4},
    {"int32", 4}, {"uint64", 8}, {"int64", 8}, {"float16", 2}, {"bfloat16", 2},
    {"float32", 4}, {"float64", 8}, {"bool", 1}, {"complex64", 8}, {"complex128", 16},
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

namespace {
bool is_str_tag(uint8_t t) { return (t & 0xe0) == 0xa0 || (t >= 0xd9 && t <= 0xdb); }
bool is_uint_tag(uint8_t t) { return t <= 0x7f || (t >= 0xcc && t <= 0xcf); }
bool is_int_tag(uint8_t t) { return t >= 0xe0 || (t >= 0xd0 && t <= 0xd3); }
}  // namespace

bool MpReader::read_value(Value& out, int depth) {
  if (!need(1)) return false;
  const uint8_t t = *p_;
  if (is_uint_tag(t)) {
    uint64_t v;
    if (!read_u64(v)) return false;
    out = Value(v);
    return true;
  }
  if (is_int_tag(t)) {
    int64_t v;
    if (!read_i64(v)) return false;
    out = v >= 0 ? Value(uint64_t(v)) : Value(v);
    return true;
  }
  if (is_str_tag(t)) {
    std::string_view s;
    if (!read_str(s)) return false;
    out = Value(std::string(s));
    return true;
  }
  if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
    if (depth >= kMaxDepth) return fail("msgpack nesting deeper than 64");
    uint32_t n;
    if (!read_array(n)) return false;
    Value::List l;
    l.reserve(std::min<uint32_t>(n, 1024));  // grows with what is actually there
    for (uint32_t i = 0; i < n; ++i)
      if (!read_value(l.emplace_back(), depth + 1)) return false;
    out = Value(std::move(l));
    return true;
  }
  if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) {
    if (depth >= kMaxDepth) return fail("msgpack nesting deeper than 64");
    uint32_t n;
    if (!read_map(n)) return false;
    Value::Map m;
    m.reserve(std::min<uint32_t>(n, 1024));
    for (uint32_t i = 0; i < n; ++i) {
      auto& [k, v] = m.emplace_back();
      if (!need(1)) return false;
      const uint8_t kt = *p_;
      if (is_str_tag(kt)) {
        std::string_view s;
        if (!read_str(s)) return false;
        k.assign(s);
      } else if (is_uint_tag(kt) || is_int_tag(kt)) {  // an integer key, as its decimal string
        Value x;
        if (!read_value(x, depth + 1)) return false;
        k = x.is<uint64_t>() ? std::to_string(x.as<uint64_t>()) : std::to_string(x.as<int64_t>());
      } else {
        return fail("msgpack map key is neither string nor integer");
      }
      if (!read_value(v, depth + 1)) return false;
    }
    out = Value(std::move(m));
    return true;
  }
  ++p_;
  switch (t) {
    case 0xc0: out = Value(); return true;
    case 0xc2: out = Value(false); return true;
    case 0xc3: out = Value(true); return true;
    case 0xc4: case 0xc5: case 0xc6: {
      uint32_t n;
      if (!len_prefix(t, 0xc4, n) || !need(n)) return false;
      auto* b = reinterpret_cast<const std::byte*>(p_);
      out = Value::copy_bytes(std::span<const std::byte>(b, n));
      p_ += n;
      return true;
    }
    case 0xca: {
      if (!need(4)) return false;
      const uint32_t bits = be<uint32_t>();
      float f;
      std::memcpy(&f, &bits, 4);
      out = Value(double(f));
      return true;
    }
    case 0xcb: {
      if (!need(8)) return false;
      const uint64_t bits = be<uint64_t>();
      double d;
      std::memcpy(&d, &bits, 8);
      out = Value(d);
      return true;
    }
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: case 0xc7: case 0xc8: case 0xc9: {
      uint32_t n;
      if (t >= 0xd4) n = 1u << (t - 0xd4);
      else if (!len_prefix(t, 0xc7, n)) return false;
      if (!need(size_t(n) + 1)) return false;
      const int8_t type = int8_t(*p_++);
      if (type != kExtTensorRef || n != 4) {
        --p_;
        return fail("unknown msgpack ext type");
      }
      out = Value(TensorRef{be<uint32_t>()});
      return true;
    }
    default:
      --p_;
      return fail("malformed msgpack");
  }
}

bool MpReader::skip(int depth) {
  Value ignored;
  return read_value(ignored, depth);
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

}  // namespace stagelink
