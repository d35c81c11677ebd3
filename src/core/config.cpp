#include "stagelink/config.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <set>

namespace stagelink {

const char* role_name(Role r) {
  switch (r) {
    case Role::sender: return "sender";
    case Role::receiver: return "receiver";
    case Role::dual: return "dual";
  }
  return "?";
}

int transfer_engine_port(int base, PortPurpose purpose, int from_stage, int dp_index, int tp_size, int tp_rank) {
  return base + static_cast<int>(purpose) + from_stage + dp_index * tp_size + tp_rank;
}

namespace {
struct Ctx {
  std::string source;
  Error err(const YAML::Node& n, const std::string& key, const std::string& what) const {
    std::string where = source;
    if (n.IsDefined() && n.Mark().line >= 0) where += ":" + std::to_string(n.Mark().line + 1);
    return make_error(Errc::invalid_argument, where + ": '" + key + "': " + what);
  }
};

Value scalar_value(const YAML::Node& n) {
  const std::string& s = n.Scalar();
  if (n.Tag() == "!") return Value(s);  // quoted: a string
  if (s == "~" || s == "null" || s == "Null" || s == "NULL" || s.empty()) return Value();
  if (s == "true" || s == "True" || s == "TRUE") return Value(true);
  if (s == "false" || s == "False" || s == "FALSE") return Value(false);
  try {
    size_t pos = 0;
    long long v = std::stoll(s, &pos, 0);
    if (pos == s.size()) return Value(int64_t(v));
  } catch (...) {}
  try {
    size_t pos = 0;
    double d = std::stod(s, &pos);
    if (pos == s.size()) return Value(d);
  } catch (...) {}
  return Value(s);
}

Value to_value(const YAML::Node& n, int depth = 0) {
  if (depth > 64) return Value();
  switch (n.Type()) {
    case YAML::NodeType::Scalar: return scalar_value(n);
    case YAML::NodeType::Sequence: {
      Value::List l;
      for (auto it = n.begin(); it != n.end(); ++it) l.push_back(to_value(*it, depth + 1));
      return Value(std::move(l));
    }
    case YAML::NodeType::Map: {
      Value::Map m;
      for (auto it = n.begin(); it != n.end(); ++it) m.emplace_back(it->first.as<std::string>(), to_value(it->second, depth + 1));
      return Value(std::move(m));
    }
    default: return Value();
  }
}

Result<std::string> stage_id_of(const Ctx& cx, const YAML::Node& n, const std::string& key) {
  if (!n.IsDefined() || !n.IsScalar() || n.Scalar().empty())
    return cx.err(n, key, "expected a stage id (integer or string)");
  return n.Scalar();
}

Result<ConnectorSpec> parse_spec(const Ctx& cx, const YAML::Node& n, const std::string& key) {
  if (!n.IsMap()) return cx.err(n, key, "a connector must be a map with 'name' and optional 'extra'");
  ConnectorSpec s;
  YAML::Node name = n["name"];
  if (!name.IsDefined() || !name.IsScalar() || name.Scalar().empty())
    return cx.err(n, key + ".name", "missing connector class name (e.g. SharedMemoryConnector)");
  s.name = name.Scalar();
  YAML::Node extra = n["extra"];
  if (extra.IsDefined() && !extra.IsNull()) {
    if (!extra.IsMap()) return cx.err(extra, key + ".extra", "must be a map");
    s.extra = to_value(extra);
  } else {
    s.extra = Value(Value::Map{});
  }
  return s;
}

struct Side {
  ConnectorSpec spec;
  std::string where;  // for messages
};

Result<ConnectorSpec> resolve_ref(const Ctx& cx, const YAML::Node& n, const std::string& key,
                                  const std::map<std::string, ConnectorSpec>& conns) {
  if (n.IsScalar()) {
    auto it = conns.find(n.Scalar());
    if (it == conns.end()) {
      std::string known;
      for (auto& [k, v] : conns) known += (known.empty() ? "" : ", ") + k;
      return cx.err(n, key, "names connector '" + n.Scalar() + "' which is not defined (defined: " +
                                (known.empty() ? "none" : known) + ")");
    }
    return it->second;
  }
  return parse_spec(cx, n, key);
}

Result<std::string> peer_from_key(const Ctx& cx, const YAML::Node& at, const std::string& k, const char* prefix,
                                  const std::string& key) {
  std::string p = prefix;
  if (k.rfind(p, 0) != 0 || k.size() == p.size())
    return cx.err(at, key + "." + k, std::string("expected keys of the form ") + prefix + "<stage id>");
  return k.substr(p.size());
}

ConnectorSpec default_spec() {
  ConnectorSpec s;
  s.name = "SharedMemoryConnector";
  s.extra = Value(Value::Map{});
  return s;
}

Value with_role(const Value& extra, Role r) {
  Value::Map m = extra.is<Value::Map>() ? extra.as<Value::Map>() : Value::Map{};
  m.erase(std::remove_if(m.begin(), m.end(), [](auto& kv) { return kv.first == "role"; }), m.end());
  m.emplace_back("role", role_name(r));
  return Value(std::move(m));
}

Result<TransferConfig> parse(const YAML::Node& root_in, const std::string& source) {
  const YAML::Node root = root_in;  // const access: operator[] must not insert keys
  Ctx cx{source};
  TransferConfig cfg;
  cfg.source = source;
  if (!root.IsMap()) return cx.err(root, "<root>", "the config must be a YAML map");
  // Connectors: runtime.connectors and top-level connectors.
  // A missing key of a const node is an invalid node: IsMap() on it throws, IsDefined() does not.
  const YAML::Node runtime = root["runtime"];
  const bool runtime_map = runtime.IsDefined() && runtime.IsMap();
  if (runtime.IsDefined() && !runtime.IsNull() && !runtime_map) return cx.err(runtime, "runtime", "must be a map");
  for (auto [node, key] : {std::pair{runtime_map ? runtime["connectors"] : YAML::Node(), std::string("runtime.connectors")},
                           std::pair{root["connectors"], std::string("connectors")}}) {
    if (!node.IsDefined() || node.IsNull()) continue;
    if (!node.IsMap()) return cx.err(node, key, "must be a map of connector name -> {name, extra}");
    for (auto it = node.begin(); it != node.end(); ++it) {
      std::string ref = it->first.as<std::string>();
      SL_ASSIGN(ConnectorSpec s, parse_spec(cx, it->second, key + "." + ref));
      s.ref = ref;
      cfg.connectors[ref] = s;
    }
  }
  // Stages.
  const bool legacy = root["stage_args"].IsDefined();
  const YAML::Node stages = legacy ? root["stage_args"] : root["stages"];
  const std::string stages_key = legacy ? "stage_args" : "stages";
  std::map<std::pair<std::string, std::string>, Side> outs, ins;
  std::vector<std::pair<std::string, std::string>> order;
  auto add_edge = [&](const std::string& a, const std::string& b) {
    auto e = std::make_pair(a, b);
    if (std::find(order.begin(), order.end(), e) == order.end()) order.push_back(e);
  };
  auto add_stage = [&](const std::string& s) {
    if (std::find(cfg.stages.begin(), cfg.stages.end(), s) == cfg.stages.end()) cfg.stages.push_back(s);
  };
  if (stages.IsDefined() && !stages.IsNull()) {
    if (!stages.IsSequence()) return cx.err(stages, stages_key, "must be a list of stages");
    for (size_t i = 0; i < stages.size(); ++i) {
      const YAML::Node st = stages[i];
      std::string sk = stages_key + "[" + std::to_string(i) + "]";
      if (!st.IsMap()) return cx.err(st, sk, "each stage must be a map");
      YAML::Node idn = st["stage_id"].IsDefined() ? st["stage_id"] : st["id"];
      SL_ASSIGN(std::string id, stage_id_of(cx, idn, sk + ".stage_id"));
      add_stage(id);
      if (YAML::Node src = st["engine_input_source"]; src.IsDefined() && !src.IsNull()) {
        if (src.IsScalar()) add_edge(src.Scalar(), id);
        else if (src.IsSequence()) {
          for (auto it = src.begin(); it != src.end(); ++it) {
            SL_ASSIGN(std::string from, stage_id_of(cx, *it, sk + ".engine_input_source"));
            add_edge(from, id);
          }
        } else return cx.err(src, sk + ".engine_input_source", "must be a stage id or a list of them");
      }
      for (auto [field, prefix, is_out] : {std::tuple{"output_connectors", "to_stage_", true},
                                           std::tuple{"input_connectors", "from_stage_", false}}) {
        YAML::Node m = st[field];
        if (!m.IsDefined() || m.IsNull()) continue;
        std::string fk = sk + "." + field;
        if (!m.IsMap()) return cx.err(m, fk, std::string("must be a map of ") + prefix + "<id> -> connector");
        for (auto it = m.begin(); it != m.end(); ++it) {
          std::string k = it->first.as<std::string>();
          SL_ASSIGN(std::string peer, peer_from_key(cx, it->second, k, prefix, fk));
          SL_ASSIGN(ConnectorSpec spec, resolve_ref(cx, it->second, fk + "." + k, cfg.connectors));
          auto e = is_out ? std::make_pair(id, peer) : std::make_pair(peer, id);
          (is_out ? outs : ins)[e] = Side{spec, fk + "." + k};
          add_edge(e.first, e.second);
        }
      }
    }
  }
  if (runtime_map) {
    YAML::Node edges = runtime["edges"];
    if (edges.IsDefined() && !edges.IsNull()) {
      if (!edges.IsSequence()) return cx.err(edges, "runtime.edges", "must be a list of {from, to}");
      for (size_t i = 0; i < edges.size(); ++i) {
        std::string ek = "runtime.edges[" + std::to_string(i) + "]";
        if (!edges[i].IsMap()) return cx.err(edges[i], ek, "must be a map with 'from' and 'to'");
        SL_ASSIGN(std::string from, stage_id_of(cx, edges[i]["from"], ek + ".from"));
        SL_ASSIGN(std::string to, stage_id_of(cx, edges[i]["to"], ek + ".to"));
        add_edge(from, to);
      }
    }
  }
  for (auto& [from, to] : order) {
    add_stage(from);
    add_stage(to);
    EdgeSpec e;
    e.from = from;
    e.to = to;
    auto o = outs.find({from, to});
    auto n = ins.find({from, to});
    if (o != outs.end() && n != ins.end() && o->second.spec.name != n->second.spec.name)
      return make_error(Errc::invalid_argument,
                        source + ": edge " + from + " -> " + to + ": '" + o->second.where + "' names " +
                            o->second.spec.name + " but '" + n->second.where + "' names " + n->second.spec.name +
                            "; both ends of an edge must use the same connector type");
    if (o != outs.end()) e.connector = o->second.spec;
    else if (n != ins.end()) e.connector = n->second.spec;
    else {
      e.connector = default_spec();
      e.defaulted = true;
    }
    cfg.edges.push_back(std::move(e));
  }
  return cfg;
}
}  // namespace

const EdgeSpec* TransferConfig::edge(const std::string& from, const std::string& to) const {
  for (auto& e : edges)
    if (e.from == from && e.to == to) return &e;
  return nullptr;
}

ConnectorSpec TransferConfig::connector_for_edge(const std::string& from, const std::string& to) const {
  if (auto* e = edge(from, to)) return e->connector;
  return default_spec();
}

std::vector<StageConnector> TransferConfig::stage_connectors(const std::string& stage) const {
  std::vector<StageConnector> out;
  std::set<std::string> out_refs, in_refs;
  for (auto& e : edges) {
    std::string id = e.connector.ref.empty() ? "<" + e.connector.name + ">" : e.connector.ref;
    if (e.from == stage) out_refs.insert(id);
    if (e.to == stage) in_refs.insert(id);
  }
  for (auto& e : edges) {
    bool is_out = e.from == stage, is_in = e.to == stage;
    if (!is_out && !is_in) continue;
    std::string id = e.connector.ref.empty() ? "<" + e.connector.name + ">" : e.connector.ref;
    for (bool input : {false, true}) {
      if ((input && !is_in) || (!input && !is_out)) continue;
      StageConnector sc;
      sc.input = input;
      sc.peer = input ? e.from : e.to;
      sc.role = (out_refs.count(id) && in_refs.count(id) && !e.connector.ref.empty())
                    ? Role::dual
                    : (input ? Role::receiver : Role::sender);
      sc.connector = e.connector;
      sc.connector.extra = with_role(e.connector.extra, sc.role);
      out.push_back(std::move(sc));
    }
  }
  return out;
}

Result<TransferConfig> load_transfer_config_file(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    return make_error(Errc::not_found, "cannot read config file " + path);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, path + ":" + std::to_string(e.mark.line + 1) + ": malformed YAML: " + e.msg);
  }
  try {
    return parse(root, path);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, path + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
}

Result<TransferConfig> load_transfer_config_string(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
    return parse(root, source);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, source + ":" + std::to_string(e.mark.line + 1) + ": malformed YAML: " + e.msg);
  }
}

}  // namespace stagelink
