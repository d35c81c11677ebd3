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

namespace {
// Builds a Value straight from the msgpack parser's events (no intermediate msgpack::object
// zone). Bounds: the parser never reads past the buffer; this visitor caps nesting at 64 and
// never reserves more elements than bytes remain.
class ValueBuilder {
 public:
  explicit ValueBuilder(size_t len) : len_(len) {}
  Value result;
  std::string error;

  bool visit_nil() { return put(Value()); }
  bool visit_boolean(bool b) { return put(Value(b)); }
  bool visit_positive_integer(uint64_t v) {
    if (key_) { *key_ = std::to_string(v); key_ = nullptr; return true; }
    return put(Value(v));
  }
  bool visit_negative_integer(int64_t v) {
    if (key_) { *key_ = std::to_string(v); key_ = nullptr; return true; }
    return put(Value(v));
  }
  bool visit_float32(float v) { return put(Value(double(v))); }
  bool visit_float64(double v) { return put(Value(v)); }
  bool visit_str(const char* p, uint32_t n) {
    if (key_) { key_->assign(p, n); key_ = nullptr; return true; }
    return put(Value(std::string(p, n)));
  }
  bool visit_bin(const char* p, uint32_t n) {
    auto* b = reinterpret_cast<const std::byte*>(p);
    return put(Value(Value::Bytes(b, b + n)));
  }
  bool visit_ext(const char* p, uint32_t n) {  // p[0] is the ext type, n counts it
    if (n != 5 || int8_t(p[0]) != detail::kExtTensorRef)
      return fail("unknown msgpack ext type " + std::to_string(n ? int(int8_t(p[0])) : -1));
    auto* u = reinterpret_cast<const uint8_t*>(p + 1);
    return put(Value(TensorRef{uint32_t(u[0]) << 24 | uint32_t(u[1]) << 16 | uint32_t(u[2]) << 8 | u[3]}));
  }
  bool start_array(uint32_t n) {
    if (!put(Value(Value::List{}))) return false;
    auto& l = slot_->as<Value::List>();
    l.reserve(std::min<size_t>(n, len_));
    return push(slot_);
  }
  bool start_array_item() {
    auto& l = stack_[depth_ - 1]->as<Value::List>();
    slot_ = &l.emplace_back();
    filled_ = false;
    return true;
  }
  bool end_array_item() { return true; }
  bool end_array() { --depth_; return true; }
  bool start_map(uint32_t n) {
    if (!put(Value(Value::Map{}))) return false;
    slot_->as<Value::Map>().reserve(std::min<size_t>(n, len_));
    return push(slot_);
  }
  bool start_map_key() {
    auto& m = stack_[depth_ - 1]->as<Value::Map>();
    m.emplace_back();
    key_ = &m.back().first;
    return true;
  }
  bool end_map_key() {
    if (key_) return fail("msgpack map key is neither string nor integer");
    return true;
  }
  bool start_map_value() {
    slot_ = &stack_[depth_ - 1]->as<Value::Map>().back().second;
    filled_ = false;
    return true;
  }
  bool end_map_value() { return true; }
  bool end_map() { --depth_; return true; }
  void parse_error(size_t, size_t at) { if (error.empty()) error = "malformed msgpack at byte " + std::to_string(at); }
  void insufficient_bytes(size_t, size_t) { if (error.empty()) error = "truncated msgpack value"; }
  bool referenced() const { return false; }
  void set_referenced(bool) {}

 private:
  bool fail(std::string why) {
    if (error.empty()) error = std::move(why);
    return false;
  }
  bool put(Value v) {
    if (key_) return fail("msgpack map key is neither string nor integer");
    if (filled_) return fail("malformed msgpack");
    *slot_ = std::move(v);
    filled_ = true;
    return true;
  }
  bool push(Value* v) {
    if (depth_ >= kMaxDepth) return fail("msgpack nesting deeper than 64");
    stack_[depth_++] = v;
    return true;
  }
  size_t len_;
  Value* slot_ = &result;
  bool filled_ = false;
  std::string* key_ = nullptr;
  static constexpr size_t kMaxDepth = 64;
  Value* stack_[kMaxDepth];
  size_t depth_ = 0;
};
}  // namespace

std::vector<std::byte> value_to_msgpack(const Value& v) {
  std::vector<std::byte> out;
  out.reserve(64);
  detail::ByteSink sink{&out};
  detail::Packer pk(sink);
  detail::pack_value(pk, v);
  return out;
}

Result<Value> value_from_msgpack(std::span<const std::byte> buf) {
  if (buf.empty()) return make_error(Errc::corrupt, "empty msgpack buffer");
  ValueBuilder vb(buf.size());
  size_t off = 0;
  bool ok;
  try {
    ok = msgpack::v2::parse(reinterpret_cast<const char*>(buf.data()), buf.size(), off, vb);
  } catch (const std::exception& e) {
    return make_error(Errc::corrupt, std::string("msgpack decode failed: ") + e.what());
  }
  if (!ok) return make_error(Errc::corrupt, "msgpack decode failed: " + (vb.error.empty() ? std::string("malformed") : vb.error));
  if (off != buf.size())
    return make_error(Errc::corrupt, "trailing bytes after msgpack value (" + std::to_string(buf.size() - off) + ")");
  return std::move(vb.result);
}

}  // namespace stagelink
