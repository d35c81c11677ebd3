// One reader of option maps (a connector's `extra`, the relay's config). Each owner declares a
// schema: every key with its type, default, range and meaning. Reading through it gives one error
// style, naming the owner and the key:
//   "SharedMemoryConnector: extra.readers must be an integer in [1, 8], got 9"
// A key the schema does not know is refused when it is a near miss of one it does ("did you mean
// ..."), and otherwise left alone and reported (Reader::unused): vLLM-Omni's orchestrator and other
// callers add keys of their own to every connector's extra (stage_id, ...), which a connector must
// accept as vLLM-Omni's connectors do. A schema marked `closed` (the relay's config, which only
// stagelink writes) refuses every unknown key. Keys every connector takes (kCommonConnectorKeys: strict,
// get_timeout_s, allow_pickle, role, stage_id) are declared once and nested in each connector's
// schema (Schema::common); a connector's own key of the same name takes precedence. Connectors'
// schemas are listed through their descriptors (stagelink/connector.hpp: connectors()), the
// relay's by relay_schema() (src/relay), for the documentation's configuration reference.
#pragma once
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink::options {

enum class Type : uint8_t {
  boolean,
  integer,  // an exact integer (a float with a fraction is refused)
  number,   // int or float
  size,     // bytes: an integer, or a string with a unit ("4GB", "512MiB")
  string,
  choice,   // a string among Key::choices ("a|b|c")
  map,      // a nested map read by its owner (e.g. curve, tls)
  any,      // anything (read by its owner, or by the Python layer)
};
const char* type_name(Type t);

struct Key {
  std::string_view name;
  Type type;
  std::string_view def;  // the default as the docs give it ("" when none)
  std::string_view doc;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::string_view choices = {};  // choice: "a|b|c"
};

struct Schema {
  std::string_view owner;   // "SharedMemoryConnector", "relay config"
  std::string_view prefix;  // how a key is named in errors: "extra." for connectors, "" for the relay
  std::span<const Key> keys;
  bool closed = false;      // every unknown key refused
  std::span<const Key> common = {};  // keys shared with other owners (kCommonConnectorKeys), after `keys`
  // A key by name: the owner's own first, then the common ones.
  const Key* find(std::string_view name) const;
  // Every key, the owner's own first, then the common ones it does not redeclare.
  std::vector<const Key*> all() const;
};

// The keys every connector's extra takes (Python's strict and get_timeout_s, allow_pickle,
// vLLM-Omni's role and stage_id): nested in each connector's schema as Schema::common.
inline constexpr Key kCommonConnectorKeys[] = {
    {"get_timeout_s", Type::number, "none", "default timeout of a keyless get (Python; none: one attempt)", 0, 1e9},
    {"strict", Type::boolean, "false", "raise instead of returning False/None (Python)"},
    {"allow_pickle", Type::boolean, "by connector",
     "objects without a native frame may be pickled: on by default only where the data stays with this host's "
     "user (SharedMemoryConnector), off between hosts; off: refused at put and get"},
    {"role", Type::string, "", "sender, receiver or dual (set by the config loader)"},
    {"stage_id", Type::any, "", "the stage this connector serves (vLLM-Omni's orchestrator sets it)"},
};

// Every key of `s` read by its type (the check of an owner that has no reader of its own: a
// user's connector registered with a schema). Errors: those of Reader.
Status check(const Schema& s, const Value& v);

class Reader {
 public:
  // `v`: the map to read (nil reads as empty). Errors: invalid_argument (not a map, an unknown key
  // refused as above).
  static Result<Reader> open(const Schema& s, const Value& v);

  // Each read leaves `out` as it is when the key is missing or null. Errors: invalid_argument
  // naming the key (wrong type, out of range, not a choice).
  Status read(std::string_view key, double& out) const;         // integer, number, size
  Status read(std::string_view key, std::string& out) const;    // string, choice
  Status read(std::string_view key, bool& out) const;           // boolean
  template <class Int>
  Status read_int(std::string_view key, Int& out) const {
    double d = double(out);
    SL_TRY(read(key, d));
    out = Int(d);
    return {};
  }
  // The value of a key (map, any), or null when missing or null.
  const Value* raw(std::string_view key) const;
  // Keys the schema does not know, left alone (see above).
  const std::vector<std::string>& unused() const { return unused_; }

 private:
  Reader(const Schema& s, const Value& v) : s_(&s), v_(v) {}
  Error bad(const Key& k, const std::string& what, const Value& got) const;
  const Key& key(std::string_view name) const;
  const Schema* s_;
  Value v_;  // a copy: a reader may outlive the map it was opened on (config maps are small)
  std::vector<std::string> unused_;
};

// health()'s "ignored_extra_keys": the keys a connector was given and does not read (none: left out).
void add_ignored(Value::Map& health, const std::vector<std::string>& ignored);

// "4GB", "512 MiB", "1024": bytes; false for anything else.
bool parse_size(std::string_view s, double& out);

}  // namespace stagelink::options
