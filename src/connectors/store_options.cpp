// StoreConnector's options (store_options.hpp).
#include "connectors/store_options.hpp"

#include "connectors/store_connector.hpp"

#include <algorithm>
#include <cstdlib>

#include "core/options.hpp"

namespace stagelink {
namespace {

// "host", "host:port", "[v6]" or "[v6]:port".
// "%40" -> "@": a URL's userinfo. A '%' not followed by two hex digits is an error.
Result<std::string> percent_decode(const std::string& s, const char* what) {
  std::string out;
  out.reserve(s.size());
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    if (i + 2 >= s.size() || hex(s[i + 1]) < 0 || hex(s[i + 2]) < 0)
      return make_error(Errc::invalid_argument, std::string("StoreConnector url: the ") + what +
                                                    " has a '%' not followed by two hex digits (write '%25' for '%')");
    out += char(hex(s[i + 1]) * 16 + hex(s[i + 2]));
    i += 2;
  }
  return out;
}

Result<std::pair<std::string, int>> host_port(const std::string& s, int default_port) {
  std::string h = s, port_s;
  if (!s.empty() && s[0] == '[') {
    const size_t close = s.find(']');
    if (close == std::string::npos) return make_error(Errc::invalid_argument, "'" + s + "': unclosed '['");
    h = s.substr(1, close - 1);
    if (close + 1 < s.size()) {
      if (s[close + 1] != ':') return make_error(Errc::invalid_argument, "'" + s + "': expected [host]:port");
      port_s = s.substr(close + 2);
    }
  } else if (const size_t colon = s.rfind(':'); colon != std::string::npos && s.find(':') == colon) {
    h = s.substr(0, colon);
    port_s = s.substr(colon + 1);
  }
  int port = default_port;
  if (!port_s.empty() || (s.size() && s.back() == ':')) {
    char* end = nullptr;
    const long p = std::strtol(port_s.c_str(), &end, 10);
    if (port_s.empty() || !end || *end || p <= 0 || p > 65535)
      return make_error(Errc::invalid_argument, "'" + s + "': a port in [1, 65535]");
    port = int(p);
  }
  if (h.empty()) return make_error(Errc::invalid_argument, "'" + s + "': no host");
  return std::make_pair(h, port);
}

using options::Key;
using options::Type;
// The extra keys of StoreConnector (docs/store.md).
constexpr Key kStoreKeys[] = {
    {"backend", Type::choice, "redis", "the store (only Redis is built)", 0, 0, "redis"},
    {"url", Type::string, "", "redis[s]://[[user]:password@]host[:port][/db] (sets host, port, db, credentials, tls)"},
    {"host", Type::string, "127.0.0.1", "the server"},
    {"port", Type::integer, "6379", "the server's port", 1, 65535},
    {"username", Type::string, "", "ACL user name"},
    {"password", Type::string, "", "password (or in the url)"},
    {"db", Type::integer, "0", "database number", 0, 1 << 16},
    {"ttl_seconds", Type::number, "600", "unread puts expire after this", 1e-3, 1e12},
    {"chunk_bytes", Type::size, "1 MiB", "values are stored in chunks of this size", 4096, 512u << 20},
    {"timeout_ms", Type::number, "5000", "the server's reply timeout", 1e-3, 1e12},
    {"connections", Type::integer, "1", "connections per node", 1, 64},
    {"readers", Type::integer, "1", "default fan-out", 1, 1e6},
    {"put_timeout_s", Type::number, "30", "how long a put waits (server memory, a key being read)", 0, 1e9},
    {"buffer_cache_bytes", Type::size, "512 MiB", "frame buffers kept for reuse by gets", 0, 1ull << 40},
    {"tls", Type::any, "false", "true, or {ca_file, cert_file, key_file, server_name, verify, enabled}"},
    {"cluster", Type::any, "false", "Redis Cluster: true, or seed nodes 'host:port'"},
};
constexpr options::Schema kStoreSchema{"StoreConnector", "extra.", kStoreKeys, false, options::kCommonConnectorKeys};

}  // namespace

Result<StoreOptions> store_options(const Value& e) {
  StoreOptions o;
  SL_ASSIGN(const options::Reader r, options::Reader::open(kStoreSchema, e));
  o.ignored = r.unused();
  std::string backend = "redis", url, host = "127.0.0.1", user, pass;
  double port = 6379, ttl = o.ttl_s, chunk = double(o.chunk_bytes), tmo = 5000, conns = 1, db = 0, readers = 1,
         put_tmo = o.put_timeout_s, cache = double(o.cache_bytes);
  for (auto [k, out] : {std::pair{"backend", &backend}, {"url", &url}, {"host", &host}, {"username", &user},
                        {"password", &pass}})
    SL_TRY(r.read(k, *out));
  for (auto [k, out] : {std::pair{"port", &port}, {"ttl_seconds", &ttl}, {"chunk_bytes", &chunk}, {"timeout_ms", &tmo},
                        {"connections", &conns}, {"db", &db}, {"readers", &readers}, {"put_timeout_s", &put_tmo},
                        {"buffer_cache_bytes", &cache}})
    SL_TRY(r.read(k, *out));
  // tls: true, or {ca_file, cert_file, key_file, server_name, verify}; a rediss:// url turns it on.
  if (const Value* t = e.find("tls"); t && !t->is_nil()) {
    if (t->is<bool>()) {
      o.redis.tls.on = t->as<bool>();
    } else if (t->is<Value::Map>()) {
      o.redis.tls.on = true;
      auto& tl = o.redis.tls;
      for (const auto& [k, v] : t->as<Value::Map>()) {
        std::string* dst = k == "ca_file" ? &tl.ca_file : k == "cert_file" ? &tl.cert_file : k == "key_file" ? &tl.key_file
                           : k == "server_name" ? &tl.server_name : nullptr;
        if (dst && v.is<std::string>()) *dst = v.as<std::string>();
        else if (k == "verify" && v.is<bool>()) tl.verify = v.as<bool>();
        else if (k == "enabled" && v.is<bool>()) tl.on = v.as<bool>();
        else
          return make_error(Errc::invalid_argument, "StoreConnector tls." + k + ": expected ca_file, cert_file, key_file, "
                                                    "server_name (strings), verify or enabled (booleans)");
      }
      if (tl.cert_file.empty() != tl.key_file.empty())
        return make_error(Errc::invalid_argument, "StoreConnector tls: cert_file and key_file go together");
    } else {
      return make_error(Errc::invalid_argument, "StoreConnector tls: true, false, or a map of TLS settings");
    }
  }
  if (!url.empty()) {
    // redis://[[user]:password@]host[:port][/db]; rediss:// the same over TLS
    std::string rest;
    if (url.rfind("redis://", 0) == 0) {
      rest = url.substr(8);
    } else if (url.rfind("rediss://", 0) == 0) {
      rest = url.substr(9);
      o.redis.tls.on = true;
    } else {
      return make_error(Errc::invalid_argument, "StoreConnector url '" + url + "': expected redis[s]://host:port[/db]");
    }
    if (size_t at = rest.rfind('@'); at != std::string::npos) {
      const std::string cred = rest.substr(0, at);
      rest = rest.substr(at + 1);
      // Userinfo is percent-encoded in a URL (RFC 3986): a password holding '@', ':' or '/'
      // is written %40, %3A, %2F.
      if (size_t c = cred.find(':'); c != std::string::npos) {
        SL_ASSIGN(user, percent_decode(cred.substr(0, c), "user name"));
        SL_ASSIGN(pass, percent_decode(cred.substr(c + 1), "password"));
      } else {
        SL_ASSIGN(pass, percent_decode(cred, "password"));
      }
    }
    if (size_t slash = rest.find('/'); slash != std::string::npos) {
      db = std::atof(rest.c_str() + slash + 1);
      rest = rest.substr(0, slash);
    }
    SL_ASSIGN(auto hp, host_port(rest, 6379));
    host = hp.first;
    port = hp.second;
  }
  if (port <= 0 || port > 65535) return make_error(Errc::invalid_argument, "StoreConnector: port must be in [1, 65535]");
  o.redis.username = user;
  o.redis.password = pass;
  o.redis.db = int(db);
  o.redis.timeout_s = tmo / 1000.0;
  o.redis.connections = unsigned(conns);
  o.ttl_s = ttl;
  o.chunk_bytes = size_t(chunk);
  o.readers = uint32_t(readers);
  o.put_timeout_s = put_tmo;
  o.cache_bytes = size_t(std::max(0.0, cache));
  if (const Value* cl = e.find("cluster"); cl && !cl->is_nil() && !(cl->is<bool>() && !cl->as<bool>())) {
    o.redis.cluster = true;
    if (cl->is<Value::List>()) {
      for (const Value& s : cl->as<Value::List>()) {
        if (!s.is<std::string>()) return make_error(Errc::invalid_argument, "StoreConnector cluster: seed nodes as 'host:port'");
        SL_ASSIGN(auto hp, host_port(s.as<std::string>(), 6379));
        o.redis.nodes.push_back(hp);
      }
    } else if (cl->is<std::string>()) {
      SL_ASSIGN(auto hp, host_port(cl->as<std::string>(), 6379));
      o.redis.nodes.push_back(hp);
    } else if (!cl->is<bool>()) {
      return make_error(Errc::invalid_argument, "StoreConnector cluster: true, or a list of seed nodes 'host:port'");
    }
  }
  if (o.redis.nodes.empty()) o.redis.nodes.emplace_back(host, int(port));
  return o;
}

ConnectorDescriptor store_connector_descriptor() {
  ConnectorDescriptor d;
  d.name = "StoreConnector";
  d.schema = &kStoreSchema;
  d.factory = make_store_connector;
  d.check = [](const Value& extra) -> Status {
    SL_TRY(store_options(extra));
    return {};
  };
  d.doc = "through a distributed store (Redis, Redis Cluster), chunked, with leases";
  return d;
}

}  // namespace stagelink
