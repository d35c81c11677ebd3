// msgpack plumbing shared by payload.cpp and frame.cpp (internal).
#pragma once
#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif
#include <msgpack.hpp>

#include <vector>

#include "stagelink/payload.hpp"

namespace stagelink::detail {

// TensorRef travels as msgpack ext type 1 holding a big-endian u32.
inline constexpr int8_t kExtTensorRef = 1;

struct ByteSink {
  std::vector<std::byte>* out;
  void write(const char* p, size_t n) {
    auto* b = reinterpret_cast<const std::byte*>(p);
    out->insert(out->end(), b, b + n);
  }
};
using Packer = msgpack::packer<ByteSink>;

// Append v to the packer's buffer.
void pack_value(Packer& pk, const Value& v);

}  // namespace stagelink::detail
