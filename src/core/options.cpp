#include "core/options.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstdio>

namespace stagelink::options {

const char* type_name(Type t) {
  switch (t) {
    case Type::boolean: return "boolean";
    case Type::integer: return "integer";
    case Type::number: return "number";
    case Type::size: return "size";
    case Type::string: return "string";
    case Type::choice: return "choice";
    case Type::map: return "map";
    case Type::any: return "any";
  }
  return "?";
}

void add_ignored(Value::Map& health, const std::vector<std::string>& ignored) {
  if (ignored.empty()) return;
  Value::List l;
  for (const auto& k : ignored) l.emplace_back(k);
  health.emplace_back("ignored_extra_keys", Value(std::move(l)));
}

const Key* Schema::find(std::string_view name) const {
  for (const Key& k : keys)
    if (k.name == name) return &k;
  for (const Key& k : common)
    if (k.name == name) return &k;
  return nullptr;
}

std::vector<const Key*> Schema::all() const {
  std::vector<const Key*> out;
  for (const Key& k : keys) out.push_back(&k);
  for (const Key& k : common)
    if (std::none_of(keys.begin(), keys.end(), [&](const Key& own) { return own.name == k.name; })) out.push_back(&k);
  return out;
}


bool parse_size(std::string_view s, double& out) {
  std::string str(s);
  char* end = nullptr;
  const double d = std::strtod(str.c_str(), &end);
  if (end == str.c_str()) return false;
  std::string unit(end);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char c) { return std::isspace(c); }), unit.end());
  for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  const double mul = unit.empty() || unit == "B"        ? 1
                     : unit == "KB" || unit == "KIB"    ? 1024.0
                     : unit == "MB" || unit == "MIB"    ? 1048576.0
                     : unit == "GB" || unit == "GIB"    ? 1073741824.0
                     : unit == "TB" || unit == "TIB"    ? 1099511627776.0
                                                        : -1;
  if (mul < 0 || !(d >= 0)) return false;
  out = d * mul;
  return true;
}

namespace {

// A number written as a string ("8080", "2.5"; with a unit for sizes: "4GB"); false otherwise.
bool parse_number(const std::string& s, bool size, double& out) {
  if (size) return parse_size(s, out);
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (end == s.c_str()) return false;
  while (*end && std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (*end) return false;
  out = d;
  return true;
}

// Edit distance up to 3 (a near miss of a known key is a typo, refused with a suggestion).
size_t distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cur = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
      prev = cur;
    }
  }
  return row[b.size()];
}

std::string shown(const Value& v) {
  if (v.is<std::string>()) return "'" + v.as<std::string>() + "'";
  if (v.is<bool>()) return v.as<bool>() ? "true" : "false";
  if (v.is<double>()) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v.as<double>());
    return b;
  }
  int64_t i;
  if (v.get_i64(i)) return std::to_string(i);
  uint64_t u;
  if (v.get_u64(u)) return std::to_string(u);
  if (v.is<Value::Map>()) return "a map";
  if (v.is<Value::List>()) return "a list";
  return "a value of another kind";
}

std::string bound(double d) {
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char b[32];
  std::snprintf(b, sizeof b, "%.17g", d);
  return b;
}

}  // namespace

Result<Reader> Reader::open(const Schema& s, const Value& v) {
  Reader r(s, v);
  if (v.is_nil()) return r;
  if (!v.is<Value::Map>())
    return make_error(Errc::invalid_argument, std::string(s.owner) + ": " +
                                                  (s.prefix.empty() ? std::string("the config") : std::string(s.prefix.substr(0, s.prefix.size() - 1))) +
                                                  " must be a map");
  for (const auto& [k, val] : v.as<Value::Map>()) {
    (void)val;
    if (s.find(k)) continue;
    const Key* near = nullptr;  // a near miss of a known key: a typo
    size_t best = 3;
    for (const Key* known : s.all())
      if (const size_t d = distance(k, known->name); d < best) {
        best = d;
        near = known;
      }
    if (k.size() < 5) near = nullptr;  // short keys are near everything
    if (near || s.closed) {
      std::string known;
      for (const Key* kk : s.all()) known += (known.empty() ? "" : ", ") + std::string(kk->name);
      return make_error(Errc::invalid_argument,
                        std::string(s.owner) + ": unknown key '" + std::string(s.prefix) + k + "'" +
                            (near ? "; did you mean '" + std::string(near->name) + "'?" : " (known: " + known + ")"));
    }
    r.unused_.push_back(k);
  }
  return r;
}

const Key& Reader::key(std::string_view name) const {
  const Key* k = s_->find(name);
  if (!k) std::abort();  // a read of a key the owner did not declare: a bug in stagelink
  return *k;
}

const Value* Reader::raw(std::string_view name) const {
  (void)key(name);
  const Value* v = v_.is<Value::Map>() ? v_.find(name) : nullptr;
  return v && !v->is_nil() ? v : nullptr;
}

Error Reader::bad(const Key& k, const std::string& what, const Value& got) const {
  return make_error(Errc::invalid_argument, std::string(s_->owner) + ": " + std::string(s_->prefix) +
                                                std::string(k.name) + " must be " + what + ", got " + shown(got));
}

Status Reader::read(std::string_view name, double& out) const {
  const Key& k = key(name);
  const Value* v = raw(name);
  if (!v) return {};
  std::string kind = k.type == Type::integer ? "an integer" : k.type == Type::size ? "a size in bytes (or '4GB')" : "a number";
  if (!std::isinf(k.min) || !std::isinf(k.max)) kind += " in [" + bound(k.min) + ", " + bound(k.max) + "]";
  double d = 0;
  int64_t i;
  uint64_t u;
  if (v->is<double>()) d = v->as<double>();
  else if (v->get_i64(i)) d = double(i);
  else if (v->get_u64(u)) d = double(u);
  else if (v->is<std::string>() && parse_number(v->as<std::string>(), k.type == Type::size, d)) {
    // "${PORT}" in a config file expands to a string: numbers written as strings are read too
  } else return bad(k, kind, *v);
  if (k.type == Type::integer && d != std::floor(d)) return bad(k, kind, *v);
  if (!(d >= k.min && d <= k.max)) return bad(k, kind, *v);
  out = d;
  return {};
}

Status Reader::read(std::string_view name, std::string& out) const {
  const Key& k = key(name);
  const Value* v = raw(name);
  if (!v) return {};
  if (k.type == Type::choice) {
    std::string opts(k.choices);
    std::replace(opts.begin(), opts.end(), '|', ' ');
    const std::string what = "one of: " + opts;
    if (!v->is<std::string>()) return bad(k, what, *v);
    std::string_view c = k.choices;
    for (size_t at = 0;;) {
      const size_t bar = c.find('|', at);
      if (c.substr(at, bar == std::string_view::npos ? bar : bar - at) == v->as<std::string>()) {
        out = v->as<std::string>();
        return {};
      }
      if (bar == std::string_view::npos) return bad(k, what, *v);
      at = bar + 1;
    }
  }
  if (!v->is<std::string>()) return bad(k, "a string", *v);
  out = v->as<std::string>();
  return {};
}

Status Reader::read(std::string_view name, bool& out) const {
  const Key& k = key(name);
  const Value* v = raw(name);
  if (!v) return {};
  if (!v->is<bool>()) return bad(k, "true or false", *v);
  out = v->as<bool>();
  return {};
}

Status check(const Schema& s, const Value& v) {
  SL_ASSIGN(const Reader r, Reader::open(s, v));
  for (const Key* k : s.all()) {
    switch (k->type) {
      case Type::boolean: {
        bool b = false;
        SL_TRY(r.read(k->name, b));
        break;
      }
      case Type::integer:
      case Type::number:
      case Type::size: {
        double d = 0;
        SL_TRY(r.read(k->name, d));
        break;
      }
      case Type::string:
      case Type::choice: {
        std::string str;
        SL_TRY(r.read(k->name, str));
        break;
      }
      case Type::map:
        if (const Value* m = r.raw(k->name); m && !m->is<Value::Map>())
          return make_error(Errc::invalid_argument, std::string(s.owner) + ": " + std::string(s.prefix) +
                                                        std::string(k->name) + " must be a map");
        break;
      case Type::any: break;
    }
  }
  return {};
}

}  // namespace stagelink::options
