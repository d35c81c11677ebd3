// The Redis client's implementation shared by redis.cpp (connecting, commands, cluster routing)
// and redis_raw.cpp (large values straight between the socket and their place): connections, the
// node pools, Redis::Impl, and the raw socket I/O beside hiredis. Internal.
#pragma once
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
namespace detail {

inline timeval tv_until(Deadline deadline, double min_s = 0.001) {
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
inline std::string tls_reason(const char* fallback) {
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
inline const int64_t kSpinNs = [] {
  const char* e = std::getenv("STAGELINK_REDIS_SPIN_US");
  return int64_t((e ? std::max(0.0, std::atof(e)) : 100.0) * 1000);
}();

// Spins until the socket has bytes to read (or the spin ends): TLS only, whose reads block.
inline void spin_until_readable(int fd) {
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
inline ssize_t conn_read(Conn& c, void* buf, size_t n, int& err) {
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

inline Error sock_error(const std::string& addr, const char* what, int err) {
  const bool slow = err == EAGAIN || err == EWOULDBLOCK;
  return make_error(slow ? Errc::timeout : Errc::io,
                    "redis at " + addr + ": " + what + ": " + (slow ? std::string("no progress before the deadline")
                                                                    : std::string(std::strerror(err))));
}

// A command's arguments as hiredis takes them (into vectors the caller reuses).
inline void argv_of(const Cmd& cmd, std::vector<const char*>& av, std::vector<size_t>& al) {
  av.clear();
  al.clear();
  for (auto a : cmd.args) {
    av.push_back(a.data());
    al.push_back(a.size());
  }
}

// The command hiredis formatted into the context's output buffer, written out.
inline Status flush_out(Conn& c, const std::string& addr);

// The next reply of a pipeline: parsed by hiredis's reader from bytes read here.
inline Status next_reply(Conn& c, const std::string& addr, void** out) {
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

}  // namespace detail
using namespace detail;

struct Redis::Impl {
  RedisOptions o;
  std::atomic<uint64_t> round_trips{0};  // batches written and answered (pipeline(), spread_raw parts)
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
    round_trips.fetch_add(1, std::memory_order_relaxed);
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

namespace detail {

// Raw I/O on a connection whose hiredis buffers are empty (between complete pipelines), and no
// decrypted bytes wait in its TLS session.
inline bool quiet(Conn& conn) {
  redisContext* c = conn.c;
  return sdslen(c->obuf) == 0 && (!c->reader->buf || c->reader->pos >= sdslen(c->reader->buf)) &&
         (!conn.ssl || SSL_pending(conn.ssl) == 0);
}


// TLS: small pieces are gathered into records of up to 64 KiB; large ones go as they are
// (OpenSSL cuts them into records without a copy of ours).
inline Status tls_write_all(Conn& c, const std::vector<iovec>& iov, const std::string& addr) {
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

inline Status write_all(Conn& c, std::vector<iovec> iov, const std::string& addr) {
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

inline Status flush_out(Conn& c, const std::string& addr) {
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

inline bool redirect_text(const std::string& e) {
  return e.rfind("MOVED ", 0) == 0 || e.rfind("ASK ", 0) == 0 || e.rfind("CLUSTERDOWN", 0) == 0 ||
         e.rfind("TRYAGAIN", 0) == 0;
}

}  // namespace detail
}  // namespace stagelink::store
