// SharedMemoryConnector's options (ShmConnectorOptions::from_extra, shm_connector.hpp): its extra
// read through its schema (src/core/options.hpp).
#include <cctype>

#include "connectors/shm_connector.hpp"
#include "core/options.hpp"
#include "shm/directory.hpp"

namespace stagelink {

namespace {
using options::Key;
using options::Type;
// The extra keys of SharedMemoryConnector (docs/reference/configuration.md is generated from it).
constexpr Key kShmKeys[] = {
    {"shm_threshold_bytes", Type::size, "65536", "frames up to this size also travel inline in the metadata", 0, 1u << 30},
    {"arena_bytes", Type::size, "256 MiB",
     "the producer's arena, made at the first put and reserved in 2 MiB steps as puts reach into it; larger frames "
     "get a segment of their own", 1u << 16, 1ull << 40},
    {"preallocate_arena", Type::boolean, "false", "create and reserve the whole arena when the connector is made"},
    {"spare_bytes", Type::size, "1 GiB",
     "a frame's own segment (larger than the arena), once every reader released it, is kept for the producer's "
     "next such frame when it is at most this size (0: never); gone at close", 0, 1ull << 40},
    {"readers", Type::integer, "1", "default fan-out; put(..., readers=N) per call", 1, shm::kMaxFanout},
    {"fanout", Type::integer, "", "the seed's name for readers", 1, shm::kMaxFanout},
    {"put_timeout_s", Type::number, "5", "how long a put waits for arena room before `exhausted`", 0, 1e9},
    {"ttl_s", Type::number, "300", "unread puts older than this are cancelled", 0, 1e12},
    {"namespace", Type::string, "default", "isolates groups of processes (1..48 letters, digits, '_', '-')"},
    {"shm_dir", Type::string, "/dev/shm", "where segments live (an absolute path)"},
    {"max_entries", Type::integer, "4096", "key-directory size (a power of two), fixed by the first process", 64,
     1u << 20},
    {"on_existing_key", Type::choice, "replace", "a put of an unread key replaces it, or fails (`error`)", 0, 0,
     "replace|error"},
    {"cuda_ipc", Type::boolean, "true",
     "CUDA tensors stay on their GPU: put copies them into a device arena of the producer, get maps it over CUDA "
     "IPC (false: staged through host memory)"},
    {"cuda_arena_bytes", Type::size, "256 MiB", "each device arena's size (a larger tensor gets one of its own)",
     1u << 20, 1ull << 40},
};
constexpr options::Schema kShmSchema{"SharedMemoryConnector", "extra.", kShmKeys, false, options::kCommonConnectorKeys};
}  // namespace

Result<ShmConnectorOptions> ShmConnectorOptions::from_extra(const Value& extra) {
  ShmConnectorOptions o;
  SL_ASSIGN(const options::Reader r, options::Reader::open(kShmSchema, extra));
  o.ignored = r.unused();
  std::string on_existing = "replace";
  SL_TRY(r.read_int("shm_threshold_bytes", o.shm_threshold_bytes));
  SL_TRY(r.read_int("arena_bytes", o.arena_bytes));
  SL_TRY(r.read("preallocate_arena", o.preallocate_arena));
  SL_TRY(r.read_int("spare_bytes", o.spare_bytes));
  SL_TRY(r.read_int("readers", o.readers));
  SL_TRY(r.read_int("fanout", o.readers));
  SL_TRY(r.read("put_timeout_s", o.put_timeout_s));
  SL_TRY(r.read("ttl_s", o.ttl_s));
  SL_TRY(r.read("namespace", o.ns));
  SL_TRY(r.read("shm_dir", o.shm_dir));
  SL_TRY(r.read_int("max_entries", o.max_entries));
  SL_TRY(r.read("on_existing_key", on_existing));
  SL_TRY(r.read("cuda_ipc", o.cuda_ipc));
  SL_TRY(r.read_int("cuda_arena_bytes", o.cuda_arena_bytes));
  o.replace_existing = on_existing == "replace";
  if (o.shm_dir.empty() || o.shm_dir[0] != '/')
    return make_error(Errc::invalid_argument, "SharedMemoryConnector: extra.shm_dir must be an absolute path, got '" +
                                                  o.shm_dir + "'");
  if (o.ns.empty() || o.ns.size() > 48)
    return make_error(Errc::invalid_argument, "SharedMemoryConnector: extra.namespace must have 1..48 characters");
  for (char c : o.ns)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-')
      return make_error(Errc::invalid_argument, "SharedMemoryConnector: extra.namespace '" + o.ns +
                                                    "' may hold only letters, digits, '_' and '-'");
  return o;
}

ConnectorDescriptor shm_connector_descriptor() {
  ConnectorDescriptor d;
  d.name = "SharedMemoryConnector";
  d.schema = &kShmSchema;
  d.traits = uint32_t(ConnectorTrait::host_local) | uint32_t(ConnectorTrait::pickle_default) |
             uint32_t(ConnectorTrait::device_slots) | uint32_t(ConnectorTrait::lookup_gets);
  d.factory = [](const std::string&, const Value& extra) -> Result<std::unique_ptr<Connector>> {
    SL_ASSIGN(auto opts, ShmConnectorOptions::from_extra(extra));
    return make_shm_connector(opts);
  };
  d.check = [](const Value& extra) -> Status {
    SL_TRY(ShmConnectorOptions::from_extra(extra));
    return {};
  };
  d.doc = "this host's processes, through shared memory (the default; no service)";
  return d;
}

}  // namespace stagelink
