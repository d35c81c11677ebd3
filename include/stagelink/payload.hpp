// Tensor, Value and Payload: what a connector moves.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "stagelink/result.hpp"

namespace stagelink {

// Wire codes: never renumbered, new ones only appended. f8* are torch's float8 types (e4m3fn and
// e5m2 for FP8 weights and KV caches; the *fnuz ones AMD's; e8m0fnu the MX scales), c32 is
// complex32 (two float16), f4e2m1fn_x2 two FP4 values packed in each byte.
enum class DType : uint8_t {
  u8 = 0, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32, f64, boolean, c64, c128,
  f8e4m3fn, f8e5m2, f8e4m3fnuz, f8e5m2fnuz, f8e8m0fnu, c32, f4e2m1fn_x2,
};
inline constexpr int kDTypeCount = 22;
size_t dtype_size(DType d) noexcept;
const char* dtype_name(DType d) noexcept;
Result<DType> dtype_from_name(std::string_view name);

// A tensor is a typed view over bytes. It does not own them unless `keepalive` does:
// a received zero-copy tensor's keepalive holds its shared-memory slot until dropped.
struct Tensor {
  DType dtype = DType::u8;
  std::vector<int64_t> shape;
  std::string device = "cpu";
  std::span<const std::byte> data;
  std::shared_ptr<const void> keepalive;

  size_t nbytes() const noexcept { return data.size(); }
  // Owning tensor holding a copy of `bytes`.
  static Tensor copy_of(std::span<const std::byte> bytes, DType dt = DType::u8,
                        std::vector<int64_t> shape = {});
  static Tensor view_of(std::span<const std::byte> bytes, DType dt = DType::u8,
                        std::vector<int64_t> shape = {});
};

struct TensorRef {
  uint32_t index = 0;
  bool operator==(const TensorRef&) const = default;
};

// A tree of plain values; leaves may reference tensors of the payload by index.
class Value {
 public:
  using Bytes = std::vector<std::byte>;
  using List = std::vector<Value>;
  using Map = std::vector<std::pair<std::string, Value>>;  // ordered, keys are strings
  using Storage = std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string,
                               Bytes, List, Map, TensorRef>;

  Value() = default;
  Value(std::nullptr_t) {}
  Value(bool b) : v_(b) {}
  Value(int v) : v_(int64_t{v}) {}
  Value(int64_t v) : v_(v) {}
  Value(uint64_t v) : v_(v) {}
  Value(double v) : v_(v) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(Bytes b) : v_(std::move(b)) {}
  Value(List l) : v_(std::move(l)) {}
  Value(Map m) : v_(std::move(m)) {}
  Value(TensorRef r) : v_(r) {}
  // A Bytes value holding a copy of `b` (one memcpy; a range constructor copies byte by byte).
  static Value copy_bytes(std::span<const std::byte> b);

  const Storage& storage() const { return v_; }
  Storage& storage() { return v_; }
  bool is_nil() const { return v_.index() == 0; }
  template <class T> bool is() const { return std::holds_alternative<T>(v_); }
  template <class T> const T& as() const { return std::get<T>(v_); }
  template <class T> T& as() { return std::get<T>(v_); }

  // Map lookup: nullptr when this is not a map or has no such key.
  const Value* find(std::string_view key) const;
  // Integer accessors that accept either signedness; nullopt-like failure via bool.
  bool get_u64(uint64_t& out) const;
  bool get_i64(int64_t& out) const;

  bool operator==(const Value& o) const { return v_ == o.v_; }

 private:
  Storage v_;
};

struct Payload {
  Value tree;
  std::vector<Tensor> tensors;
  // What a language binding needs to rebuild its own types, beside the tree (nil: nothing). The
  // Python binding records tuples, torch tensors, bytes and pickled objects here; other readers
  // ignore it and see the plain tree and tensors. Travels as the frame header's "p" entry.
  Value ext;
  // The tree as msgpack bytes, for bindings that build their own objects without a Value tree:
  // on put, when not empty, it is written instead of `tree` (tensor references as ext type 1,
  // big-endian u32; lists of ints and of floats may be ext types 2 and 3, read as lists, see
  // core/msgpack_io.hpp; the caller keeps the bytes alive for the call); on a decode that was asked
  // not to build the tree (decode_frame_into's build_tree, GetOptions::raw_tree) it views the
  // frame's bytes and lives as long as they do. Nobody else needs it.
  std::span<const std::byte> packed_tree;
  // `ext` as msgpack bytes (a map), the same way: written instead of `ext` when not empty, and
  // left packed here (ext nil) by a decode that leaves the tree packed.
  std::span<const std::byte> packed_ext;
  // Whether ext, packed or not, is a map holding `key`.
  bool ext_has(std::string_view key) const;
  // Total bytes of the tensor regions.
  size_t tensor_bytes() const;
};

// Parse msgpack bytes into a Value (bounds-checked); encode a Value as msgpack.
Result<Value> value_from_msgpack(std::span<const std::byte> buf);
std::vector<std::byte> value_to_msgpack(const Value& v);

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF):
// what Python's strict decoder takes. For strings from outside that become Python strs.
bool is_utf8(std::string_view s);

}  // namespace stagelink
