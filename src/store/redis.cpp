// See redis.hpp.
#include "store/redis.hpp"

#include "core/proc.hpp"

#include <arpa/inet.h>
extern "C" {  // hiredis 0.14's sds.h declares without C linkage what its library exports as C
#include <hiredis/hiredis.h>
#include <hiredis/sds.h>
}
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/log.hpp"

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

namespace {

timeval tv_until(Deadline deadline, double min_s = 0.001) {
  double s = std::chrono::duration<double>(deadline - Clock::now()).count();
  s = std::max(s, min_s);
  timeval tv;
  tv.tv_sec = time_t(s);
  tv.tv_usec = suseconds_t((s - double(tv.tv_sec)) * 1e6);
  return tv;
}

// A connection: hiredis builds commands and parses replies; the bytes go through here, in the
// clear or through TLS (OpenSSL over the same socket).
struct Conn {
  redisContext* c = nullptr;
  SSL* ssl = nullptr;
  ~Conn() {
    if (ssl) SSL_free(ssl);  // no close_notify: the socket may be broken; the server sees it close
    if (c) redisFree(c);
  }
  int fd() const { return c->fd; }
};

// OpenSSL's reason for the last failure of this thread (its error queue), or `fallback`.
std::string tls_reason(const char* fallback) {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (!e) return fallback;
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  return buf;
}

// How long a read spins on a socket that has nothing yet before it sleeps in the kernel
// (STAGELINK_REDIS_SPIN_US, default 100; 0: never). A reply is usually a round trip away, and
// sleeping for it and being woken cost more than the trip itself: across two namespaces here a
// 1 KiB put + get took 0.19-0.24 ms sleeping, 0.11 ms spinning up to 100 us (1 MiB: 1.1-1.5 ms,
// 0.75 ms). Bounded: a longer wait (a blocked BLPOP) sleeps after it, so an idle client burns
// nothing.
const int64_t kSpinNs = [] {
  const char* e = std::getenv("STAGELINK_REDIS_SPIN_US");
  return int64_t((e ? std::max(0.0, std::atof(e)) : 100.0) * 1000);
}();

// Spins until the socket has bytes to read (or the spin ends): TLS only, whose reads block.
void spin_until_readable(int fd) {
  if (kSpinNs <= 0) return;
  const auto until = Clock::now() + std::chrono::nanoseconds(kSpinNs);
  char one;
  do {
    const ssize_t r = ::recv(fd, &one, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return;
  } while (Clock::now() < until);
}

// recv() on the connection: bytes read, 0 when the server closed it, -1 with `err` (EAGAIN: the
// socket's timeout ran out). In the clear, the read itself spins (MSG_DONTWAIT) before it blocks:
// no extra call when the bytes are already there.
ssize_t conn_read(Conn& c, void* buf, size_t n, int& err) {
  if (!c.ssl) {
    bool spin = kSpinNs > 0;
    Clock::time_point until{};
    for (;;) {
      const ssize_t r = ::recv(c.fd(), buf, n, spin ? MSG_DONTWAIT : 0);
      if (r >= 0) return r;
      if (errno == EINTR) continue;
      if (spin && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto now = Clock::now();
        if (until == Clock::time_point{}) until = now + std::chrono::nanoseconds(kSpinNs);
        if (now >= until) spin = false;  // then block, up to the socket's timeout
        continue;
      }
      err = errno;
      return -1;
    }
  }
  if (SSL_pending(c.ssl) == 0) spin_until_readable(c.fd());
  for (;;) {
    ERR_clear_error();
    errno = 0;
    const int r = SSL_read(c.ssl, buf, int(std::min<size_t>(n, 1u << 30)));
    if (r > 0) return r;
    const int e = SSL_get_error(c.ssl, r);
    if (e == SSL_ERROR_ZERO_RETURN) return 0;
    if ((e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) && errno == EINTR) continue;
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) err = EAGAIN;
    else if (e == SSL_ERROR_SYSCALL) err = errno ? errno : ECONNRESET;
    else err = EPROTO;
    ERR_clear_error();
    return -1;
  }
}

Error sock_error(const std::string& addr, const char* what, int err) {
  const bool slow = err == EAGAIN || err == EWOULDBLOCK;
  return make_error(slow ? Errc::timeout : Errc::io,
                    "redis at " + addr + ": " + what + ": " + (slow ? std::string("no progress before the deadline")
                                                                    : std::string(std::strerror(err))));
}

// A command's arguments as hiredis takes them (into vectors the caller reuses).
void argv_of(const Cmd& cmd, std::vector<const char*>& av, std::vector<size_t>& al) {
  av.clear();
  al.clear();
  for (auto a : cmd.args) {
    av.push_back(a.data());
    al.push_back(a.size());
  }
}

// The command hiredis formatted into the context's output buffer, written out.
Status flush_out(Conn& c, const std::string& addr);

// The next reply of a pipeline: parsed by hiredis's reader from bytes read here.
Status next_reply(Conn& c, const std::string& addr, void** out) {
  *out = nullptr;
  for (;;) {
    if (redisReaderGetReply(c.c->reader, out) != REDIS_OK)
      return make_error(Errc::corrupt, "redis at " + addr + ": unreadable reply: " + c.c->reader->errstr);
    if (*out) return {};
    char buf[16 << 10];
    int err = 0;
    const ssize_t n = conn_read(c, buf, sizeof buf, err);
    if (n == 0) return make_error(Errc::io, "redis at " + addr + ": connection closed");
    if (n < 0) {
      Error e = sock_error(addr, "receiving", err);
      if (e.code == Errc::timeout) e.message = "redis at " + addr + ": receiving: no reply before the deadline";
      return e;
    }
    if (redisReaderFeed(c.c->reader, buf, size_t(n)) != REDIS_OK)
      return make_error(Errc::corrupt, "redis at " + addr + ": unreadable reply: " + c.c->reader->errstr);
  }
}

struct Node {
  std::string host;
  int port = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Conn>> idle, idle_blocking;
  unsigned open = 0;  // pooled connections open or lent
  ForkStamp fork;  // of the process whose connections these are
  std::string addr() const { return host + ":" + std::to_string(port); }
};

}  // namespace

struct Redis::Impl {
  RedisOptions o;
  SSL_CTX* tls_ctx = nullptr;  // set when o.tls.on
  ~Impl() {
    if (tls_ctx) SSL_CTX_free(tls_ctx);
  }

  // The TLS context of every connection: verification, client certificate.
  Status make_tls() {
    const auto& t = o.tls;
    tls_ctx = SSL_CTX_new(TLS_client_method());
    if (!tls_ctx) return make_error(Errc::exhausted, "redis TLS: " + tls_reason("no context"));
    SSL_CTX_set_min_proto_version(tls_ctx, TLS1_2_VERSION);
    SSL_CTX_set_mode(tls_ctx, SSL_MODE_AUTO_RETRY);
    auto bad = [&](const std::string& what) {
      return make_error(Errc::invalid_argument, "redis TLS: " + what + ": " + tls_reason("failed"));
    };
    if (t.verify) {
      SSL_CTX_set_verify(tls_ctx, SSL_VERIFY_PEER, nullptr);
      if (!t.ca_file.empty() ? SSL_CTX_load_verify_locations(tls_ctx, t.ca_file.c_str(), nullptr) != 1
                             : SSL_CTX_set_default_verify_paths(tls_ctx) != 1)
        return bad(t.ca_file.empty() ? "the system's trust store" : "ca_file '" + t.ca_file + "'");
    }
    if (!t.cert_file.empty() && SSL_CTX_use_certificate_chain_file(tls_ctx, t.cert_file.c_str()) != 1)
      return bad("cert_file '" + t.cert_file + "'");
    if (!t.key_file.empty() && (SSL_CTX_use_PrivateKey_file(tls_ctx, t.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
                                SSL_CTX_check_private_key(tls_ctx) != 1))
      return bad("key_file '" + t.key_file + "'");
    return {};
  }

  // TLS over a connected socket: the server's certificate checked against its name.
  Status handshake(Conn& c, const Node& n) {
    c.ssl = SSL_new(tls_ctx);
    if (!c.ssl) return make_error(Errc::exhausted, "redis at " + n.addr() + ": TLS: " + tls_reason("no session"));
    SSL_set_fd(c.ssl, c.fd());
    const std::string& name = o.tls.server_name.empty() ? n.host : o.tls.server_name;
    in6_addr a6;
    in_addr a4;
    const bool ip = inet_pton(AF_INET, name.c_str(), &a4) == 1 || inet_pton(AF_INET6, name.c_str(), &a6) == 1;
    if (!ip) SSL_set_tlsext_host_name(c.ssl, name.c_str());
    if (o.tls.verify) {
      X509_VERIFY_PARAM* param = SSL_get0_param(c.ssl);
      if (ip ? X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) != 1 : SSL_set1_host(c.ssl, name.c_str()) != 1)
        return make_error(Errc::invalid_argument, "redis at " + n.addr() + ": TLS: cannot check the name '" + name + "'");
    }
    ERR_clear_error();
    errno = 0;
    if (SSL_connect(c.ssl) == 1) return {};
    const long v = SSL_get_verify_result(c.ssl);
    if (o.tls.verify && v != X509_V_OK)  // a server that is not who it should be: never retried as a network error
      return make_error(Errc::invalid_argument, "redis at " + n.addr() + ": TLS: the server's certificate is refused: " +
                                                    X509_verify_cert_error_string(v));
    const int err = errno;
    const std::string why = tls_reason(err == EAGAIN ? "no answer before the deadline" : err ? std::strerror(err) : "failed");
    return make_error(err == EAGAIN ? Errc::timeout : Errc::io,
                      "redis at " + n.addr() + ": TLS handshake: " + why + " (is the server speaking TLS?)");
  }
  std::mutex nodes_mu;
  std::map<std::string, std::unique_ptr<Node>> nodes;  // by host:port; never removed while open
  std::vector<Node*> slots;                            // cluster: owner of each slot
  Node* main = nullptr;                                // the one server, or any cluster node

  Node* node(const std::string& host, int port) {
    std::lock_guard<std::mutex> l(nodes_mu);
    auto& n = nodes[host + ":" + std::to_string(port)];
    if (!n) {
      n = std::make_unique<Node>();
      n->host = host;
      n->port = port;
    }
    return n.get();
  }

  Result<std::unique_ptr<Conn>> dial(Node& n, Deadline deadline) {
    auto conn = std::make_unique<Conn>();
    const timeval ctv = tv_until(std::min(deadline, deadline_after(o.timeout_s)));
    conn->c = redisConnectWithTimeout(n.host.c_str(), n.port, ctv);
    if (!conn->c) return make_error(Errc::exhausted, "redis at " + n.addr() + ": no memory for a connection");
    if (conn->c->err)
      return make_error(conn->c->err == REDIS_ERR_IO && errno == EINPROGRESS ? Errc::timeout : Errc::io,
                        "redis at " + n.addr() + ": " + conn->c->errstr);
    redisSetTimeout(conn->c, tv_until(deadline_after(o.timeout_s)));
    if (tls_ctx) SL_TRY(handshake(*conn, n));
    auto simple = [&](std::vector<std::string> args, const char* what) -> Status {
      Cmd cmd;
      for (auto& a : args) cmd.arg(std::move(a));
      bool ok = false;
      SL_ASSIGN(auto rs, pipeline(n, *conn, std::span<const Cmd>(&cmd, 1), deadline_after(o.timeout_s), ok));
      if (is_error(rs[0])) {
        const std::string e(str(rs[0]));
        const bool auth = e.rfind("WRONGPASS", 0) == 0 || e.rfind("NOAUTH", 0) == 0 || e.find("password") != std::string::npos;
        return make_error(auth ? Errc::invalid_argument : Errc::io, "redis at " + n.addr() + ": " + what + ": " + e);
      }
      return {};
    };
    if (!o.password.empty()) {
      std::vector<std::string> a{"AUTH"};
      if (!o.username.empty()) a.push_back(o.username);
      a.push_back(o.password);
      SL_TRY(simple(a, "AUTH"));
    } else {
      // A server that wants a password says so here (NOAUTH), when the connector is made, not at
      // its first put.
      SL_TRY(simple({"PING"}, "PING"));
    }
    if (o.db != 0 && !o.cluster) SL_TRY(simple({"SELECT", std::to_string(o.db)}, "SELECT"));
    return conn;
  }

  Result<std::unique_ptr<Conn>> acquire(Node& n, Deadline deadline, bool blocking) {
    {
      std::unique_lock<std::mutex> l(n.mu);
      if (n.fork.inherited()) [[unlikely]] {
        // Inherited through fork(): these sockets are the parent's too, and two processes on one
        // connection read each other's replies. Drop this copy (closing a descriptor here leaves
        // the parent's open; no TLS close_notify is sent) and dial anew.
        n.idle.clear();
        n.idle_blocking.clear();
        n.open = 0;
        n.fork.adopt();
      }
      for (;;) {
        auto& pool = blocking ? n.idle_blocking : n.idle;
        if (!pool.empty()) {
          auto c = std::move(pool.back());
          pool.pop_back();
          return c;
        }
        if (blocking || n.open < std::max(1u, o.connections)) {
          if (!blocking) ++n.open;
          break;
        }
        if (n.cv.wait_until(l, deadline) == std::cv_status::timeout)
          return make_error(Errc::timeout, "redis at " + n.addr() + ": every connection busy until the deadline");
      }
    }
    auto c = dial(n, deadline);
    if (!c.ok() && !blocking) {
      std::lock_guard<std::mutex> l(n.mu);
      --n.open;
      n.cv.notify_one();
    }
    return c;
  }
  std::atomic<bool> closing{false};
  void give_back(Node& n, std::unique_ptr<Conn> c, bool healthy, bool blocking) {
    std::lock_guard<std::mutex> l(n.mu);
    if (healthy && !closing.load()) {
      (blocking ? n.idle_blocking : n.idle).push_back(std::move(c));
    } else if (!blocking) {
      --n.open;  // dropped: the next call dials again
    }
    n.cv.notify_one();
  }

  // One batch on one connection. `io_ok` false: the connection is broken (dropped).
  Result<std::vector<Reply>> pipeline(Node& n, Conn& c, std::span<const Cmd> cmds, Deadline deadline, bool& io_ok,
                                      bool asking = false) {
    io_ok = false;
    redisSetTimeout(c.c, tv_until(deadline));
    std::vector<const char*> av;
    std::vector<size_t> al;
    if (asking) redisAppendCommand(c.c, "ASKING");
    for (const Cmd& cmd : cmds) {
      argv_of(cmd, av, al);
      if (redisAppendCommandArgv(c.c, int(av.size()), av.data(), al.data()) != REDIS_OK)
        return make_error(Errc::exhausted, "redis at " + n.addr() + ": formatting a command: " + c.c->errstr);
      // Large batches go out as they are built (hiredis would hold all of them in memory).
      if (sdslen(c.c->obuf) >= (4u << 20)) SL_TRY(flush_out(c, n.addr()));
    }
    SL_TRY(flush_out(c, n.addr()));
    std::vector<Reply> out;
    out.reserve(cmds.size());
    if (asking) {
      void* r = nullptr;
      SL_TRY(next_reply(c, n.addr(), &r));
      freeReplyObject(r);
    }
    for (size_t i = 0; i < cmds.size(); ++i) {
      void* r = nullptr;
      SL_TRY(next_reply(c, n.addr(), &r));
      out.emplace_back(static_cast<redisReply*>(r));
    }
    io_ok = true;
    return out;
  }

  Result<std::vector<Reply>> on_node(Node& n, std::span<const Cmd> cmds, Deadline deadline, bool asking = false) {
    SL_ASSIGN(auto c, acquire(n, deadline, false));
    bool ok = false;
    auto r = pipeline(n, *c, cmds, deadline, ok, asking);
    give_back(n, std::move(c), ok, false);
    return r;
  }

  Status refresh_slots(Deadline deadline) {
    std::vector<Node*> tried;
    {
      std::lock_guard<std::mutex> l(nodes_mu);
      for (auto& [k, n] : nodes) tried.push_back(n.get());
    }
    std::string last = "no node answered";
    for (Node* n : tried) {
      Cmd cmd;
      cmd.arg("CLUSTER").arg("SLOTS");
      auto r = on_node(*n, std::span<const Cmd>(&cmd, 1), std::min(deadline, deadline_after(o.timeout_s)));
      if (!r.ok()) {
        last = r.error().message;
        continue;
      }
      const Reply& rep = (*r)[0];
      if (is_error(rep) || elements(rep) == 0) {
        last = "redis at " + n->addr() + ": CLUSTER SLOTS: " + std::string(is_error(rep) ? str(rep) : "no slots");
        continue;
      }
      std::vector<Node*> map(16384, nullptr);
      for (size_t i = 0; i < elements(rep); ++i) {
        const redisReply* e = element(rep, i);
        if (!e || e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[2]->type != REDIS_REPLY_ARRAY ||
            e->element[2]->elements < 2)
          continue;
        const long long a = e->element[0]->integer, b = e->element[1]->integer;
        std::string host(str(e->element[2]->element[0]));
        if (host.empty()) host = n->host;
        Node* owner = node(host, int(e->element[2]->element[1]->integer));
        for (long long s = std::max(0LL, a); s <= std::min(16383LL, b); ++s) map[size_t(s)] = owner;
      }
      std::lock_guard<std::mutex> l(nodes_mu);
      slots = std::move(map);
      return {};
    }
    return make_error(Errc::io, "redis cluster: reading the slot map: " + last);
  }

  Node* owner(std::string_view key) {
    if (!o.cluster) return main;
    std::lock_guard<std::mutex> l(nodes_mu);
    Node* n = slots.empty() ? nullptr : slots[key_slot(key)];
    return n ? n : main;
  }

  static bool settling(const std::vector<Reply>& rs) {
    for (const Reply& r : rs)
      if (is_error(r) && (str(r).rfind("CLUSTERDOWN", 0) == 0 || str(r).rfind("TRYAGAIN", 0) == 0)) return true;
    return false;
  }
  // A redirection in the replies: MOVED (refresh, retry) or ASK (retry once on its node).
  static bool redirect(std::span<const Reply> rs, bool& ask, std::string& host, int& port) {
    for (const Reply& r : rs) {
      if (!is_error(r)) continue;
      const std::string_view e = str(r);
      const bool moved = e.rfind("MOVED ", 0) == 0;
      ask = e.rfind("ASK ", 0) == 0;
      if (!moved && !ask) continue;
      const std::string_view target = e.substr(e.rfind(' ') + 1);
      const size_t colon = target.rfind(':');
      if (colon == std::string_view::npos) return false;
      host = std::string(target.substr(0, colon));
      port = std::atoi(std::string(target.substr(colon + 1)).c_str());
      return true;
    }
    return false;
  }
};

namespace {

// Raw I/O on a connection whose hiredis buffers are empty (between complete pipelines), and no
// decrypted bytes wait in its TLS session.
bool quiet(Conn& conn) {
  redisContext* c = conn.c;
  return sdslen(c->obuf) == 0 && (!c->reader->buf || c->reader->pos >= sdslen(c->reader->buf)) &&
         (!conn.ssl || SSL_pending(conn.ssl) == 0);
}


// TLS: small pieces are gathered into records of up to 64 KiB; large ones go as they are
// (OpenSSL cuts them into records without a copy of ours).
Status tls_write_all(Conn& c, const std::vector<iovec>& iov, const std::string& addr) {
  std::string stage;
  auto put = [&](const void* p, size_t n) -> Status {
    ERR_clear_error();
    errno = 0;
    size_t done = 0;
    if (n && !SSL_write_ex(c.ssl, p, n, &done)) {
      const int e = SSL_get_error(c.ssl, 0);
      const int err = e == SSL_ERROR_WANT_WRITE || e == SSL_ERROR_WANT_READ ? EAGAIN : (errno ? errno : EPROTO);
      if (err == EPROTO) return make_error(Errc::io, "redis at " + addr + ": sending over TLS: " + tls_reason("failed"));
      return sock_error(addr, "sending", err);
    }
    return {};
  };
  for (const iovec& v : iov) {
    if (v.iov_len < (16u << 10)) {
      stage.append(static_cast<const char*>(v.iov_base), v.iov_len);
      if (stage.size() >= (64u << 10)) {
        SL_TRY(put(stage.data(), stage.size()));
        stage.clear();
      }
      continue;
    }
    if (!stage.empty()) {
      SL_TRY(put(stage.data(), stage.size()));
      stage.clear();
    }
    SL_TRY(put(v.iov_base, v.iov_len));
  }
  return put(stage.data(), stage.size());
}

Status write_all(Conn& c, std::vector<iovec> iov, const std::string& addr) {
  if (c.ssl) return tls_write_all(c, iov, addr);
  const int fd = c.fd();
  size_t i = 0;
  while (i < iov.size()) {
    const ssize_t n = ::writev(fd, iov.data() + i, int(std::min<size_t>(iov.size() - i, 512)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return sock_error(addr, "sending", errno);
    }
    size_t left = size_t(n);
    while (i < iov.size() && left >= iov[i].iov_len) left -= iov[i++].iov_len;
    if (i < iov.size()) {
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + left;
      iov[i].iov_len -= left;
    }
  }
  return {};
}

Status flush_out(Conn& c, const std::string& addr) {
  const size_t n = sdslen(c.c->obuf);
  if (!n) return {};
  SL_TRY(write_all(c, {iovec{c.c->obuf, n}}, addr));
  sdsclear(c.c->obuf);
  return {};
}

// Reads replies of a pipeline from the socket: bulk strings straight into their destinations.
class RawReader {
 public:
  RawReader(Conn& c, std::string addr) : c_(c), addr_(std::move(addr)) {}
  // One reply: a bulk string of exactly dst.size() bytes into dst. `err` gets an error reply's text.
  Status bulk_into(std::span<std::byte> dst, std::string& err) {
    std::string line;
    SL_TRY(read_line(line));
    if (line.empty()) return make_error(Errc::corrupt, "redis at " + addr_ + ": empty reply line");
    if (line[0] == '-') {
      err = line.substr(1);
      return {};
    }
    if (line[0] != '$') return make_error(Errc::corrupt, "redis at " + addr_ + ": unexpected reply '" + line.substr(0, 40) + "'");
    const long long n = std::atoll(line.c_str() + 1);
    if (n < 0) return make_error(Errc::not_found, "a value is gone");
    if (size_t(n) != dst.size()) {
      // Read it away to keep the connection usable, then say what it was.
      SL_TRY(skip(size_t(n) + 2));
      return make_error(Errc::corrupt, "a value in the store holds " + std::to_string(n) + " bytes, " +
                                           std::to_string(dst.size()) + " expected (truncated or overwritten)");
    }
    SL_TRY(read_exact(dst.data(), dst.size()));
    char crlf[2];
    SL_TRY(read_exact(reinterpret_cast<std::byte*>(crlf), 2));
    return {};
  }
  // One short reply (+OK, :1, -ERR): its line.
  Status line(std::string& out) { return read_line(out); }
  bool drained() const { return pos_ == len_; }
  // What was read past the last reply taken (handed to hiredis's reader for the replies after).
  std::string_view rest() const { return {buf_ + pos_, len_ - pos_}; }

 private:
  Status fill() {
    pos_ = 0;
    int err = 0;
    const ssize_t n = conn_read(c_, buf_, sizeof buf_, err);
    if (n > 0) {
      len_ = size_t(n);
      return {};
    }
    if (n == 0) return make_error(Errc::io, "redis at " + addr_ + ": connection closed");
    return sock_error(addr_, "receiving", err);
  }
  Status read_line(std::string& out) {
    out.clear();
    for (;;) {
      if (pos_ == len_) SL_TRY(fill());
      const char* s = buf_ + pos_;
      const char* nl = static_cast<const char*>(std::memchr(s, '\n', len_ - pos_));
      if (!nl) {
        out.append(s, len_ - pos_);
        pos_ = len_;
        continue;
      }
      out.append(s, size_t(nl - s));
      pos_ = size_t(nl - buf_) + 1;
      if (!out.empty() && out.back() == '\r') out.pop_back();
      return {};
    }
  }
  Status read_exact(std::byte* dst, size_t n) {
    const size_t have = std::min(n, len_ - pos_);
    std::memcpy(dst, buf_ + pos_, have);
    pos_ += have;
    size_t got = have;
    while (got < n) {  // the rest straight from the socket into its place
      int err = 0;
      const ssize_t r = conn_read(c_, dst + got, n - got, err);
      if (r > 0) got += size_t(r);
      else if (r == 0) return make_error(Errc::io, "redis at " + addr_ + ": connection closed");
      else return sock_error(addr_, "receiving", err);
    }
    return {};
  }
  Status skip(size_t n) {
    std::vector<std::byte> sink(std::min<size_t>(n, 1u << 20));
    while (n) {
      const size_t k = std::min(n, sink.size());
      SL_TRY(read_exact(sink.data(), k));
      n -= k;
    }
    return {};
  }
  Conn& c_;
  std::string addr_;
  char buf_[64 << 10];
  size_t pos_ = 0, len_ = 0;
};

bool redirect_text(const std::string& e) {
  return e.rfind("MOVED ", 0) == 0 || e.rfind("ASK ", 0) == 0 || e.rfind("CLUSTERDOWN", 0) == 0 ||
         e.rfind("TRYAGAIN", 0) == 0;
}

}  // namespace

Redis::Redis(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Redis::~Redis() = default;
const RedisOptions& Redis::options() const { return impl_->o; }

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


// Runs `part(w, conn)` for each of `ways` parts on its own connection of the node, at once.
// `redirected`: a part met a cluster redirection (the caller falls back to run()).
template <class Part>
static Status spread_raw(Redis::Impl& I, Node& n, unsigned ways, Deadline deadline, bool& redirected, Part&& part) {
  std::vector<Status> st(ways);
  std::vector<char> redir(ways, 0);
  auto one = [&](unsigned w) {
    auto c = I.acquire(n, deadline, false);
    if (!c.ok()) {
      st[w] = std::move(c).error();
      return;
    }
    redisSetTimeout((*c)->c, tv_until(deadline));
    bool healthy = false, r = false;
    st[w] = quiet(**c) ? part(w, **c, healthy, r) : make_error(Errc::io, "connection not idle");
    redir[w] = r;
    I.give_back(n, std::move(c).value(), healthy, false);
  };
  std::vector<std::thread> ts;
  for (unsigned w = 1; w < ways; ++w) ts.emplace_back(one, w);
  one(0);
  for (auto& t : ts) t.join();
  redirected = false;
  for (unsigned w = 0; w < ways; ++w) redirected = redirected || redir[w];
  for (auto& s : st)
    if (!s.ok()) return s;
  return {};
}

Status Redis::set_values(std::string_view slot_key, std::span<const SetItem> items, const std::string& px,
                         unsigned ways, Deadline deadline, std::span<const Cmd> then, std::vector<Reply>* then_replies,
                         const std::function<void(size_t)>& sending, bool* sent_each) {
  if (sent_each) *sent_each = false;
  if (items.empty()) return {};
  ways = std::min<unsigned>({std::max(1u, ways), std::max(1u, impl_->o.connections), unsigned(items.size())});
  const bool follow = ways == 1 && !then.empty() && then_replies;  // `then` rides on the same write
  Node* n = impl_->owner(slot_key);
  const size_t per = (items.size() + ways - 1) / ways;
  bool redirected = false;
  Status st = spread_raw(*impl_, *n, ways, deadline, redirected, [&](unsigned w, Conn& conn, bool& healthy, bool& redir) -> Status {
    redisContext* c = conn.c;
    const size_t a = std::min(items.size(), w * per), b = std::min(items.size(), a + per);
    std::vector<std::string> heads(b - a);
    const std::string tail = "\r\n$2\r\nPX\r\n$" + std::to_string(px.size()) + "\r\n" + px + "\r\n";
    const bool each = ways == 1 && sending;  // one by one, the hook ahead of each
    std::vector<iovec> iov;
    for (size_t i = a; i < b; ++i) {
      const SetItem& it = items[i];
      size_t vlen = 0;
      for (auto part : it.value) vlen += part.size();
      heads[i - a] = "*5\r\n$3\r\nSET\r\n$" + std::to_string(it.key.size()) + "\r\n" + it.key + "\r\n$" +
                     std::to_string(vlen) + "\r\n";
      iov.push_back({heads[i - a].data(), heads[i - a].size()});
      for (auto part : it.value)
        if (!part.empty()) iov.push_back({const_cast<std::byte*>(part.data()), part.size()});
      iov.push_back({const_cast<char*>(tail.data()), tail.size()});
      if (each) {
        sending(i);
        SL_TRY(write_all(conn, std::move(iov), n->addr()));
        iov.clear();
      }
    }
    if (each && sent_each) *sent_each = true;
    std::vector<std::unique_ptr<char, void (*)(char*)>> formatted;
    if (follow) {  // formatted now: after the hooks
      std::vector<const char*> av;
      std::vector<size_t> al;
      for (const Cmd& cmd : then) {
        argv_of(cmd, av, al);
        char* out = nullptr;
        const int len = redisFormatCommandArgv(&out, int(av.size()), av.data(), al.data());
        if (len < 0) return make_error(Errc::exhausted, "formatting a command");
        formatted.emplace_back(out, [](char* q) { redisFreeCommand(q); });
        iov.push_back({out, size_t(len)});
      }
    }
    SL_TRY(write_all(conn, std::move(iov), n->addr()));
    RawReader rd(conn, n->addr());
    std::string line, err;
    for (size_t i = a; i < b; ++i) {
      SL_TRY(rd.line(line));
      if (!line.empty() && line[0] == '-' && err.empty()) err = line.substr(1);
    }
    healthy = rd.drained();
    if (follow) {  // the rest through hiredis's reader, fed what was read already
      const std::string_view rest = rd.rest();
      if (!rest.empty() && redisReaderFeed(c->reader, rest.data(), rest.size()) != REDIS_OK)
        return make_error(Errc::io, "redis at " + n->addr() + ": reading replies");
      then_replies->clear();
      for (size_t i = 0; i < then.size(); ++i) {
        void* r = nullptr;
        SL_TRY(next_reply(conn, n->addr(), &r));
        then_replies->emplace_back(static_cast<redisReply*>(r));
      }
      healthy = quiet(conn);
    }
    if (!err.empty()) {
      redir = impl_->o.cluster && redirect_text(err);
      if (redir) return {};
      return make_error(err.rfind("OOM", 0) == 0 ? Errc::exhausted : Errc::io, "redis at " + n->addr() + ": SET: " + err);
    }
    return {};
  });
  if (!st.ok() || redirected) {
    if (then_replies) then_replies->clear();
  }
  if (!redirected || !st.ok()) return st;
  std::vector<Cmd> cmds(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    std::string v;
    for (auto part : items[i].value) v.append(reinterpret_cast<const char*>(part.data()), part.size());
    cmds[i].arg(items[i].key).arg(std::move(v)).arg("PX").arg(px);
  }
  for (auto& c : cmds) c.args.insert(c.args.begin(), std::span<const char>("SET", 3));
  SL_ASSIGN(auto rs, run(slot_key, cmds, deadline));
  for (auto& r : rs)
    if (is_error(r)) return make_error(Errc::io, "redis: SET: " + std::string(str(r)));
  return {};
}

Status Redis::get_values(std::string_view slot_key, std::span<const GetItem> items, bool del, unsigned ways,
                         Deadline deadline, const std::function<void(size_t)>& arrived) {
  if (items.empty()) return {};
  ways = std::min<unsigned>({std::max(1u, ways), std::max(1u, impl_->o.connections), unsigned(items.size())});
  Node* n = impl_->owner(slot_key);
  const size_t per = (items.size() + ways - 1) / ways;
  const char* verb = del ? "GETDEL" : "GET";
  bool redirected = false;
  Status st = spread_raw(*impl_, *n, ways, deadline, redirected, [&](unsigned w, Conn& conn, bool& healthy, bool& redir) -> Status {
    const size_t a = std::min(items.size(), w * per), b = std::min(items.size(), a + per);
    std::string req;
    for (size_t i = a; i < b; ++i)
      req += "*2\r\n$" + std::to_string(std::strlen(verb)) + "\r\n" + verb + "\r\n$" + std::to_string(items[i].key.size()) +
             "\r\n" + items[i].key + "\r\n";
    SL_TRY(write_all(conn, {iovec{req.data(), req.size()}}, n->addr()));
    RawReader rd(conn, n->addr());
    Status first;
    for (size_t i = a; i < b; ++i) {
      std::string err;
      Status s = rd.bulk_into(items[i].dst, err);
      if (s.ok() && !err.empty()) {
        if (impl_->o.cluster && redirect_text(err)) redir = true;
        else s = make_error(Errc::io, "redis at " + n->addr() + ": " + verb + ": " + err);
      }
      if (!s.ok() && s.error().code != Errc::not_found && s.error().code != Errc::corrupt) return s;  // broken
      if (!s.ok() && first.ok()) first = s;
      if (s.ok() && err.empty() && ways == 1 && arrived) arrived(i);
    }
    healthy = rd.drained();
    return redir ? Status{} : first;
  });
  if (!redirected || !st.ok()) return st;
  for (const GetItem& it : items) {  // redirected: the slow path, one value at a time
    Cmd c;
    c.arg(verb).arg(it.key);
    SL_ASSIGN(auto rs, run(slot_key, std::span<const Cmd>(&c, 1), deadline));
    if (is_nil(rs[0])) return make_error(Errc::not_found, "a value is gone");
    if (is_error(rs[0])) return make_error(Errc::io, "redis: " + std::string(str(rs[0])));
    if (str(rs[0]).size() != it.dst.size()) return make_error(Errc::corrupt, "a value in the store has another size");
    std::memcpy(it.dst.data(), str(rs[0]).data(), it.dst.size());
  }
  return {};
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
