#include <cstring>
#include <map>
#include <mutex>

#include "connectors/internal_key.hpp"
#include "connectors/names.hpp"
#include "connectors/shm_connector.hpp"
#include "connectors/store_connector.hpp"
#include "connectors/te_connector.hpp"
#include "core/options.hpp"
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
// The registered descriptors by name; `names` maps every name and alias to its descriptor's name.
struct Registry {
  std::mutex mu;
  std::map<std::string, ConnectorDescriptor> by_name;
  std::map<std::string, std::string> names;

  void add(ConnectorDescriptor d) {
    if (auto old = by_name.find(d.name); old != by_name.end())
      for (const auto& a : old->second.aliases) names.erase(a);
    names[d.name] = d.name;
    for (const auto& a : d.aliases) names[a] = d.name;
    by_name[d.name] = std::move(d);
  }
  const ConnectorDescriptor* find(const std::string& name) const {
    auto it = names.find(name);
    if (it == names.end()) return nullptr;
    auto d = by_name.find(it->second);
    return d == by_name.end() ? nullptr : &d->second;
  }
};

ConnectorDescriptor mooncake_store_descriptor() {
  ConnectorDescriptor d;
  d.name = "MooncakeStoreConnector";
  d.aliases = {"MooncakeConnector"};  // vLLM-Omni's other name for it (its CI stage configs use it)
  d.traits = uint32_t(ConnectorTrait::python_made);
  d.python = "stagelink.mooncake_store:MooncakeStoreConnector";
  d.doc = "Mooncake's distributed store, through its Python client (vLLM-Omni's connector)";
  return d;
}

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry();
    for (auto d : {shm_connector_descriptor(), store_connector_descriptor(), te_connector_descriptor(),
                   mooncake_store_descriptor()})
      reg->add(std::move(d));
    return reg;
  }();
  return *r;
}

std::string known_names(const Registry& r) {
  std::string known;
  for (const auto& [k, v] : r.names) known += (known.empty() ? "" : ", ") + k;
  return known;
}
}  // namespace

Result<std::unique_ptr<Connector>> create_connector(const std::string& name, const Value& extra) {
  ConnectorFactory make;
  std::string label;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    const ConnectorDescriptor* d = r.find(name);
    if (!d) return make_error(Errc::not_found, "unknown connector '" + name + "' (known: " + known_names(r) + ")");
    if (!d->factory) {
      std::string made_here;  // what C++ can make instead
      for (const auto& [k, other] : r.by_name)
        if (other.factory) made_here += (made_here.empty() ? "" : ", ") + k;
      return make_error(Errc::unsupported, name + " is made by stagelink's Python layer (" + d->python +
                                               "): create it from Python (stagelink.create_connector), or "
                                               "from C++ one of " + made_here);
    }
    make = d->factory;
    label = d->name;
  }
  auto c = make(name, extra);
  if (c.ok() && *c) (*c)->set_metrics_label(std::move(label));
  return c;
}

void register_connector(ConnectorDescriptor d) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.add(std::move(d));
}

void register_connector(const std::string& name, ConnectorCreator creator) {
  ConnectorDescriptor d;
  d.name = name;
  d.factory = [creator = std::move(creator)](const std::string&, const Value& extra) { return creator(extra); };
  register_connector(std::move(d));
}

std::optional<ConnectorDescriptor> find_connector(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const ConnectorDescriptor* d = r.find(name);
  if (!d) return std::nullopt;
  return *d;
}

std::vector<ConnectorDescriptor> connectors() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<ConnectorDescriptor> out;
  for (const auto& [k, d] : r.by_name) out.push_back(d);
  return out;
}

Status check_connector_options(const std::string& name, const Value& extra) {
  auto d = find_connector(name);
  if (!d) return make_error(Errc::not_found, "unknown connector '" + name + "'");
  if (d->check) SL_TRY(d->check(extra));
  // Every declared key by its type, the common ones too (strict, get_timeout_s: read in Python).
  if (d->schema) SL_TRY(options::check(*d->schema, extra));
  return {};
}

std::vector<std::string> registered_connectors() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const auto& [k, v] : r.names) out.push_back(k);
  return out;
}

}  // namespace stagelink
