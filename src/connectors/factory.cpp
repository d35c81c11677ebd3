#include <cstring>
#include <map>
#include <mutex>

#include "connectors/internal_key.hpp"
#include "connectors/names.hpp"
#include "connectors/shm_connector.hpp"
#include "connectors/store_connector.hpp"
#include "connectors/store_options.hpp"
#include "connectors/te_connector.hpp"
#include "stagelink/connector.hpp"

namespace stagelink {

std::string make_internal_key(const std::string& key, const std::string& from, const std::string& to) {
  std::string k(internal_key_size(key, from, to), '\0');
  write_internal_key(k.data(), key, from, to);
  return k;
}

Result<size_t> get_into(Connector& c, const std::string& from, const std::string& to, const std::string& key,
                        const Value* metadata, Deadline deadline, std::span<std::byte> dst, size_t tensor) {
  SL_ASSIGN(GetResult g, c.get(from, to, key, metadata, deadline, GetOptions{true}));
  if (tensor >= g.payload.tensors.size())
    return make_error(Errc::invalid_argument, "get_into: '" + key + "' has " + std::to_string(g.payload.tensors.size()) +
                                                  " tensors, no tensor " + std::to_string(tensor));
  const Tensor& t = g.payload.tensors[tensor];
  if (t.nbytes() > dst.size())
    return make_error(Errc::invalid_argument, "get_into: tensor of '" + key + "' has " + std::to_string(t.nbytes()) +
                                                  " bytes; the destination holds " + std::to_string(dst.size()));
  if (t.nbytes()) std::memcpy(dst.data(), t.data.data(), t.nbytes());
  return t.nbytes();
}

Status validate_name(std::string_view what, std::string_view s, size_t max_len) {
  if (name_is_valid(s, max_len)) return {};
  if (s.empty()) return make_error(Errc::invalid_argument, std::string(what) + " is empty");
  if (s.size() > max_len)
    return make_error(Errc::invalid_argument, std::string(what) + " has " + std::to_string(s.size()) +
                                                  " characters; at most " + std::to_string(max_len) + " allowed");
  for (unsigned char c : s)
    if (c < 0x20 || c == 0x7f || c == '/')
      return make_error(Errc::invalid_argument, std::string(what) + " '" + std::string(s) +
                                                    "' contains '/' or a control character");
  if (s.find("..") != std::string_view::npos)
    return make_error(Errc::invalid_argument, std::string(what) + " '" + std::string(s) + "' contains '..'");
  return {};
}

namespace {
struct Registry {
  std::mutex mu;
  std::map<std::string, ConnectorCreator> creators;
};


Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry();
    auto shm = [](const Value& extra) -> Result<std::unique_ptr<Connector>> {
      SL_ASSIGN(auto opts, ShmConnectorOptions::from_extra(extra));
      return make_shm_connector(opts);
    };
    reg->creators["SharedMemoryConnector"] = shm;
    // MooncakeConnector: vLLM-Omni's other name for it (its CI configs use that one).
    for (const char* n : {"MooncakeStoreConnector", "MooncakeConnector"}) {
      const std::string name = n;
      reg->creators[name] = [name](const Value&) -> Result<std::unique_ptr<Connector>> {
        return make_error(Errc::unsupported,
                          name + " drives Mooncake's Python client: create it from Python "
                                 "(stagelink.create_connector), or use StoreConnector (Redis) from C++");
      };
    }
    reg->creators["StoreConnector"] = [](const Value& extra) { return make_store_connector("StoreConnector", extra); };
    for (const char* n : {"MooncakeTransferEngineConnector", "TransferEngineConnector"}) {
      const std::string name = n;
      reg->creators[name] = [name](const Value& extra) { return make_te_connector(name, extra); };
    }
    return reg;
  }();
  return *r;
}
}  // namespace

Result<std::unique_ptr<Connector>> create_connector(const std::string& name, const Value& extra) {
  ConnectorCreator c;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.creators.find(name);
    if (it == r.creators.end()) {
      std::string known;
      for (auto& [k, v] : r.creators) known += (known.empty() ? "" : ", ") + k;
      return make_error(Errc::not_found, "unknown connector '" + name + "' (known: " + known + ")");
    }
    c = it->second;
  }
  return c(extra);
}

void register_connector(const std::string& name, ConnectorCreator creator) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.creators[name] = std::move(creator);
}

Status check_connector_options(const std::string& name, const Value& extra) {
  auto status = [](auto&& r) -> Status {
    if (!r.ok()) return std::move(r).error();
    return {};
  };
  if (name == "SharedMemoryConnector") return status(ShmConnectorOptions::from_extra(extra));
  if (name == "StoreConnector") return status(store_options(extra));
  if (name == "TransferEngineConnector" || name == "MooncakeTransferEngineConnector") return check_te_options(extra);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.creators.count(name)) return make_error(Errc::not_found, "unknown connector '" + name + "'");
  return {};
}

std::vector<std::string> registered_connectors() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (auto& [k, v] : r.creators) out.push_back(k);
  return out;
}

}  // namespace stagelink
