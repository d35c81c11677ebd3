// StoreConnector's options: its extra read through its schema (src/core/options.hpp), a url
// (redis[s]://user:password@host:port/db) and tls/cluster settings turned into RedisOptions.
// Internal.
#pragma once
#include <string>
#include <vector>

#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"
#include "store/redis.hpp"

namespace stagelink {

struct StoreOptions {
  store::RedisOptions redis;
  double ttl_s = 600;
  // Measured (2 cores, Redis 7): 512 KiB-1 MiB chunks on one connection move 16-186 MiB best
  // (8 MiB chunks: half the rate; a second connection: no gain, Redis serves them in turn).
  size_t chunk_bytes = 1u << 20;
  uint32_t readers = 1;
  double put_timeout_s = 30;
  size_t cache_bytes = 512u << 20;  // frame buffers kept for reuse
  std::vector<std::string> ignored;  // extra keys this connector does not read (options::Reader::unused)
};

// `extra` read and checked. Errors: invalid_argument naming the key.
Result<StoreOptions> store_options(const Value& extra);

}  // namespace stagelink
