// Helpers of the shared-memory connector's C++ tests (test_shm.cpp, test_shm_lifetime.cpp).
#pragma once
#include <dirent.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "stagelink/stagelink.hpp"
#include "util.hpp"

namespace shm_test {
using namespace stagelink;
inline std::string unique_ns(const char* tag) {
  static int n = 0;
  return std::string("t") + tag + std::to_string(getpid()) + "x" + std::to_string(n++);
}
inline Value extra(const std::string& ns, size_t arena = 64u << 20, double put_timeout = 5.0,
                   const std::string& dir = "/dev/shm") {
  Value::Map m;
  m.emplace_back("namespace", ns);
  m.emplace_back("arena_bytes", uint64_t(arena));
  m.emplace_back("put_timeout_s", put_timeout);
  m.emplace_back("shm_dir", dir);
  return Value(std::move(m));
}
// `e` with one more key.
inline Value with(Value e, const char* k, Value v) {
  e.as<Value::Map>().emplace_back(k, std::move(v));
  return e;
}
inline std::unique_ptr<Connector> make(const Value& e) {
  auto c = create_connector("SharedMemoryConnector", e);
  EXPECT_TRUE(c.ok()) << (c.ok() ? "" : c.error().message);
  return c.ok() ? std::move(c).value() : nullptr;
}
inline std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) { x ^= x << 13; x ^= x >> 17; x ^= x << 5; v[i] = std::byte(x); }
  return v;
}
inline Payload payload_of(const std::vector<std::byte>& data, uint64_t sum) {
  Payload p;
  Value::Map m;
  m.emplace_back("sum", sum);
  m.emplace_back("t", TensorRef{0});
  p.tree = Value(std::move(m));
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(data)));
  return p;
}
inline size_t files_with(const std::string& needle) {
  size_t n = 0;
  DIR* d = opendir("/dev/shm");
  while (dirent* e = readdir(d)) if (std::string(e->d_name).find(needle) != std::string::npos) ++n;
  closedir(d);
  return n;
}
}  // namespace shm_test
