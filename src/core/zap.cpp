#include "core/zap.hpp"

#include "core/counts.hpp"

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/log.hpp"

namespace stagelink {

namespace {
using Key = std::array<uint8_t, 32>;

bool decode_key(const std::string& z85, Key& out) {
  return z85.size() == 40 && zmq_z85_decode(out.data(), z85.c_str()) != nullptr;
}
Status check_key(const std::string& k, const char* what) {
  Key b;
  if (decode_key(k, b)) return {};
  return make_error(Errc::invalid_argument, std::string("CURVE ") + what + " must be 40 Z85 characters (a key of " +
                                                "stagelink.curve_keypair()), got " + std::to_string(k.size()) +
                                                " characters");
}
Status need_curve() {
  if (zmq_has("curve")) return {};
  return make_error(Errc::unsupported, "this libzmq was built without CURVE (libsodium): no authenticated sockets");
}
}  // namespace

Result<CurveKeyPair> curve_keypair() {
  SL_TRY(need_curve());
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) return make_error(Errc::io, "zmq_curve_keypair failed");
  return CurveKeyPair{pub, sec};
}

Result<std::string> curve_public_of(const std::string& secret_key) {
  SL_TRY(need_curve());
  SL_TRY(check_key(secret_key, "secret key"));
  char pub[41];
  if (zmq_curve_public(pub, secret_key.c_str()) != 0) return make_error(Errc::io, "zmq_curve_public failed");
  return std::string(pub);
}

Status check_curve(const CurveServer& s) {
  SL_TRY(check_key(s.keys.secret_key, "secret key"));
  if (s.allowed_clients.empty())
    return make_error(Errc::invalid_argument, "CURVE allowed_clients is empty: no client could connect");
  for (const auto& k : s.allowed_clients) SL_TRY(check_key(k, "allowed client key"));
  return {};
}

Status check_curve(const CurveClient& c) {
  SL_TRY(check_key(c.keys.secret_key, "secret key"));
  SL_TRY(check_key(c.keys.public_key, "public key"));
  return check_key(c.server_key, "server key");
}

namespace zap {
namespace {

struct Domain {
  std::set<Key> allowed;
  std::atomic<uint64_t> refused{0};
};

// The handler of one context: a REP socket on inproc://zeromq.zap.01 and its thread.
struct Handler {
  std::map<std::string, std::shared_ptr<Domain>> domains;  // under g_mu
  std::atomic<bool> stop{false};
  std::thread thread;
};

std::mutex g_mu;
std::map<void*, std::shared_ptr<Handler>> g_handlers;  // by the context's handle
std::atomic<uint64_t> g_next_domain{0};

std::string text(const zmq::message_t& m) { return std::string(static_cast<const char*>(m.data()), m.size()); }

void answer(zmq::socket_t& rep, const std::vector<zmq::message_t>& req) {
  // Request (RFC 27): version, request id, domain, address, routing id, mechanism, credentials.
  bool ok = false;
  std::shared_ptr<Domain> d;
  if (req.size() >= 6) {
    std::lock_guard<std::mutex> l(g_mu);
    for (auto& [ctx, h] : g_handlers) {
      auto it = h->domains.find(text(req[2]));
      if (it != h->domains.end()) d = it->second;
    }
  }
  if (d && req.size() >= 7 && text(req[5]) == "CURVE" && req[6].size() == 32) {
    Key k;
    std::memcpy(k.data(), req[6].data(), 32);
    ok = d->allowed.count(k) > 0;
  }
  if (!ok && d) counts::curve_refused();
  if (!ok && d && d->refused.fetch_add(1) == 0)
    SL_LOG_WARN("refused a ZeroMQ peer at %s: its CURVE key is not among the allowed clients (counted; logged once)",
                req.size() > 3 ? text(req[3]).c_str() : "?");
  const std::string id = req.size() > 1 ? text(req[1]) : std::string();
  const char* frames[] = {"1.0", nullptr, ok ? "200" : "400", ok ? "OK" : "unknown client key", "", ""};
  for (int i = 0; i < 6; ++i) {
    const std::string f = i == 1 ? id : std::string(frames[i]);
    rep.send(zmq::buffer(f), i < 5 ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

void run(zmq::context_t* ctx, Handler* h, std::promise<Status>* bound) {
  zmq::socket_t rep(*ctx, zmq::socket_type::rep);
  rep.set(zmq::sockopt::linger, 0);
  // A handler being stopped for this context may still hold the address for a moment.
  for (int attempt = 0;; ++attempt) {
    try {
      rep.bind("inproc://zeromq.zap.01");
      break;
    } catch (const zmq::error_t& e) {
      if (e.num() != EADDRINUSE || attempt == 200) {
        bound->set_value(make_error(Errc::io, std::string("ZAP handler: ") + e.what()));
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  bound->set_value({});
  while (!h->stop.load(std::memory_order_acquire)) {
    zmq::pollitem_t it{rep.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 100) <= 0) continue;
    std::vector<zmq::message_t> req;
    try {
      do {
        req.emplace_back();
        if (!rep.recv(req.back(), zmq::recv_flags::dontwait)) break;
      } while (req.back().more());
      answer(rep, req);
    } catch (const zmq::error_t&) {
      // the context is terminating: its owner closes its sockets first; nothing to answer
    }
  }
}

class Registration final : public Admission {
 public:
  Registration(void* ctx, std::string name, std::shared_ptr<Domain> d) : ctx_(ctx), name_(std::move(name)), d_(std::move(d)) {}
  ~Registration() override {
    std::shared_ptr<Handler> done;
    {
      std::lock_guard<std::mutex> l(g_mu);
      auto it = g_handlers.find(ctx_);
      if (it == g_handlers.end()) return;
      it->second->domains.erase(name_);
      if (it->second->domains.empty()) {  // the last server socket of this context: stop
        done = it->second;
        g_handlers.erase(it);
      }
    }
    if (done) {
      done->stop.store(true, std::memory_order_release);
      if (done->thread.joinable()) done->thread.join();
    }
  }
  uint64_t refused() const override { return d_->refused.load(); }

 private:
  void* ctx_;
  std::string name_;
  std::shared_ptr<Domain> d_;
};

}  // namespace

Result<std::shared_ptr<Admission>> serve(zmq::context_t& ctx, zmq::socket_t& sock, const CurveServer& s) {
  SL_TRY(need_curve());
  SL_TRY(check_curve(s));
  auto d = std::make_shared<Domain>();
  for (const auto& k : s.allowed_clients) {
    Key b;
    decode_key(k, b);
    d->allowed.insert(b);
  }
  const std::string name = "stagelink." + std::to_string(g_next_domain.fetch_add(1));
  void* key = ctx.handle();
  std::promise<Status> bound;
  auto started = bound.get_future();
  bool starting = false;
  {
    std::lock_guard<std::mutex> l(g_mu);
    auto& h = g_handlers[key];
    if (!h) {
      h = std::make_shared<Handler>();
      h->thread = std::thread(run, &ctx, h.get(), &bound);
      starting = true;
    }
    h->domains[name] = d;
  }
  auto reg = std::make_shared<Registration>(key, name, d);  // unregisters (and stops) on any failure below
  if (starting) SL_TRY(started.get());
  try {
    sock.set(zmq::sockopt::zap_domain, name);
    sock.set(zmq::sockopt::curve_server, 1);
    sock.set(zmq::sockopt::curve_secretkey, s.keys.secret_key);
  } catch (const zmq::error_t& e) {
    return make_error(Errc::io, std::string("setting CURVE on a server socket: ") + e.what());
  }
  // A draft option (93): where this libzmq has it, a missing ZAP handler refuses instead of
  // admitting. Where it has not (EINVAL), the same holds by construction: the handler is running
  // before the socket is configured and stops only after the last socket using it has closed.
  const int enforce = 1;
  if (zmq_setsockopt(sock.handle(), 93 /* ZMQ_ZAP_ENFORCE_DOMAIN */, &enforce, sizeof enforce) != 0 && errno != EINVAL)
    return make_error(Errc::io, std::string("setting ZMQ_ZAP_ENFORCE_DOMAIN: ") + zmq_strerror(errno));
  return std::shared_ptr<Admission>(std::move(reg));
}

Status connect_as(zmq::socket_t& sock, const CurveClient& c) {
  SL_TRY(need_curve());
  SL_TRY(check_curve(c));
  try {
    sock.set(zmq::sockopt::curve_serverkey, c.server_key);
    sock.set(zmq::sockopt::curve_publickey, c.keys.public_key);
    sock.set(zmq::sockopt::curve_secretkey, c.keys.secret_key);
  } catch (const zmq::error_t& e) {
    return make_error(Errc::io, std::string("setting CURVE on a client socket: ") + e.what());
  }
  return {};
}

}  // namespace zap
}  // namespace stagelink
