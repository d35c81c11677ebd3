#include "stagelink/control.hpp"

#include "stagelink/trace.hpp"

#include <array>
#include <string_view>

namespace stagelink {

namespace {
constexpr std::array<const char*, kControlTypeCount> kNames = {
    "submit", "data_ready", "data_ack", "complete", "stream", "shutdown", "abort", "abort_ack", "ready",
    "progress", "peers", "peers_known", "connect", "connected", "stats", "launch",
    "metrics_ask", "metrics", "trace"};
constexpr uint64_t kVersion = 1;

Status check_size(const char* field, size_t n, size_t max) {
  if (n <= max) return {};
  return make_error(Errc::invalid_argument, std::string("control message field '") + field + "' has " +
                                                std::to_string(n) + " bytes; at most " + std::to_string(max));
}
Error bad(const std::string& what) { return Error{Errc::corrupt, "control message: " + what}; }

}  // namespace

const char* control_type_name(ControlType t) noexcept {
  const auto i = static_cast<size_t>(t);
  return i < kNames.size() ? kNames[i] : "?";
}

Result<ControlType> control_type_from_name(std::string_view name) {
  for (size_t i = 0; i < kNames.size(); ++i)
    if (name == kNames[i]) return static_cast<ControlType>(i);
  return make_error(Errc::invalid_argument, "unknown control message type '" + std::string(name) + "'");
}

Result<std::vector<std::byte>> encode_control(const ControlMessage& m) {
  if (static_cast<size_t>(m.type) >= kNames.size()) return make_error(Errc::invalid_argument, "unknown control message type");
  if (m.request_id.empty() && control_type_has_request(m.type))
    return make_error(Errc::invalid_argument, std::string(control_type_name(m.type)) + " message without a request_id");
  SL_TRY(check_size("request_id", m.request_id.size(), kControlMaxId));
  SL_TRY(check_size("from_stage", m.from_stage.size(), kControlMaxId));
  SL_TRY(check_size("to_stage", m.to_stage.size(), kControlMaxId));
  SL_TRY(check_size("error", m.error.size(), kControlMaxError));
  SL_TRY(check_size("body", m.body.size(), kControlMaxBody));
  if (!m.traceparent.empty() && !trace::parse(m.traceparent))
    return make_error(Errc::invalid_argument, "control message field 'traceparent' is not a W3C traceparent "
                                              "(00-<32 hex>-<16 hex>-<2 hex>)");
  Value::Map v;
  v.reserve(10);
  v.emplace_back("v", kVersion);
  v.emplace_back("t", control_type_name(m.type));
  if (!m.request_id.empty()) v.emplace_back("rid", m.request_id);
  if (!m.from_stage.empty()) v.emplace_back("from", m.from_stage);
  if (!m.to_stage.empty()) v.emplace_back("to", m.to_stage);
  if (!m.metadata.is_nil()) v.emplace_back("md", m.metadata);
  if (m.chunk_id) v.emplace_back("chunk", *m.chunk_id);
  if (m.is_done) v.emplace_back("done", true);
  if (!m.error.empty()) v.emplace_back("err", m.error);
  if (!m.body.empty()) v.emplace_back("body", Value::copy_bytes(m.body));
  if (!m.traceparent.empty()) v.emplace_back("tp", m.traceparent);
  auto bytes = value_to_msgpack(Value(std::move(v)));
  // An inbox drops (disconnects) anything larger: refuse it here, where the sender learns why.
  if (bytes.size() > kControlMaxWire)
    return make_error(Errc::invalid_argument, "control message of " + std::to_string(bytes.size()) +
                                                  " bytes (its metadata is too large); at most " +
                                                  std::to_string(kControlMaxWire));
  return bytes;
}

Result<ControlMessage> decode_control(std::span<const std::byte> bytes) {
  auto parsed = value_from_msgpack(bytes);  // bounds-checked, depth-limited
  if (!parsed.ok()) return bad(parsed.error().message);
  const Value& v = parsed.value();
  if (!v.is<Value::Map>()) return bad("not a map");
  ControlMessage m;
  bool have_version = false, have_type = false;
  auto str = [&](const Value& x, const char* field, size_t max, std::string& out) -> Status {
    if (!x.is<std::string>()) return bad(std::string("'") + field + "' is not a string");
    if (x.as<std::string>().size() > max)
      return bad(std::string("'") + field + "' has " + std::to_string(x.as<std::string>().size()) +
                 " bytes; at most " + std::to_string(max));
    // Ids and errors become Python strs on the other side.
    if (!is_utf8(x.as<std::string>())) return bad(std::string("'") + field + "' is not valid UTF-8");
    out = x.as<std::string>();
    return {};
  };
  for (const auto& [k, x] : v.as<Value::Map>()) {
    if (k == "v") {
      uint64_t ver = 0;
      if (!x.get_u64(ver) || ver != kVersion) return bad("unsupported version (expected 1)");
      have_version = true;
    } else if (k == "t") {
      if (!x.is<std::string>()) return bad("'t' is not a string");
      auto t = control_type_from_name(x.as<std::string>());
      if (!t.ok()) return bad(t.error().message);
      m.type = t.value();
      have_type = true;
    } else if (k == "rid") {
      SL_TRY(str(x, "rid", kControlMaxId, m.request_id));
    } else if (k == "from") {
      SL_TRY(str(x, "from", kControlMaxId, m.from_stage));
    } else if (k == "to") {
      SL_TRY(str(x, "to", kControlMaxId, m.to_stage));
    } else if (k == "md") {
      m.metadata = x;
    } else if (k == "chunk") {
      uint64_t c = 0;
      if (!x.get_u64(c)) return bad("'chunk' is not a non-negative integer");
      m.chunk_id = c;
    } else if (k == "done") {
      if (!x.is<bool>()) return bad("'done' is not a boolean");
      m.is_done = x.as<bool>();
    } else if (k == "err") {
      SL_TRY(str(x, "err", kControlMaxError, m.error));
    } else if (k == "body") {
      if (!x.is<Value::Bytes>()) return bad("'body' is not bytes");
      if (x.as<Value::Bytes>().size() > kControlMaxBody) return bad("'body' is larger than 64 MiB");
      m.body = x.as<Value::Bytes>();
    } else if (k == "tp") {
      // A malformed trace context is ignored, never the message (W3C Trace Context, 3.2.2).
      if (x.is<std::string>() && trace::parse(x.as<std::string>())) m.traceparent = x.as<std::string>();
    }  // unknown keys: a newer sender's additions, ignored
  }
  if (!have_version) return bad("no version");
  if (!have_type) return bad("no type");
  if (m.request_id.empty() && control_type_has_request(m.type))
    return bad(std::string(control_type_name(m.type)) + " message without a request_id");
  return m;
}

}  // namespace stagelink
