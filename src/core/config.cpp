#include "stagelink/config.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>

#include "core/log.hpp"

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
  std::string where;  // for messages: the key that declared it
  std::string stage;  // the stage that declared it; empty for an edge list (`list` names it)
  std::string list;
  std::string who() const { return stage.empty() ? list : "stage " + stage; }
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

ConnectorSpec default_spec(uint64_t shm_threshold_bytes) {
  ConnectorSpec s;
  s.name = "SharedMemoryConnector";
  s.extra = Value(Value::Map{{"shm_threshold_bytes", Value(shm_threshold_bytes)}});
  return s;
}

// A role the user set in `extra` is kept; only a missing one is injected.
Value with_role(const Value& extra, Role r) {
  Value::Map m = extra.is<Value::Map>() ? extra.as<Value::Map>() : Value::Map{};
  for (auto& [k, v] : m)
    if (k == "role" && !v.is_nil()) return Value(std::move(m));
  m.erase(std::remove_if(m.begin(), m.end(), [](auto& kv) { return kv.first == "role"; }), m.end());
  m.emplace_back("role", role_name(r));
  return Value(std::move(m));
}

std::optional<Role> role_from(const Value& extra) {
  const Value* r = extra.find("role");
  if (!r || !r->is<std::string>()) return std::nullopt;
  const std::string& s = r->as<std::string>();
  if (s == "sender") return Role::sender;
  if (s == "receiver") return Role::receiver;
  if (s == "dual") return Role::dual;
  return std::nullopt;
}

// The keys of two specs' extra (role aside) whose values differ; a key missing on one side and
// null on the other differs too.
std::vector<std::string> differing_keys(const Value& a, const Value& b) {
  std::vector<std::string> out;
  auto keys = [](const Value& v) {
    std::set<std::string> k;
    if (v.is<Value::Map>())
      for (auto& [key, x] : v.as<Value::Map>()) k.insert(key);
    return k;
  };
  std::set<std::string> all = keys(a);
  for (auto& k : keys(b)) all.insert(k);
  for (auto& k : all) {
    if (k == "role") continue;
    const Value *x = a.find(k), *y = b.find(k);
    if (!x || !y || !(*x == *y)) out.push_back(k);
  }
  return out;
}

// The connector of an edge declared more than once (both of its stages, an edge list).
Result<ConnectorSpec> merged_declarations(const std::vector<Side>& sides, const std::vector<std::string>& stages,
                                          const std::string& source, const std::string& from, const std::string& to) {
  // Declared more than once (both of its stages, an edge list): equal specs merge, any
  // difference is an error naming both (no silent winner). Role is not compared: the first
  // declaration (edge lists, then stages in stage order) is kept as it stands, as vLLM-Omni
  // 0.30.0 keeps it, so a role it lacks stays missing and each side then gets its direction's
  // (a later declaration's role is not taken over: a receiving stage listed first would have
    // been told the sender's role, which decides which side listens on a transfer-engine edge).
  std::vector<Side> decl = sides;
  auto rank = [&](const Side& x) {
    return x.stage.empty() ? -1 : int(std::find(stages.begin(), stages.end(), x.stage) - stages.begin());
  };
  std::stable_sort(decl.begin(), decl.end(), [&](const Side& a, const Side& b) { return rank(a) < rank(b); });
  const Side& first = decl.front();
  for (size_t i = 1; i < decl.size(); ++i) {
    const Side& other = decl[i];
    std::vector<std::string> diff;
    if (other.spec.name != first.spec.name) diff.push_back("name (" + first.spec.name + " vs " + other.spec.name + ")");
    for (auto& k : differing_keys(first.spec.extra, other.spec.extra)) diff.push_back("extra." + k);
    if (!diff.empty()) {
      std::string keys;
      for (auto& d : diff) keys += (keys.empty() ? "" : ", ") + d;
      return make_error(Errc::invalid_argument,
                        source + ": edge " + from + " -> " + to + " is declared by " + first.who() + " ('" +
                            first.where + "') and by " + other.who() + " ('" + other.where +
                            "') with different connectors: " + keys +
                            "; declare it once, or make both declarations equal");
    }
  }
  return first.spec;
}

Result<TransferConfig> parse(const YAML::Node& root_in, const std::string& source, uint64_t default_shm_threshold) {
  const YAML::Node root = root_in;  // const access: operator[] must not insert keys
  Ctx cx{source};
  TransferConfig cfg;
  cfg.source = source;
  cfg.default_shm_threshold_bytes = default_shm_threshold;
  if (!root.IsMap()) return cx.err(root, "<root>", "the config must be a YAML map");
  // Connectors: runtime.connectors and top-level connectors.
  // A missing key of a const node is an invalid node: IsMap() on it throws, IsDefined() does not.
  const YAML::Node runtime = root["runtime"];
  const bool runtime_map = runtime.IsDefined() && runtime.IsMap();
  if (runtime.IsDefined() && !runtime.IsNull() && !runtime_map) return cx.err(runtime, "runtime", "must be a map");
  // Top-level `connectors` first, then `runtime.connectors`, which wins for names in both. An
  // entry that does not parse (a partial one, e.g. left by an overlay) is an error only where an
  // edge references it.
  std::map<std::string, Error> broken;
  std::map<std::string, std::string> defined_in;
  for (auto [node, key] : {std::pair{root["connectors"], std::string("connectors")},
                           std::pair{runtime_map ? runtime["connectors"] : YAML::Node(), std::string("runtime.connectors")}}) {
    if (!node.IsDefined() || node.IsNull()) continue;
    if (!node.IsMap()) return cx.err(node, key, "must be a map of connector name -> {name, extra}");
    for (auto it = node.begin(); it != node.end(); ++it) {
      std::string ref = it->first.as<std::string>();
      if (auto d = defined_in.find(ref); d != defined_in.end()) {
        std::string note = source + ": connector '" + ref + "' is defined in both " + d->second + " and " + key +
                           "; " + key + "." + ref + " is used";
        SL_LOG_INFO("%s", note.c_str());
        cfg.notes.push_back(std::move(note));
      }
      defined_in[ref] = key;
      auto s = parse_spec(cx, it->second, key + "." + ref);
      if (!s.ok()) {
        broken.insert_or_assign(ref, std::move(s).error());
        cfg.connectors.erase(ref);
        continue;
      }
      broken.erase(ref);
      s->ref = ref;
      cfg.connectors[ref] = std::move(s).value();
    }
  }
  auto resolve = [&](const YAML::Node& n, const std::string& key) -> Result<ConnectorSpec> {
    if (n.IsScalar())
      if (auto b = broken.find(n.Scalar()); b != broken.end())
        return make_error(Errc::invalid_argument, b->second.message + " (referenced by " + key + ")");
    return resolve_ref(cx, n, key, cfg.connectors);
  };
  // Stages.
  const bool legacy = root["stage_args"].IsDefined();
  const YAML::Node stages = legacy ? root["stage_args"] : root["stages"];
  const std::string stages_key = legacy ? "stage_args" : "stages";
  // Every declaration of an edge's connector, in the order met: top-level `edges`, then stages.
  std::map<std::pair<std::string, std::string>, std::vector<Side>> sides;
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
          SL_ASSIGN(ConnectorSpec spec, resolve(it->second, fk + "." + k));
          auto e = is_out ? std::make_pair(id, peer) : std::make_pair(peer, id);
          sides[e].push_back(Side{spec, fk + "." + k, id, {}});
          add_edge(e.first, e.second);
        }
      }
    }
  }
  // Edge lists: the newer schema's top-level `edges`, and `runtime.edges`. Each entry is
  // {from, to} (or from_stage/to_stage), optionally with `connector` (a name or an inline spec).
  for (auto [edges, key] : {std::pair{root["edges"], std::string("edges")},
                            std::pair{runtime_map ? runtime["edges"] : YAML::Node(), std::string("runtime.edges")}}) {
    if (!edges.IsDefined() || edges.IsNull()) continue;
    if (!edges.IsSequence()) return cx.err(edges, key, "must be a list of {from, to[, connector]}");
    for (size_t i = 0; i < edges.size(); ++i) {
      const YAML::Node ed = edges[i];
      std::string ek = key + "[" + std::to_string(i) + "]";
      if (!ed.IsMap()) return cx.err(ed, ek, "must be a map with 'from' and 'to'");
      const char* fk = ed["from"].IsDefined() ? "from" : "from_stage";
      const char* tk = ed["to"].IsDefined() ? "to" : "to_stage";
      SL_ASSIGN(std::string from, stage_id_of(cx, ed[fk], ek + "." + fk));
      SL_ASSIGN(std::string to, stage_id_of(cx, ed[tk], ek + "." + tk));
      if (const YAML::Node cn = ed["connector"]; cn.IsDefined() && !cn.IsNull()) {
        SL_ASSIGN(ConnectorSpec spec, resolve(cn, ek + ".connector"));
        sides[{from, to}].push_back(Side{spec, ek + ".connector", {}, key});
      }
      add_edge(from, to);
    }
  }
  for (auto& [from, to] : order) {
    add_stage(from);
    add_stage(to);
    EdgeSpec e;
    e.from = from;
    e.to = to;
    auto sd = sides.find({from, to});
    if (sd == sides.end() || sd->second.empty()) {
      e.connector = default_spec(cfg.default_shm_threshold_bytes);
      e.defaulted = true;
      cfg.edges.push_back(std::move(e));
      continue;
    }
    SL_ASSIGN(e.connector, merged_declarations(sd->second, cfg.stages, source, from, to));
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
  return default_spec(default_shm_threshold_bytes);
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
      if (auto user = role_from(e.connector.extra)) sc.role = *user;  // the user's role is kept
      sc.connector = e.connector;
      sc.connector.extra = with_role(e.connector.extra, sc.role);
      out.push_back(std::move(sc));
    }
  }
  return out;
}

namespace {
namespace fs = std::filesystem;

// A list whose every element is a map with a stage id: overlays merge such lists by that id.
bool stage_list(const YAML::Node& n) {
  if (!n.IsSequence() || n.size() == 0) return false;
  for (auto it = n.begin(); it != n.end(); ++it)
    if (!it->IsMap() || !((*it)["stage_id"].IsDefined() || (*it)["id"].IsDefined())) return false;
  return true;
}
std::string stage_key(const YAML::Node& n) {
  return n["stage_id"].IsDefined() ? n["stage_id"].as<std::string>() : n["id"].as<std::string>();
}

// `over` merged over `base` (neither is modified).
YAML::Node merge_nodes(const YAML::Node& base, const YAML::Node& over) {
  if (base.IsMap() && over.IsMap()) {
    YAML::Node out = YAML::Clone(base);
    for (auto it = over.begin(); it != over.end(); ++it) {
      const std::string k = it->first.as<std::string>();
      if (k == "base_config") continue;
      const YAML::Node cur = out[k];
      out[k] = cur.IsDefined() && !cur.IsNull() ? merge_nodes(cur, it->second) : YAML::Clone(it->second);
    }
    return out;
  }
  if (stage_list(base) && stage_list(over)) {
    YAML::Node out = YAML::Clone(base);
    for (auto it = over.begin(); it != over.end(); ++it) {
      bool merged = false;
      for (size_t i = 0; i < out.size() && !merged; ++i)
        if (stage_key(out[i]) == stage_key(*it)) {
          out[i] = merge_nodes(out[i], *it);
          merged = true;
        }
      if (!merged) out.push_back(YAML::Clone(*it));
    }
    return out;
  }
  return YAML::Clone(over);
}

// `root` with its base_config chain merged under it. `dir`: where relative names are resolved.
Result<YAML::Node> with_bases(YAML::Node root, const fs::path& dir, const std::string& source,
                              std::vector<std::string>& chain) {
  if (!root.IsMap()) return root;
  const YAML::Node bn = root["base_config"];
  if (!bn.IsDefined() || bn.IsNull()) return root;
  if (!bn.IsScalar() || bn.Scalar().empty())
    return make_error(Errc::invalid_argument, source + ": 'base_config' must be a file name");
  fs::path base = fs::path(bn.Scalar());
  if (base.is_relative()) base = dir / base;
  std::error_code ec;
  fs::path canon = fs::weakly_canonical(base, ec);
  const std::string id = ec ? base.string() : canon.string();
  if (std::find(chain.begin(), chain.end(), id) != chain.end()) {
    std::string loop;
    for (auto& c : chain) loop += c + " -> ";
    return make_error(Errc::invalid_argument, source + ": base_config cycle: " + loop + id);
  }
  chain.push_back(id);
  // A directory (`base_config: /`) opens as a stream whose first read throws std::ios_base::failure,
  // which is no YAML::Exception: it ended the process (found by tests/fuzz/fuzz_config).
  if (fs::exists(base, ec) && !fs::is_regular_file(base, ec))
    return make_error(Errc::invalid_argument, source + ": base_config '" + bn.Scalar() + "': " + base.string() +
                                                  " is not a file");
  YAML::Node base_root;
  try {
    base_root = YAML::LoadFile(base.string());
  } catch (const YAML::BadFile&) {
    return make_error(Errc::not_found, source + ": base_config '" + bn.Scalar() + "': cannot read " + base.string());
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument,
                      base.string() + ":" + std::to_string(e.mark.line + 1) + ": malformed YAML: " + e.msg);
  } catch (const std::exception& e) {  // the stream's own failures (a device, a file unreadable midway)
    return make_error(Errc::io, source + ": base_config '" + bn.Scalar() + "': reading " + base.string() + ": " + e.what());
  }
  SL_ASSIGN(YAML::Node full_base, with_bases(base_root, base.parent_path(), base.string(), chain));
  return merge_nodes(full_base, root);
}

// ${VAR} and ${VAR:-default} in string scalars, from the environment.
Status expand_env(YAML::Node n, const std::string& key, const std::string& source) {
  if (n.IsMap()) {
    for (auto it = n.begin(); it != n.end(); ++it)
      SL_TRY(expand_env(it->second, key.empty() ? it->first.as<std::string>() : key + "." + it->first.as<std::string>(),
                        source));
    return {};
  }
  if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) SL_TRY(expand_env(n[i], key + "[" + std::to_string(i) + "]", source));
    return {};
  }
  if (!n.IsScalar() || n.Scalar().find("${") == std::string::npos) return {};
  SL_ASSIGN(std::string out, expand_env_value(n.Scalar(), key, source));
  const bool quoted = n.Tag() == "!";
  n = out;
  if (quoted) n.SetTag("!");  // a quoted string stays a string; an unquoted one may now be a number
  else n.SetTag("?");
  return {};
}

Result<TransferConfig> resolve_root(YAML::Node root, const fs::path& dir, const std::string& source,
                                    uint64_t default_shm_threshold) {
  std::vector<std::string> chain{source};
  SL_ASSIGN(YAML::Node full, with_bases(root, dir, source, chain));
  SL_TRY(expand_env(full, "", source));
  return parse(full, source, default_shm_threshold);
}
// A value tree as the YAML the loaders read: strings tagged as quoted (they stay strings),
// numbers written to round-trip.
Result<YAML::Node> yaml_of(const Value& v, const std::string& source, int depth) {
  if (depth > 64) return make_error(Errc::invalid_argument, source + ": nested deeper than 64 levels");
  if (v.is_nil()) return YAML::Node(YAML::NodeType::Null);
  if (v.is<std::string>()) {
    YAML::Node n(v.as<std::string>());
    n.SetTag("!");
    return n;
  }
  if (v.is<bool>()) return YAML::Node(v.as<bool>() ? "true" : "false");
  if (v.is<double>()) {
    char b[40];
    std::snprintf(b, sizeof b, "%.17g", v.as<double>());
    return YAML::Node(std::string(b));
  }
  if (int64_t i; v.get_i64(i)) return YAML::Node(std::to_string(i));
  if (uint64_t u; v.get_u64(u)) return YAML::Node(std::to_string(u));
  if (v.is<Value::List>()) {
    YAML::Node n(YAML::NodeType::Sequence);
    for (const Value& x : v.as<Value::List>()) {
      SL_ASSIGN(YAML::Node c, yaml_of(x, source, depth + 1));
      n.push_back(c);
    }
    return n;
  }
  if (v.is<Value::Map>()) {
    YAML::Node n(YAML::NodeType::Map);
    for (const auto& [k, x] : v.as<Value::Map>()) {
      SL_ASSIGN(YAML::Node c, yaml_of(x, source, depth + 1));
      n[k] = c;
    }
    return n;
  }
  return make_error(Errc::invalid_argument, source + ": a configuration holds no bytes");
}
}  // namespace

Result<std::string> expand_env_value(std::string_view in, const std::string& key, const std::string& source,
                                     bool bare) {
  static constexpr std::string_view kName = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_";
  std::string out;
  for (size_t i = 0; i < in.size();) {
    if (in[i] != '$' || i + 1 == in.size() || (in[i + 1] != '{' && !bare)) {
      out += in[i++];
      continue;
    }
    std::string body;
    size_t next;
    if (in[i + 1] == '{') {
      const size_t end = in.find('}', i + 2);
      if (end == std::string_view::npos)
        return make_error(Errc::invalid_argument, source + ": '" + key + "': unterminated ${ in '" + std::string(in) + "'");
      body = std::string(in.substr(i + 2, end - i - 2));
      next = end + 1;
    } else {  // bare $NAME: the longest run of name characters (none: a literal '$')
      size_t end = i + 1;
      while (end < in.size() && kName.find(in[end]) != std::string_view::npos) ++end;
      if (end == i + 1 || std::isdigit(static_cast<unsigned char>(in[i + 1]))) {
        out += in[i++];
        continue;
      }
      body = std::string(in.substr(i + 1, end - i - 1));
      next = end;
    }
    const size_t dflt = body.find(":-");
    const std::string name = body.substr(0, dflt);
    if (name.empty() || name.find_first_not_of(kName) != std::string::npos)
      return make_error(Errc::invalid_argument, source + ": '" + key + "': '${" + body + "}' is not a variable name");
    const char* v = std::getenv(name.c_str());
    if (v && (*v || dflt == std::string::npos)) out += v;  // ${X:-d}: d also when X is empty, as the shell
    else if (dflt != std::string::npos) out += body.substr(dflt + 2);
    else
      return make_error(Errc::invalid_argument, source + ": '" + key + "': environment variable " + name +
                                                    " is not set (give a default: ${" + name + ":-value})");
    i = next;
  }
  return out;
}

Result<TransferConfig> load_transfer_config_file(const std::string& path, uint64_t default_shm_threshold_bytes) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    return make_error(Errc::not_found, "cannot read config file " + path);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, path + ":" + std::to_string(e.mark.line + 1) + ": malformed YAML: " + e.msg);
  }
  try {
    return resolve_root(root, fs::path(path).parent_path(), path, default_shm_threshold_bytes);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, path + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
}

Result<TransferConfig> load_transfer_config_string(const std::string& text, const std::string& source,
                                                   uint64_t default_shm_threshold_bytes) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
    return resolve_root(root, fs::current_path(), source, default_shm_threshold_bytes);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, source + ":" + std::to_string(e.mark.line + 1) + ": malformed YAML: " + e.msg);
  }
}

Result<TransferConfig> load_transfer_config_value(const Value& root, const std::string& source,
                                                  uint64_t default_shm_threshold_bytes) {
  try {
    SL_ASSIGN(YAML::Node node, yaml_of(root, source, 0));
    return resolve_root(node, fs::current_path(), source, default_shm_threshold_bytes);
  } catch (const YAML::Exception& e) {
    return make_error(Errc::invalid_argument, source + ": " + e.msg);
  }
}

}  // namespace stagelink
