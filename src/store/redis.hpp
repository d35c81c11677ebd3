// A small Redis client over hiredis (internal): connection pools per node, pipelined batches,
// batches spread over several connections, blocking commands on their own connection, and Redis
// Cluster routing (CLUSTER SLOTS, hash tags, MOVED and ASK followed). Every call has a deadline;
// a connection that failed is dropped and made again by the next call (a restarted server is
// reached again).
#pragma once
#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "stagelink/connector.hpp"
#include "stagelink/result.hpp"
#include "stagelink/payload.hpp"

struct redisReply;

namespace stagelink::store {

struct RedisOptions {
  std::vector<std::pair<std::string, int>> nodes;  // one server, or a cluster's seed nodes
  bool cluster = false;
  std::string username, password;
  int db = 0;
  double timeout_s = 5;    // connect and each command
  unsigned connections = 1;  // per node, for batches spread over connections
  // TLS (OpenSSL) on every connection when `tls`: the server's certificate is verified against
  // `ca_file` (else the system's trust store) and its name against `server_name` (else the host)
  // unless `verify` is off; `cert_file`/`key_file` present a client certificate.
  struct Tls {
    bool on = false, verify = true;
    std::string ca_file, cert_file, key_file, server_name;
  } tls;
};

// One command: its arguments, viewing the caller's memory (nothing is copied before hiredis).
// A temporary string argument is kept by the command itself.
struct Cmd {
  std::vector<std::span<const char>> args;
  std::deque<std::string> owned;  // element addresses stay put, also when the Cmd moves
  Cmd() = default;
  Cmd(Cmd&&) = default;
  Cmd& operator=(Cmd&&) = default;
  Cmd(const Cmd&) = delete;
  Cmd& operator=(const Cmd&) = delete;
  Cmd& arg(const std::string& s) {
    args.emplace_back(s.data(), s.size());
    return *this;
  }
  Cmd& arg(const char* s) { return arg(std::string_view(s)); }
  Cmd& arg(std::string_view s) {
    args.emplace_back(s.data(), s.size());
    return *this;
  }
  Cmd& arg(std::string&& s) {
    const std::string& kept = owned.emplace_back(std::move(s));
    args.emplace_back(kept.data(), kept.size());
    return *this;
  }
  Cmd& arg(std::span<const std::byte> b) {
    args.emplace_back(reinterpret_cast<const char*>(b.data()), b.size());
    return *this;
  }
};

struct ReplyDeleter {
  void operator()(redisReply* r) const;
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// Reply accessors (a null reply reads as nil).
bool is_nil(const Reply& r);
bool is_error(const Reply& r);
std::string_view str(const Reply& r);  // string, status or error text
long long integer(const Reply& r);
size_t elements(const Reply& r);
const redisReply* element(const Reply& r, size_t i);
std::string_view str(const redisReply* r);
long long integer(const redisReply* r);

// The Redis cluster slot of a key (CRC16 of its hash tag, as the cluster specification defines).
unsigned key_slot(std::string_view key);

class Redis {
 public:
  // Connects to the first reachable node (a cluster: reads its slot map). Errors: io (no node
  // reachable, named), invalid_argument (wrong password: the server's words), timeout.
  static Result<std::unique_ptr<Redis>> connect(const RedisOptions& o);
  ~Redis();

  // `cmds` pipelined on one connection of the node that owns `slot_key`'s slot (every key of the
  // batch shares that slot). Replies in order; a reply may be an error reply (the caller reads
  // it). Errors: io, timeout (nothing from the server before `deadline`).
  Result<std::vector<Reply>> run(std::string_view slot_key, std::span<const Cmd> cmds, Deadline deadline);
  // Round trips to the servers so far: batches written and answered (one per pipelined batch,
  // per connection of a spread transfer).
  uint64_t round_trips() const;
  // Large values without copies: SET key value PX px for each item, written to the socket from
  // the caller's memory, and GET (GETDEL with `del`) of values whose sizes the caller knows, read
  // from the socket straight into the caller's memory; pipelined, spread over up to `ways`
  // connections. Errors: not_found (a value missing), corrupt (a value of another size),
  // exhausted (the server's OOM), io, timeout. In a cluster, a redirection falls back to run().
  struct SetItem {
    std::string key;
    std::vector<std::span<const std::byte>> value;  // its parts, in order (gathered on the way out)
  };
  struct GetItem {
    std::string key;
    std::span<std::byte> dst;
  };
  // `then` (commands of the same slot) follow the values on the same connection when the values
  // go over one; their replies land in `then_replies` (else the caller runs them itself: they
  // are left unrun and `then_replies` empty). `sending(i)`, when given and one connection takes
  // them all, is called just before item i goes out, in order: the items are then sent one by one
  // and `then` is formatted after the last (it may read what the calls wrote). Returns whether it
  // was called for every item.
  Status set_values(std::string_view slot_key, std::span<const SetItem> items, const std::string& px, unsigned ways,
                    Deadline deadline, std::span<const Cmd> then = {}, std::vector<Reply>* then_replies = nullptr,
                    const std::function<void(size_t)>& sending = {}, bool* sent_each = nullptr);
  // `arrived(i)`, when given, is called as item i lands, in order, where one connection reads them
  // all (ways 1); with several connections it is not called.
  Status get_values(std::string_view slot_key, std::span<const GetItem> items, bool del, unsigned ways,
                    Deadline deadline, const std::function<void(size_t)>& arrived = {});
  // A blocking command (BLPOP ...) that may wait until `deadline`, on a connection of its own,
  // followed by `cmds[1..]` (same slot) in the same pipeline: the server holds those back while
  // the first blocks and runs them the moment it returns, so what the waiter does next (claim
  // what it was woken for) costs no round trip. Returns every reply, in order.
  // `fd_slot` (optional) holds the connection's socket while it waits: another thread may end the
  // wait at once by taking it (exchange(-2)), shutdown() of it, then store(-3) (the call then fails
  // with io; the connection is dropped).
  Result<std::vector<Reply>> blocking(std::string_view slot_key, std::span<const Cmd> cmds, Deadline deadline,
                                      std::atomic<int>* fd_slot = nullptr);
  // Close the connections nobody is using (those in use close when they come back).
  void close_idle();

  // Address(es), role, memory (INFO of the node owning slot 0, or of the one server).
  Value info();
  std::string describe() const;  // "redis://host:port" or "redis cluster (seeds ...)"
  const RedisOptions& options() const;
  // A server setting (CONFIG GET), empty when the server refuses CONFIG.
  std::string config_get(const std::string& name);

  struct Impl;  // opaque (public for this file's helpers)

 private:
  explicit Redis(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace stagelink::store
