#include "core/curve_config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace stagelink {

namespace {
Result<std::string> read_key_file(const std::string& path, const std::string& who) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error(Errc::invalid_argument, who + " curve.secret_key_file " + path + ": " + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    ::close(fd);
    return make_error(Errc::permission_denied, who + " curve.secret_key_file " + path +
                                                   " must be this user's and unreadable by others (chmod 600)");
  }
  char buf[128];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  std::string s(buf, n > 0 ? size_t(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}
}  // namespace

Result<std::optional<CurveConfig>> curve_from_extra(const Value& extra, const std::string& who) {
  const Value* c = extra.find("curve");
  if (!c || c->is_nil()) return std::optional<CurveConfig>();
  if (!c->is<Value::Map>())
    return make_error(Errc::invalid_argument, who + " extra.curve is a map: {secret_key or secret_key_file, "
                                                    "server_key, allowed_clients}");
  auto str = [&](const char* k, std::string& out) -> Status {
    const Value* v = c->find(k);
    if (!v || v->is_nil()) return {};
    if (!v->is<std::string>()) return make_error(Errc::invalid_argument, who + " extra.curve." + k + " is a string");
    out = v->as<std::string>();
    return {};
  };
  CurveConfig cc;
  std::string secret, file, pub, server;
  SL_TRY(str("secret_key", secret));
  SL_TRY(str("secret_key_file", file));
  SL_TRY(str("public_key", pub));
  SL_TRY(str("server_key", server));
  if (secret.empty() == file.empty())
    return make_error(Errc::invalid_argument, who + " extra.curve needs one of secret_key and secret_key_file");
  if (!file.empty()) {
    SL_ASSIGN(secret, read_key_file(file, who));
  }
  if (pub.empty()) {
    SL_ASSIGN(pub, curve_public_of(secret));
  }
  cc.server.keys = cc.client.keys = CurveKeyPair{pub, secret};
  cc.client.server_key = server.empty() ? pub : server;
  if (const Value* a = c->find("allowed_clients"); a && !a->is_nil()) {
    if (!a->is<Value::List>()) return make_error(Errc::invalid_argument, who + " extra.curve.allowed_clients is a list");
    for (const auto& k : a->as<Value::List>()) {
      if (!k.is<std::string>())
        return make_error(Errc::invalid_argument, who + " extra.curve.allowed_clients holds public keys (strings)");
      cc.server.allowed_clients.push_back(k.as<std::string>());
    }
  } else {
    cc.server.allowed_clients.push_back(pub);
  }
  SL_TRY(check_curve(cc.server));
  SL_TRY(check_curve(cc.client));
  return std::optional<CurveConfig>(std::move(cc));
}

}  // namespace stagelink
