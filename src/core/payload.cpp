#include <cstring>

#define MSGPACK_NO_BOOST 1
#include <msgpack.hpp>

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
// TensorRef travels as msgpack ext type 1 holding a big-endian u32.
namespace {
constexpr int8_t kExtTensorRef = 1;

struct ByteSink {
  std::vector<std::byte>* out;
  void write(const char* p, size_t n) {
    auto* b = reinterpret_cast<const std::byte*>(p);
    out->insert(out->end(), b, b + n);
  }
};

void pack(msgpack::packer<ByteSink>& pk, const Value& v) {
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
          for (auto& e : x) pack(pk, e);
        } else if constexpr (std::is_same_v<T, Value::Map>) {
          pk.pack_map(uint32_t(x.size()));
          for (auto& [k, e] : x) {
            pk.pack_str(uint32_t(k.size()));
            pk.pack_str_body(k.data(), uint32_t(k.size()));
            pack(pk, e);
          }
        } else if constexpr (std::is_same_v<T, TensorRef>) {
          char be[4] = {char(x.index >> 24), char(x.index >> 16), char(x.index >> 8), char(x.index)};
          pk.pack_ext(4, kExtTensorRef);
          pk.pack_ext_body(be, 4);
        }
      },
      v.storage());
}

Result<Value> convert(const msgpack::object& o, int depth) {
  if (depth > 64) return make_error(Errc::corrupt, "msgpack nesting deeper than 64");
  switch (o.type) {
    case msgpack::type::NIL: return Value();
    case msgpack::type::BOOLEAN: return Value(o.via.boolean);
    case msgpack::type::POSITIVE_INTEGER: return Value(uint64_t(o.via.u64));
    case msgpack::type::NEGATIVE_INTEGER: return Value(int64_t(o.via.i64));
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return Value(o.via.f64);
    case msgpack::type::STR: return Value(std::string(o.via.str.ptr, o.via.str.size));
    case msgpack::type::BIN: {
      auto* b = reinterpret_cast<const std::byte*>(o.via.bin.ptr);
      return Value(Value::Bytes(b, b + o.via.bin.size));
    }
    case msgpack::type::ARRAY: {
      Value::List l;
      l.reserve(o.via.array.size);
      for (uint32_t i = 0; i < o.via.array.size; ++i) {
        SL_ASSIGN(Value e, convert(o.via.array.ptr[i], depth + 1));
        l.push_back(std::move(e));
      }
      return Value(std::move(l));
    }
    case msgpack::type::MAP: {
      Value::Map m;
      m.reserve(o.via.map.size);
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        auto& kv = o.via.map.ptr[i];
        std::string key;
        if (kv.key.type == msgpack::type::STR) key.assign(kv.key.via.str.ptr, kv.key.via.str.size);
        else if (kv.key.type == msgpack::type::POSITIVE_INTEGER) key = std::to_string(kv.key.via.u64);
        else if (kv.key.type == msgpack::type::NEGATIVE_INTEGER) key = std::to_string(kv.key.via.i64);
        else return make_error(Errc::corrupt, "msgpack map key is neither string nor integer");
        SL_ASSIGN(Value e, convert(kv.val, depth + 1));
        m.emplace_back(std::move(key), std::move(e));
      }
      return Value(std::move(m));
    }
    case msgpack::type::EXT: {
      if (o.via.ext.type() != kExtTensorRef || o.via.ext.size != 4)
        return make_error(Errc::corrupt, "unknown msgpack ext type " + std::to_string(o.via.ext.type()));
      auto* p = reinterpret_cast<const uint8_t*>(o.via.ext.data());
      return Value(TensorRef{uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]});
    }
  }
  return make_error(Errc::corrupt, "unsupported msgpack type");
}
}  // namespace

std::vector<std::byte> value_to_msgpack(const Value& v) {
  std::vector<std::byte> out;
  out.reserve(64);
  ByteSink sink{&out};
  msgpack::packer<ByteSink> pk(sink);
  pack(pk, v);
  return out;
}

Result<Value> value_from_msgpack(std::span<const std::byte> buf) {
  if (buf.empty()) return make_error(Errc::corrupt, "empty msgpack buffer");
  try {
    size_t off = 0;
    // Limits bound what a hostile buffer can make us allocate.
    msgpack::unpack_limit lim(1u << 20, 1u << 20, 64u << 20, 1u << 30, 1u << 20, 64);
    msgpack::object_handle oh = msgpack::unpack(reinterpret_cast<const char*>(buf.data()),
                                                buf.size(), off, nullptr, nullptr, lim);
    if (off != buf.size())
      return make_error(Errc::corrupt, "trailing bytes after msgpack value (" +
                                           std::to_string(buf.size() - off) + ")");
    return convert(oh.get(), 0);
  } catch (const std::exception& e) {
    return make_error(Errc::corrupt, std::string("msgpack decode failed: ") + e.what());
  }
}

}  // namespace stagelink
