// SharedMemoryConnector: the default same-host connector.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "cuda/arena.hpp"
#include "stagelink/connector.hpp"

namespace stagelink {

struct ShmConnectorOptions {
  size_t shm_threshold_bytes = 65536;  // frames up to this size also travel inline in metadata
  size_t arena_bytes = 256u << 20;     // made at the first put, reserved as used; larger frames: a segment
  uint32_t max_entries = 4096;         // directory size, fixed by the first process of a namespace
  std::string ns = "default";
  std::string shm_dir = "/dev/shm";
  uint32_t readers = 1;                // default fan-out
  double put_timeout_s = 5.0;          // wait for arena room before failing with exhausted
  double ttl_s = 300.0;                // unread puts older than this are cancelled
  bool replace_existing = true;        // on_existing_key: replace (vLLM-Omni) | error
  bool preallocate_arena = false;      // create and reserve the whole arena when the connector is made
  size_t spare_bytes = size_t(1) << 30;  // a released segment of its own kept for the next such put, up to this
  // CUDA tensors (Python): left in a device arena of the producer, read over CUDA IPC (true), or
  // staged through the frame in host memory (false); cuda_arena_bytes: each device arena's size.
  bool cuda_ipc = true;
  size_t cuda_arena_bytes = cuda::kDefaultArenaBytes;
  std::vector<std::string> ignored;    // extra keys it does not read (kept, and named in health())
  static Result<ShmConnectorOptions> from_extra(const Value& extra);
};

Result<std::unique_ptr<Connector>> make_shm_connector(const ShmConnectorOptions& opts);
// Its descriptor (names, schema, traits, factory), registered by factory.cpp.
ConnectorDescriptor shm_connector_descriptor();

}  // namespace stagelink
