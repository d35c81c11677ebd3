// Transfer config: reads vLLM-Omni's YAML unchanged (runtime.connectors + stage_args, or the
// newer top-level connectors + stages) and resolves every edge to a connector.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink {

struct ConnectorSpec {
  std::string name;   // class name, e.g. SharedMemoryConnector
  Value extra;        // map
  std::string ref;    // config reference name ("" for inline or default)
};

struct EdgeSpec {
  std::string from, to;
  ConnectorSpec connector;
  bool defaulted = false;  // no connector was named: SharedMemoryConnector filled in
};

enum class Role { sender, receiver, dual };
const char* role_name(Role r);

// Port purposes of the transfer-engine side channel (seed 004).
enum class PortPurpose { request_forwarding = 0, kv_transfer = 100, orchestrator = 200 };
// base + purpose + from_stage + dp_index * tp_size + tp_rank
int transfer_engine_port(int base, PortPurpose purpose, int from_stage, int dp_index = 0,
                         int tp_size = 1, int tp_rank = 0);

struct StageConnector {
  std::string peer;  // the stage on the other end
  bool input = false;
  ConnectorSpec connector;  // with role injected into extra
  Role role = Role::sender;
};

// vLLM-Omni's default_shm_threshold (and the shared-memory connector's own default).
inline constexpr uint64_t kDefaultShmThresholdBytes = 65536;

class TransferConfig {
 public:
  std::vector<EdgeSpec> edges;
  std::map<std::string, ConnectorSpec> connectors;  // by reference name
  std::vector<std::string> stages;
  std::string source;  // file name or "<dict>"
  std::vector<std::string> notes;  // what loading decided that a reader should know (overrides)
  // An edge no connector is declared for gets SharedMemoryConnector with this threshold in its
  // extra, as vLLM-Omni's loader does (its default_shm_threshold).
  uint64_t default_shm_threshold_bytes = kDefaultShmThresholdBytes;

  const EdgeSpec* edge(const std::string& from, const std::string& to) const;
  // The edge's connector, or SharedMemoryConnector defaults when the edge is unknown.
  ConnectorSpec connector_for_edge(const std::string& from, const std::string& to) const;
  // Every edge touching stage_id, with its role injected (sender, receiver, or dual when one
  // connector reference serves both directions of this stage).
  std::vector<StageConnector> stage_connectors(const std::string& stage_id) const;
};

// Both loaders, as vLLM-Omni: `base_config: other.yaml` merges the file over `other.yaml` (a path
// relative to the file's directory, or to the working directory for a string; chains allowed,
// cycles refused; maps merge key by key, stage lists by stage id, other values are replaced), and
// `${VAR}` / `${VAR:-default}` in string values are expanded from the environment (an unset
// variable without a default is an error naming the key).
// `default_shm_threshold_bytes`: the `shm_threshold_bytes` of the SharedMemoryConnector given to
// edges that declare no connector.
Result<TransferConfig> load_transfer_config_file(const std::string& path,
                                                 uint64_t default_shm_threshold_bytes = kDefaultShmThresholdBytes);
Result<TransferConfig> load_transfer_config_string(const std::string& yaml,
                                                   const std::string& source = "<string>",
                                                   uint64_t default_shm_threshold_bytes = kDefaultShmThresholdBytes);
// The same from values already read (a YAML file a caller parsed itself, e.g. the pipeline
// file's `edges:` and `connectors:`): strings stay strings; errors name `source` and the key
// (no line: the values carry none). Errors: invalid_argument (bytes, or nesting deeper than 64).
Result<TransferConfig> load_transfer_config_value(const Value& root, const std::string& source = "<value>",
                                                  uint64_t default_shm_threshold_bytes = kDefaultShmThresholdBytes);

// One string value expanded as the loaders do (`key` and `source` name it in errors). `bare`: also
// `$VAR` without braces, as vLLM-Omni's connectors take it in a host.
Result<std::string> expand_env_value(std::string_view in, const std::string& key, const std::string& source,
                                     bool bare = false);

}  // namespace stagelink
