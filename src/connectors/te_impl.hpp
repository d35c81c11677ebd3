// TransferEngineConnector's implementation, shared by te_connector.cpp (its options, puts, gets and
// the receiving side) and te_side_channel.cpp (the sender's side channel: queries and pulls served,
// connect-backs, tokens). Internal: the public face is make_te_connector (te_connector.hpp).
#pragma once
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <random>
#include <map>
#include <mutex>
#include <thread>
#include <zmq.hpp>

#include "connectors/capabilities.hpp"
#include "connectors/internal_key.hpp"
#include "connectors/names.hpp"
#include "core/log.hpp"
#include "core/net.hpp"
#include "core/options.hpp"
#include "core/proc.hpp"
#include "core/curve_config.hpp"
#include "core/host_pool.hpp"
#include "core/zap.hpp"
#include "core/zmq_guard.hpp"
#include "core/zmq_fork.hpp"
#include "core/zmq_util.hpp"
#include "cuda/driver.hpp"
#include "stagelink/connector.hpp"
#include "stagelink/frame.hpp"
#include "ucx/engine.hpp"

namespace stagelink::te {

struct TeOptions {
  std::string host = "auto";
  int zmq_port = 50051;
  std::string protocol = "tcp";
  std::string device;
  size_t pool_bytes = 256u << 20;
  std::string pool_device = "cpu";  // memory_pool_device: cpu, or cuda (staged through this host pool)
  std::string role;
  std::string sender_host;  // receiver side, for gets without metadata (update_sender_info)
  int sender_port = 0;
  double timeout_s = 10;
  double put_timeout_s = 5;
  double ttl_s = 300;
  uint32_t readers = 1;
  unsigned lanes = 1;  // endpoints one payload is split over (measured here: 1 fills a veth link best)
  std::string pull_channel = "ucx";  // ucx: pulls after the first go as UCX messages; zmq: all by the side channel
  std::optional<CurveConfig> curve;  // extra.curve: the side channel authenticated and encrypted
  bool serve_by_key = false;  // extra.serve_by_key: gets without the put's capability served to anyone
  std::vector<std::string> ignored;  // extra keys this connector does not read (options::Reader::unused)
};

inline std::string errc_str(Errc c) { return errc_name(c); }
inline Errc errc_from(const std::string& s) {
  for (int i = 0; i <= int(Errc::permission_denied); ++i)
    if (s == errc_name(Errc(i))) return Errc(i);
  return Errc::io;
}

// Payloads up to this size travel in the side channel's reply instead of a UCX write.
constexpr size_t kInlineMax = 64u << 10;
// The side channel's message bounds (ZMQ_MAXMSGSIZE): requests carry keys and a UCX worker
// address (a few hundred bytes to a few KiB); replies at most an inline payload and its frame.
constexpr size_t kSideChannelMaxRequest = 64u << 10;
// Connections a side channel lets in at once (receivers, one each): strangers beyond it are shut
// down, so what they hold is at most this many requests' worth.
constexpr size_t kSideChannelMaxConnections = 1024;
constexpr size_t kSideChannelMaxReply = kInlineMax + (64u << 10);

// Timeouts grow with size: the base, plus the size at 50 MB/s.
inline double timeout_for(double base, size_t bytes) { return base + double(bytes) / 50e6; }

class TeConnector final : public Connector, public SenderLink, public ReleaseTracking {
 public:
  explicit TeConnector(TeOptions o) : o_(std::move(o)), metrics_(*this), metrics_reg_(&metrics_) {}
  ~TeConnector() override {
    close();
    if (hello_efd_ >= 0) ::close(hello_efd_);
  }

  Status init(const std::string& name);

  const std::string& name() const override { return name_; }

  Result<PutResult> do_put(const std::string& from, const std::string& to, const std::string& key, const Payload& p, const PutOptions& po) override;

  Status update_sender_info(const std::string& host, int port) override;

  Result<GetResult> do_get(const std::string& from, const std::string& to, const std::string& key, const Value* md, Deadline deadline, const GetOptions& go) override;

  Value sender_info() override;

  // The side channel's hello: the sender connects its engine to ours (every lane it sends on) and
  // says how to reach its engine, which ours connects to (the lane pull requests take). What the
  // first get would otherwise do, and the endpoints ready for the next ones.
  Status connect(const Value& info, Deadline deadline) override;

  Result<GetResult> finish_get(const std::byte* at, size_t size, const std::shared_ptr<void>& region, const GetOptions& go, bool own);

  // Relay support: a put is released when its entry is gone (read by every reader, cleaned up,
  // expired) or replaced by a newer put of the key.
  Result<bool> put_released(const Value& md) override;
  uint64_t release_epoch() override {
    std::lock_guard<std::mutex> l(mu_);
    return epoch_;
  }
  bool wait_release_epoch(uint64_t seen, Deadline deadline) override {
    std::unique_lock<std::mutex> l(mu_);
    return release_cv_.wait_until(l, deadline, [&] { return epoch_ != seen || closed_.load(); });
  }

  size_t reap_consumed() override { return 0; }  // a read put's region is freed when its transfer ends
  void* find_capability(CapabilityId id) override {
    if (id == CapabilityId::sender_link) return static_cast<SenderLink*>(this);
    if (id == CapabilityId::releases) return static_cast<ReleaseTracking*>(this);
    return nullptr;
  }

  size_t do_cleanup(const std::string& rid) override;

  Value health() override;

  // UCX (its worker, its registered pool) and the side-channel thread do not survive fork(): a
  // connector inherited by a forked child says so instead of using the parent's.
  Status same_process() const;

  void close() override;

 private:
  struct Entry {
    size_t offset = 0, size = 0;
    bool fast = true;
    uint32_t readers_left = 1;
    uint32_t in_flight = 0;
    std::string rid, put_key;
    uint64_t created_ns = 0;
    uint64_t seq = 0;  // this put among the connector's (a replaced key's new put differs)
    uint64_t cap = 0;  // the capability a get must name (the put's metadata carries it)
  };
  struct Peer {
    std::mutex mu;
    zmq::socket_t sock;
    uint64_t next_id = 1;
    Peer(zmq::context_t& c) : sock(c, zmq::socket_type::dealer) {}
  };

  static Status reply_status(const Value& rep, const std::string& ik);

  // The side channel ("tcp://host:port") of the sender a get (of `key`) or a connect asks: the
  // source_host and source_port of `md` (a put's metadata, or {key: metadata}), else the sender
  // of update_sender_info or the config. `size`/`have_size`: the metadata's data_size. Errors:
  // corrupt (those keys malformed; a non-map is ignored, as other connectors' metadata is),
  // not_found (no sender known).
  Result<std::string> sender_endpoint(const Value* md, const std::string& key, const std::string& what, uint64_t* size,
                                      bool* have_size, uint64_t* cap);
  // Whether request `req` may read put `e` of `ik`: it names the put's capability, or names none
  // where the side channel's peers are the deployment's (extra.curve) or serve_by_key is on.
  Status admit(const Entry& e, const Value& req, const std::string& ik);
  static uint64_t new_capability();

  // One request/reply with the sender at `peer` (a DEALER per sender, requests numbered).
  Result<Value> call(const std::string& peer, Value::Map req, double timeout_s);

  // The sender's side channel: one request at a time (each is a query or a whole pull).
  void serve();

  // A hello connects back to the asking receiver's engine, which may take up to the timeout (a
  // stopped peer): never on this thread, which serves every peer. It runs on a thread of its own
  // (at most kMaxHellos at once; more are refused at once) and its reply is sent from here when
  // it is done (hello_efd_ wakes the serving loop). True: the request was a hello and is taken.
  static constexpr size_t kMaxHellos = 16;
  bool start_hello(zmq::message_t& ident, std::span<const std::byte> req);
  void signal_hello() {
    const uint64_t one = 1;
    if (::write(hello_efd_, &one, sizeof one) < 0) {
    }
  }
  void reap_hellos_locked();  // join the hello threads that are done
  void send_hello_replies();  // serving thread
  void join_hellos();

  static Value fail(Errc c, const std::string& msg, uint64_t rq);

  Value handle(std::span<const std::byte> bytes);

  // A pull is over: a failed one gives its reader back; the entry goes after its last reader.
  void end_pull(const std::string& ik, const Status& st);

  // A pull that came as a UCX message (progress thread: nothing here waits). The payload goes
  // back in parts over the lanes; errors go back as an error part.
  void serve_am_pull(std::span<const std::byte> bytes);

  // A random token for the receiver engine `worker` (the same one while it is remembered): its
  // pulls over UCX carry it. At most kMaxAuth receivers are remembered (the oldest forgotten).
  uint64_t issue_auth(const Value::Bytes& worker) {
    std::lock_guard<std::mutex> l(mu_);
    return issue_auth_locked(worker);
  }
  uint64_t issue_auth_locked(const Value::Bytes& worker);
  bool known_worker(const Value::Bytes& worker) {
    std::lock_guard<std::mutex> l(mu_);
    return auth_by_worker_.count(std::vector<std::byte>(worker.begin(), worker.end())) > 0;
  }
  // Receiver side: the token a sender's reply carries, for the pulls sent to it over UCX.
  void remember_auth_locked(const std::string& peer, const Value& rep) {
    uint64_t a = 0;
    if (const Value* v = rep.find("auth"); v && v->get_u64(a)) auths_[peer] = a;
  }

  // Unclaimed puts expire after ttl_s, never while a transfer is in flight.
  void sweep_locked();

  void released_locked() {
    ++epoch_;
    release_cv_.notify_all();
  }

  TeOptions o_;
  std::string name_, advertised_;
  int port_ = 0;
  std::shared_ptr<ucx::Engine> engine_;
  zmq::context_t ctx_{1};
  std::unique_ptr<zmq::socket_t> router_;
  std::unique_ptr<ConnectionGuard> guard_;  // how many may connect (core/zmq_guard.hpp)
  std::shared_ptr<zap::Admission> admission_;
  std::thread server_;
  struct Hello {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex hello_mu_;
  std::vector<Hello> hellos_;  // connect-backs under way (under hello_mu_)
  std::vector<std::pair<std::string, std::vector<std::byte>>> hello_replies_;  // (peer id, reply)
  int hello_efd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ForkStamp fork_;
  std::atomic<bool> stop_{false}, closed_{false};
  std::mutex mu_;
  std::condition_variable release_cv_;
  uint64_t epoch_ = 0;
  std::atomic<uint64_t> next_seq_{0}, next_token_{1};
  std::map<std::string, Entry> entries_;
  std::mutex peers_mu_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
  std::map<std::string, std::vector<std::byte>> workers_;  // side-channel address -> its engine's worker address
  std::map<std::string, uint64_t> auths_;                    // side-channel address -> the token it issued us
  std::map<std::string, uint64_t> peer_bytes_;               // side-channel address -> bytes got from it
  void count_peer_bytes(const std::string& peer, size_t n);
  std::map<std::vector<std::byte>, uint64_t> auth_by_worker_;  // sender: receiver engine -> its token (under mu_)
  std::deque<std::vector<std::byte>> auth_order_;              // the order they were issued (under mu_)
  std::atomic<uint64_t> refused_pulls_{0};
  // Beyond what the Connector base counts: the sender's side (pulls served, and those that failed).
  std::atomic<uint64_t> pulls_{0}, errors_{0}, gets_ucx_{0}, gets_side_{0}, connects_{0};
  // This connector's own samples in the metrics tree (the registration goes first in close()).
  struct Metrics final : metrics::Source {
    explicit Metrics(TeConnector& c) : c(c) {}
    void collect(metrics::Sink& out) const override;
    TeConnector& c;
  } metrics_;
  metrics::Registration metrics_reg_;
};

}  // namespace stagelink::te
