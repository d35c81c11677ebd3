// See redis.hpp.
#include "store/redis.hpp"

#include "store/redis_impl.hpp"

namespace stagelink::store {

void ReplyDeleter::operator()(redisReply* r) const {
  if (r) freeReplyObject(r);
}
bool is_nil(const Reply& r) { return !r || r->type == REDIS_REPLY_NIL; }
bool is_error(const Reply& r) { return r && r->type == REDIS_REPLY_ERROR; }
std::string_view str(const redisReply* r) {
  if (!r || (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS && r->type != REDIS_REPLY_ERROR)) return {};
  return {r->str, size_t(r->len)};
}
std::string_view str(const Reply& r) { return str(r.get()); }
long long integer(const redisReply* r) { return r && r->type == REDIS_REPLY_INTEGER ? r->integer : 0; }
long long integer(const Reply& r) { return integer(r.get()); }
size_t elements(const Reply& r) { return r && r->type == REDIS_REPLY_ARRAY ? r->elements : 0; }
const redisReply* element(const Reply& r, size_t i) { return i < elements(r) ? r->element[i] : nullptr; }

// CRC16-CCITT (XMODEM: polynomial 0x1021, initial 0), the cluster specification's key hash.
unsigned key_slot(std::string_view key) {
  static const auto table = [] {
    std::array<uint16_t, 256> t{};
    for (unsigned i = 0; i < 256; ++i) {
      uint16_t c = uint16_t(i << 8);
      for (int b = 0; b < 8; ++b) c = (c & 0x8000) ? uint16_t((c << 1) ^ 0x1021) : uint16_t(c << 1);
      t[i] = c;
    }
    return t;
  }();
  // The hash tag: what lies between the first '{' and the next '}', when not empty.
  if (size_t open = key.find('{'); open != std::string_view::npos) {
    size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  uint16_t crc = 0;
  for (unsigned char ch : key) crc = uint16_t((crc << 8) ^ table[((crc >> 8) ^ ch) & 0xff]);
  return crc & 16383;
}

Redis::Redis(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Redis::~Redis() = default;
const RedisOptions& Redis::options() const { return impl_->o; }
uint64_t Redis::round_trips() const { return impl_->round_trips.load(std::memory_order_relaxed); }

Result<std::unique_ptr<Redis>> Redis::connect(const RedisOptions& o) {
  if (o.nodes.empty()) return make_error(Errc::invalid_argument, "redis: no server address");
  auto impl = std::make_unique<Impl>();
  impl->o = o;
  if (o.tls.on) SL_TRY(impl->make_tls());
  std::string errs;
  const Deadline dl = deadline_after(o.timeout_s);
  for (auto& [h, p] : o.nodes) {
    Node* n = impl->node(h, p);
    auto c = impl->acquire(*n, dl, false);
    if (!c.ok()) {
      if (c.error().code == Errc::invalid_argument) return std::move(c).error();  // wrong password: say so
      errs += (errs.empty() ? "" : "; ") + c.error().message;
      continue;
    }
    impl->give_back(*n, std::move(c).value(), true, false);
    if (!impl->main) impl->main = n;
    if (!o.cluster) break;
  }
  if (!impl->main) return make_error(Errc::io, "cannot reach redis: " + errs);
  if (o.cluster) SL_TRY(impl->refresh_slots(dl));
  return std::unique_ptr<Redis>(new Redis(std::move(impl)));
}

Result<std::vector<Reply>> Redis::run(std::string_view slot_key, std::span<const Cmd> cmds, Deadline deadline) {
  Node* n = impl_->owner(slot_key);
  bool asking = false;
  for (int attempt = 0;; ++attempt) {
    SL_ASSIGN(auto rs, impl_->on_node(*n, cmds, deadline, asking));
    bool ask = false;
    std::string host;
    int port = 0;
    if (impl_->o.cluster && Impl::settling(rs) && Clock::now() + std::chrono::milliseconds(50) < deadline) {
      // A cluster electing or resharding (CLUSTERDOWN, TRYAGAIN): ask again shortly, until the deadline.
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(200, 10 << std::min(attempt, 4))));
      SL_TRY(impl_->refresh_slots(deadline));
      n = impl_->owner(slot_key);
      asking = false;
      continue;
    }
    if (!impl_->o.cluster || attempt >= 50 || !Impl::redirect(rs, ask, host, port)) return rs;
    if (!ask) SL_TRY(impl_->refresh_slots(deadline));
    n = ask ? impl_->node(host, port) : impl_->owner(slot_key);
    if (!ask && n == impl_->main && impl_->node(host, port) != n) n = impl_->node(host, port);
    asking = ask;
  }
}

void Redis::close_idle() {
  std::lock_guard<std::mutex> l(impl_->nodes_mu);
  impl_->closing = true;
  for (auto& [k, n] : impl_->nodes) {
    std::lock_guard<std::mutex> nl(n->mu);
    n->open -= unsigned(n->idle.size());
    n->idle.clear();
    n->idle_blocking.clear();
  }
}

Result<std::vector<Reply>> Redis::blocking(std::string_view slot_key, std::span<const Cmd> cmds, Deadline deadline,
                                           std::atomic<int>* fd_slot) {
  if (cmds.empty()) return make_error(Errc::invalid_argument, "redis: blocking() of no command");
  Node* n = impl_->owner(slot_key);
  // The socket waits a little longer than the command, so that the server's own timeout answers.
  const Deadline sock = later(deadline, std::chrono::milliseconds(int(impl_->o.timeout_s * 1000)));
  SL_ASSIGN(auto c, impl_->acquire(*n, sock, true));
  bool ok = false;
  if (fd_slot) {
    int idle = -1;
    if (!fd_slot->compare_exchange_strong(idle, (*c).c->fd)) {  // woken before it began
      impl_->give_back(*n, std::move(c), true, true);
      return make_error(Errc::cancelled, "the wait was ended before it began");
    }
  }
  auto r = impl_->pipeline(*n, *c, cmds, sock, ok);
  // A waker that took the socket (-2) is let finish its shutdown() (-3) before the connection
  // can close: it never touches a socket number reused meanwhile.
  if (fd_slot && fd_slot->exchange(-1) == -2)
    while (fd_slot->load() != -3) std::this_thread::yield();
  impl_->give_back(*n, std::move(c), ok, true);
  if (!r.ok()) return std::move(r).error();
  bool ask = false;
  std::string host;
  int port = 0;
  // The slot moved before the wait began: all of it goes there. (A follow-up redirected after the
  // wait is left to the caller: its replies say so, and the wait is not run twice.)
  if (impl_->o.cluster && Impl::redirect(std::span<const Reply>(r->data(), 1), ask, host, port)) {
    SL_TRY(impl_->refresh_slots(deadline));
    Node* m = impl_->node(host, port);
    SL_ASSIGN(auto c2, impl_->acquire(*m, sock, true));
    auto r2 = impl_->pipeline(*m, *c2, cmds, sock, ok, ask);
    impl_->give_back(*m, std::move(c2), ok, true);
    return r2;
  }
  return r;
}

std::string Redis::config_get(const std::string& name) {
  Cmd c;
  c.arg("CONFIG").arg("GET").arg(name);
  auto r = run("", std::span<const Cmd>(&c, 1), deadline_after(impl_->o.timeout_s));
  if (!r.ok() || elements((*r)[0]) < 2) return {};
  return std::string(str(element((*r)[0], 1)));
}

std::string Redis::describe() const {
  if (!impl_->o.cluster) return "redis://" + impl_->main->addr();
  std::string s = "redis cluster (seeds";
  for (auto& [h, p] : impl_->o.nodes) s += " " + h + ":" + std::to_string(p);
  return s + ")";
}

Value Redis::info() {
  Value::Map m;
  m.emplace_back("server", describe());
  Cmd c;
  c.arg("INFO");
  auto r = impl_->on_node(*impl_->main, std::span<const Cmd>(&c, 1), deadline_after(impl_->o.timeout_s));
  if (!r.ok()) {
    m.emplace_back("reachable", false);
    m.emplace_back("error", r.error().message);
    return Value(std::move(m));
  }
  m.emplace_back("reachable", true);
  const std::string text(str((*r)[0]));
  for (const char* k : {"redis_version", "role", "used_memory", "used_memory_human", "maxmemory", "connected_clients",
                        "cluster_enabled"}) {
    const std::string pat = std::string("\n") + k + ":";
    size_t at = ("\n" + text).find(pat);
    if (at == std::string::npos) continue;
    at += pat.size() - 1;
    const size_t end = text.find_first_of("\r\n", at);
    m.emplace_back(k, text.substr(at, end - at));
  }
  if (impl_->o.cluster) {
    std::lock_guard<std::mutex> l(impl_->nodes_mu);
    Value::List nodes;
    for (auto& [k, n] : impl_->nodes) nodes.emplace_back(k);
    m.emplace_back("nodes", Value(std::move(nodes)));
  }
  return Value(std::move(m));
}

}  // namespace stagelink::store
