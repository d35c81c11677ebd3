// TransferEngineConnector (also MooncakeTransferEngineConnector): payloads between hosts over UCX.
//
// The sender stages each put in its registered pool and answers a ZeroMQ side channel (ROUTER on
// host:zmq_port). The receiver sets aside room in its own pool for a token and asks for the put (a
// pull request carrying its worker address, the length and the token); the sender sends it as a
// UCX active message tagged with the token, which the receiver's engine lands in that room, flushes,
// and only then replies done. After the first pull, pulls go as UCX messages themselves. Every
// message is a small msgpack map checked on receipt; a request id pairs replies with requests.
#include "connectors/te_connector.hpp"

#include "connectors/te_impl.hpp"

namespace stagelink {
namespace te {
namespace {

using options::Key;
using options::Type;
// The extra keys of TransferEngineConnector / MooncakeTransferEngineConnector (docs/te.md).
constexpr Key kTeKeys[] = {
    {"host", Type::string, "auto", "the address this connector serves on and puts name (auto: this host's)"},
    {"zmq_port", Type::integer, "50051", "the side channel's port (0: a free one)", 0, 65535},
    {"protocol", Type::choice, "tcp", "UCX transport family", 0, 0, "tcp|rdma"},
    {"device_name", Type::string, "", "the RDMA device (empty: RDMA_DEVICE_NAME, else UCX's choice)"},
    {"memory_pool_size", Type::size, "256 MiB", "the registered pool puts copy into and gets land in", 4096, 1ull << 44},
    {"memory_pool_device", Type::string, "cpu",
     "cpu, or cuda (the seed's key: CUDA tensors are staged through the registered host pool, GPU to GPU for the "
     "caller; a pool in GPU memory registered with UCX is not built yet)"},
    {"role", Type::choice, "", "sender, receiver or dual (set by the config loader)", 0, 0, "sender|receiver|dual"},
    {"sender_host", Type::string, "", "where a get without metadata finds its sender (update_sender_info)"},
    {"sender_zmq_port", Type::integer, "", "that sender's side-channel port", 0, 65535},
    {"timeout_s", Type::number, "10", "how long a get waits for its transfer", 0, 1e9},
    {"put_timeout_s", Type::number, "5", "how long a put waits for pool room", 0, 1e9},
    {"ttl_s", Type::number, "300", "unread puts older than this are dropped", 0, 1e12},
    {"readers", Type::integer, "1", "default fan-out", 1, 1024},
    {"lanes", Type::integer, "1", "endpoints one payload is split over", 1, 16},
    {"pull_channel", Type::choice, "ucx", "later pulls as UCX messages, or all through the side channel", 0, 0,
     "ucx|zmq"},
    {"curve", Type::map, "", "CurveZMQ keys for the side channel (docs/te.md, SECURITY.md)"},
    {"serve_by_key", Type::boolean, "false",
     "serve gets that name only the key (no put metadata) to whoever reaches the side channel; with curve, key "
     "holders get them anyway (SECURITY.md)"},
};
constexpr options::Schema kTeSchema{"TransferEngineConnector", "extra.", kTeKeys, false, options::kCommonConnectorKeys};

Result<TeOptions> te_options(const Value& e) {
  TeOptions o;
  SL_ASSIGN(const options::Reader r, options::Reader::open(kTeSchema, e));
  o.ignored = r.unused();
  SL_TRY(r.read("host", o.host));
  SL_TRY(r.read_int("zmq_port", o.zmq_port));
  SL_TRY(r.read("protocol", o.protocol));
  SL_TRY(r.read("device_name", o.device));
  SL_TRY(r.read_int("memory_pool_size", o.pool_bytes));
  SL_TRY(r.read("memory_pool_device", o.pool_device));
  SL_TRY(r.read("role", o.role));
  SL_TRY(r.read("sender_host", o.sender_host));
  SL_TRY(r.read_int("sender_zmq_port", o.sender_port));
  SL_TRY(r.read("timeout_s", o.timeout_s));
  SL_TRY(r.read("put_timeout_s", o.put_timeout_s));
  SL_TRY(r.read("ttl_s", o.ttl_s));
  SL_TRY(r.read_int("readers", o.readers));
  SL_TRY(r.read_int("lanes", o.lanes));
  SL_TRY(r.read("pull_channel", o.pull_channel));
  SL_TRY(r.read("serve_by_key", o.serve_by_key));
  if (o.device.empty())
    if (const char* d = std::getenv("RDMA_DEVICE_NAME")) o.device = d;
  if (o.pool_device != "cpu") {
    if (o.pool_device.rfind("cuda", 0) != 0)
      return make_error(Errc::invalid_argument, "TransferEngineConnector: extra.memory_pool_device must be cpu or "
                                                "cuda, got '" + o.pool_device + "'");
    // GPU to GPU for the caller, through the registered host pool (a CUDA tensor is copied to
    // pinned memory at put, and back to its GPU at get). A host without a GPU is told so now.
    if (auto drv = cuda::driver(); !drv.ok())
      return make_error(Errc::unsupported, "memory_pool_device '" + o.pool_device + "': " + drv.error().message + "; use cpu");
  }
  SL_ASSIGN(o.curve, curve_from_extra(e, "TransferEngineConnector"));
  return o;
}

}  // namespace

Status TeConnector::init(const std::string& name) {
  name_ = name;
  ucx::EngineOptions eo;
  eo.protocol = o_.protocol;
  eo.device = o_.device;
  eo.pool_bytes = o_.pool_bytes;
  eo.lanes = o_.lanes;
  SL_ASSIGN(engine_, ucx::Engine::create(eo));
  advertised_ = o_.host == "auto" ? net::host_address() : o_.host;
  if (o_.role != "receiver") {  // a sender (or both): serve the side channel
    // The address it advertises, never every interface: a side channel reachable on an
    // interface no peer uses is only exposure.
    const std::string bind_host = advertised_;
    try {
      router_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::router);
      router_->set(zmq::sockopt::linger, 0);
      // Requests are small maps (a key, a worker address): a peer declaring a larger frame is
      // disconnected by libzmq before anything of it is buffered.
      router_->set(zmq::sockopt::maxmsgsize, int64_t(kSideChannelMaxRequest));
      SL_ASSIGN(guard_, ConnectionGuard::attach(ctx_, *router_, kSideChannelMaxConnections));
      if (o_.curve) {
        SL_ASSIGN(admission_, zap::serve(ctx_, *router_, o_.curve->server));
      } else if (bind_host.rfind("127.", 0) != 0 && bind_host != "localhost" && bind_host != "::1") {
        static std::atomic<bool> said{false};
        if (!said.exchange(true))
          SL_LOG_WARN("%s: its side channel serves %s without CURVE: any host that reaches it can list this "
                      "sender's keys and pull small payloads. Set extra.curve (SECURITY.md)",
                      name.c_str(), bind_host.c_str());
      }
      router_->bind("tcp://" + bind_host + ":" + std::to_string(o_.zmq_port));
      const std::string last = router_->get(zmq::sockopt::last_endpoint);
      port_ = std::stoi(last.substr(last.rfind(':') + 1));
    } catch (const zmq::error_t& e) {
      return make_error(Errc::io, "side channel on " + bind_host + ":" + std::to_string(o_.zmq_port) +
                                      " (zmq_port): " + e.what() +
                                      (e.num() == EADDRINUSE ? " (the port is taken)" : ""));
    }
    engine_->on_request([this](std::span<const std::byte> b) { serve_am_pull(b); });
    server_ = std::thread([this] { serve(); });
  }
  return {};
}

Result<PutResult> TeConnector::do_put(const std::string& from, const std::string& to, const std::string& key, const Payload& p, const PutOptions& po) {
  SL_TRY(same_process());
  if (closed_) return make_error(Errc::closed, name_ + " is closed");
  if (!router_) return make_error(Errc::invalid_argument, name_ + " with role receiver cannot put");
  SL_TRY(validate_name("from_stage", from, 64));
  SL_TRY(validate_name("to_stage", to, 64));
  SL_TRY(validate_name("key", key, 160));
  SL_ASSIGN(FramePlan plan, plan_frame(p));
  SL_ASSIGN(size_t off, engine_->allocate(plan.total, deadline_after(o_.put_timeout_s)));
  write_frame(plan, p.tensors, engine_->pool_base() + off);
  Entry e;
  e.offset = off;
  e.size = plan.total;
  e.fast = !p.ext_has("pickle");
  e.readers_left = po.readers ? po.readers : o_.readers;
  e.rid = std::string(po.request_id);
  e.put_key = key;
  e.created_ns = mono_ns();
  e.seq = next_seq_.fetch_add(1) + 1;
  e.cap = new_capability();
  const std::string ik = make_internal_key(key, from, to);
  {
    std::unique_lock<std::mutex> l(mu_);
    sweep_locked();
    // A transfer of the key's previous put still under way (its reader may already have the
    // bytes while the sender's completion is on its way): waited for, up to put_timeout_s.
    const Deadline dl = deadline_after(o_.put_timeout_s);
    release_cv_.wait_until(l, dl, [&] {
      auto i = entries_.find(ik);
      return i == entries_.end() || i->second.in_flight == 0 || closed_.load();
    });
    auto it = entries_.find(ik);
    if (it != entries_.end() && it->second.in_flight == 0) {  // an unread put of the key: replaced
      engine_->free(it->second.offset, it->second.size);
      entries_.erase(it);
    } else if (it != entries_.end()) {
      engine_->free(off, plan.total);
      return make_error(Errc::exists, "key '" + ik + "' is being transferred; put it again after");
    }
    entries_.emplace(ik, e);
  }
  PutResult r;
  r.size = plan.total;
  Value::Map md;
  md.emplace_back("source_host", advertised_);
  md.emplace_back("source_port", uint64_t(port_));
  md.emplace_back("data_size", uint64_t(plan.total));
  md.emplace_back("is_fast_path", e.fast);
  md.emplace_back("put_seq", e.seq);  // beyond the seed: lets this connector say when it was read
  md.emplace_back("key", ik);
  md.emplace_back("cap", e.cap);  // the capability to read it: only in the metadata (SECURITY.md)
  r.metadata = Value(std::move(md));
  return r;
}

Status TeConnector::update_sender_info(const std::string& host, int port) {
  if (host.empty() || port <= 0 || port > 65535)
    return make_error(Errc::invalid_argument, "update_sender_info: a host and a port in [1, 65535]");
  std::lock_guard<std::mutex> l(mu_);
  o_.sender_host = host;
  o_.sender_port = port;
  return {};
}

Result<GetResult> TeConnector::do_get(const std::string& from, const std::string& to, const std::string& key, const Value* md, Deadline deadline, const GetOptions& go) {
  SL_TRY(same_process());
  if (closed_) return make_error(Errc::closed, name_ + " is closed");
  SL_TRY(validate_name("from_stage", from, 64));
  SL_TRY(validate_name("to_stage", to, 64));
  SL_TRY(validate_name("key", key, 160));
  const std::string ik = make_internal_key(key, from, to);
  uint64_t size = 0, cap = 0;
  bool have_size = false;
  SL_ASSIGN(const std::string peer, sender_endpoint(md, key, "get of '" + ik + "'", &size, &have_size, &cap));
  if (!have_size) {  // ask the sender (query) first; until `deadline` while it has no such put
    for (uint64_t backoff_us = 1000;; backoff_us = std::min<uint64_t>(backoff_us * 2, 50'000)) {
      Value::Map q;
      q.emplace_back("op", "query");
      q.emplace_back("key", ik);
      if (cap) q.emplace_back("cap", cap);
      SL_ASSIGN(Value rep, call(peer, std::move(q), o_.timeout_s));
      Status st = reply_status(rep, ik);
      if (st.ok()) {
        const Value* s = rep.find("size");
        if (!s || !s->get_u64(size)) return make_error(Errc::corrupt, "query reply without a size");
        break;
      }
      // The sender has no such put yet: ask again (backing off to 50 ms; the side channel has
      // no notification) until the deadline.
      if (st.error().code != Errc::not_found || deadline == kNoWait ||
          Clock::now() + std::chrono::microseconds(backoff_us) >= deadline)
        return std::move(st).error();
      if (go.keep_waiting && !go.keep_waiting())
        return make_error(Errc::cancelled, "the get of '" + ik + "' was interrupted while it waited");
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
  }
  // The receiver's memory is bounded by its pool whichever way the payload lands: a size named
  // by metadata or by a sender's reply never makes it allocate more.
  if (size > engine_->pool_size())
    return make_error(Errc::exhausted, "'" + ik + "' holds " + std::to_string(size) +
                                           " bytes, more than this receiver's memory pool");
  const double tmo = timeout_for(o_.timeout_s, size);
  // Where the payload lands: a region of the pool, or, for a caller that would copy it out at
  // once (private_ok: the Python binding's default get) and from 1 MiB, a host buffer of this
  // process (pooled: already mapped when one of that size was dropped before), which the result
  // then owns: the copy after the transfer is gone (issue 52: the copying get took 1.2-1.6x the
  // zero-copy one).
  std::byte* dst = nullptr;
  std::shared_ptr<void> region;  // non-null (views test their keepalive)
  const bool own = go.zero_copy && go.hooks && go.hooks->private_ok && size >= host_pool::kPooledMin;
  if (own) {
    std::shared_ptr<std::byte> buf = host_pool::allocate_mapped(size);
    if (!buf) return make_error(Errc::exhausted, "no memory for a buffer of " + std::to_string(size) + " bytes");
    dst = buf.get();
    region = std::shared_ptr<void>(buf, buf.get());
  } else {
    SL_ASSIGN(size_t off, engine_->allocate(size, deadline_after(tmo)));
    dst = engine_->pool_base() + off;
    region = std::shared_ptr<void>(dst, [eng = engine_, off, size](void*) { eng->free(off, size); });
  }
  const uint64_t token = (uint64_t(getpid()) << 40) ^ next_token_.fetch_add(1);
  engine_->expect(token, dst, size, region);
  struct Forget {
    ucx::Engine* e;
    uint64_t t;
    ~Forget() { e->forget(t); }
  } forget{engine_.get(), token};
  // A sender met before is asked over UCX (one message each way, no side-channel thread hops);
  // otherwise, or when that endpoint broke, over the side channel, whose reply says how to reach
  // the sender's engine next time.
  std::vector<std::byte> sender_worker;
  uint64_t auth = 0;
  if (o_.pull_channel == "ucx") {
    std::lock_guard<std::mutex> l(peers_mu_);
    if (auto it = workers_.find(peer); it != workers_.end()) sender_worker = it->second;
    if (auto it = auths_.find(peer); it != auths_.end()) auth = it->second;
  }
  if (!sender_worker.empty()) {
    Value::Map pull;
    pull.emplace_back("key", ik);
    pull.emplace_back("len", uint64_t(size));
    pull.emplace_back("token", token);
    pull.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
    pull.emplace_back("auth", auth);  // issued to this receiver by the sender's side channel
    if (cap) pull.emplace_back("cap", cap);
    const auto msg = value_to_msgpack(Value(std::move(pull)));
    Status sent = engine_->request(sender_worker, msg, deadline_after(o_.timeout_s));
    if (sent.ok()) {
      Status st = engine_->wait_landed(token, deadline_after(tmo), sender_worker);
      if (st.ok()) {
        gets_ucx_.fetch_add(1);
        count_peer_bytes(peer, size);
        return finish_get(dst, size, region, go, own);
      }
      if (st.error().code != Errc::peer_dead) return make_error(st.error().code, "'" + ik + "': " + st.error().message);
    }
    std::lock_guard<std::mutex> l(peers_mu_);  // that engine is gone: back to the side channel
    workers_.erase(peer);
    engine_->expect(token, dst, size, region);
  }
  Value::Map pull;
  pull.emplace_back("op", "pull");
  pull.emplace_back("key", ik);
  pull.emplace_back("len", uint64_t(size));
  pull.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
  pull.emplace_back("inline_max", uint64_t(kInlineMax));
  pull.emplace_back("token", token);
  if (cap) pull.emplace_back("cap", cap);
  SL_ASSIGN(Value rep, call(peer, std::move(pull), tmo));
  SL_TRY(reply_status(rep, ik));
  gets_side_.fetch_add(1);
  if (const Value* w = rep.find("worker"); w && w->is<Value::Bytes>() && !w->as<Value::Bytes>().empty()) {
    const auto& wb = w->as<Value::Bytes>();
    std::lock_guard<std::mutex> l(peers_mu_);
    workers_[peer].assign(wb.begin(), wb.end());
    remember_auth_locked(peer, rep);
  }
  if (const Value* d = rep.find("data")) {  // a small payload came back in the reply itself
    if (!d->is<Value::Bytes>() || d->as<Value::Bytes>().size() != size)
      return make_error(Errc::corrupt, "inline reply of " + std::to_string(d->is<Value::Bytes>() ? d->as<Value::Bytes>().size() : 0) +
                                           " bytes for a payload of " + std::to_string(size));
    std::memcpy(dst, d->as<Value::Bytes>().data(), size);
  } else if (rep.find("am")) {  // sent as an active message: wait until it has landed here
    SL_TRY(engine_->wait_landed(token, deadline_after(tmo)));
  }
  count_peer_bytes(peer, size);
  return finish_get(dst, size, region, go, own);
}

Value TeConnector::sender_info() {
  if (!router_) return Value();
  Value::Map m;
  m.emplace_back("source_host", advertised_);
  m.emplace_back("source_port", uint64_t(port_));
  return Value(std::move(m));
}

Status TeConnector::connect(const Value& info, Deadline deadline) {
  SL_TRY(same_process());
  if (closed_) return make_error(Errc::closed, name_ + " is closed");
  if (!info.is_nil() && !info.is<Value::Map>())
    return make_error(Errc::corrupt, "connect takes a sender's sender_info() or one of its puts' metadata (a map)");
  SL_ASSIGN(const std::string peer, sender_endpoint(info.is_nil() ? nullptr : &info, "", "connect", nullptr, nullptr, nullptr));
  Value::Map hello;
  hello.emplace_back("op", "hello");
  hello.emplace_back("key", "");
  hello.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
  const double left_s = std::chrono::duration<double>(deadline - Clock::now()).count();
  if (!(left_s > 0)) return make_error(Errc::timeout, "connect to " + peer + ": the deadline has passed");
  SL_ASSIGN(Value rep, call(peer, std::move(hello), std::min(left_s, 1e9)));
  SL_TRY(reply_status(rep, "connect"));
  const Value* w = rep.find("worker");
  if (!w || !w->is<Value::Bytes>() || w->as<Value::Bytes>().empty())
    return make_error(Errc::corrupt, "the sender at " + peer + " replied to connect without its worker address");
  SL_TRY(engine_->connect(w->as<Value::Bytes>(), 1, deadline));  // pull requests take lane 0
  if (o_.pull_channel == "ucx") {
    std::lock_guard<std::mutex> l(peers_mu_);
    workers_[peer].assign(w->as<Value::Bytes>().begin(), w->as<Value::Bytes>().end());
    remember_auth_locked(peer, rep);
  }
  connects_.fetch_add(1);
  return {};
}

Result<GetResult> TeConnector::finish_get(const std::byte* at, size_t size, const std::shared_ptr<void>& region, const GetOptions& go, bool own) {
  const std::span<const std::byte> bytes(at, size);
  GetResult g;
  g.size = size;
  g.owned = own;
  if (go.zero_copy) {
    SL_TRY(decode_frame_into(bytes, region, g.payload, !(go.hooks && go.hooks->raw_tree)));  // views hold the region
  } else {
    SL_TRY(decode_frame_copy_into(bytes, g.payload));
  }
  return g;
}

Result<bool> TeConnector::put_released(const Value& md) {
  const Value *k = md.find("key"), *sq = md.find("put_seq");
  uint64_t seq = 0;
  if (!k || !k->is<std::string>() || !sq || !sq->get_u64(seq))
    return make_error(Errc::corrupt, "put_released: not this connector's put metadata");
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k->as<std::string>());
  return it == entries_.end() || it->second.seq != seq;
}

size_t TeConnector::do_cleanup(const std::string& rid) {
  std::lock_guard<std::mutex> l(mu_);
  size_t n = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.in_flight == 0 && (it->second.put_key == rid || it->second.rid == rid)) {
      engine_->free(it->second.offset, it->second.size);
      it = entries_.erase(it);
      released_locked();
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

Value TeConnector::health() {
  Value::Map m;
  m.emplace_back("status", closed_ ? "closed" : "healthy");
  m.emplace_back("connector", name_);
  m.emplace_back("role", o_.role.empty() ? std::string("sender+receiver") : o_.role);
  options::add_ignored(m, o_.ignored);
  m.emplace_back("host", advertised_);
  m.emplace_back("zmq_port", uint64_t(port_));
  add_counts(m);
  m.emplace_back("pulls_served", uint64_t(pulls_.load()));
  m.emplace_back("gets_over_ucx", uint64_t(gets_ucx_.load()));  // pull request sent as a UCX message
  m.emplace_back("gets_over_side_channel", uint64_t(gets_side_.load()));
  m.emplace_back("connects", uint64_t(connects_.load()));  // connect() calls that set up a sender
  m.emplace_back("serve_errors", uint64_t(errors_.load()));  // pulls this sender failed to serve
  m.emplace_back("curve", bool(o_.curve));  // the side channel authenticated and encrypted
  m.emplace_back("refused_peers", uint64_t((admission_ ? admission_->refused() : 0) + (guard_ ? guard_->refused() : 0)));
  m.emplace_back("refused_pulls", uint64_t(refused_pulls_.load()));  // without a token or the put's capability
  {
    std::lock_guard<std::mutex> l(mu_);
    m.emplace_back("outstanding", uint64_t(entries_.size()));
  }
  if (engine_) m.emplace_back("ucx", engine_->info());
  // CUDA tensors: staged through the registered host pool (pinned at put, back on their GPU at get);
  // `ucx_cuda` says whether this UCX could move GPU memory itself (a GPU pool would need it).
  m.emplace_back("memory_pool_device", o_.pool_device);
  if (engine_) m.emplace_back("ucx_cuda", engine_->cuda_memory());
  return Value(std::move(m));
}

Status TeConnector::same_process() const {
  if (!fork_.inherited()) [[likely]]
    return {};
  return make_error(Errc::unsupported, name_ + " was made in the parent of this forked process; UCX does not "
                                               "survive fork(): make a new connector in this process");
}

namespace {
using metrics::Family;
using metrics::Kind;
const Family kTePulls{"stagelink_te_pulls_served_total", Kind::counter, "",
                      "pulls this sender served (its puts' bytes written into receivers)", {"connector"}};
const Family kTeServeErrors{"stagelink_te_serve_errors_total", Kind::counter, "",
                            "pulls this sender failed or refused to serve", {"connector"}};
const Family kTeGetsVia{"stagelink_te_gets_total", Kind::counter, "",
                        "gets by how their pull request reached the sender (ucx or side_channel)", {"connector", "via"}};
const Family kTeConnects{"stagelink_te_connects_total", Kind::counter, "",
                         "connect() calls that set up a sender ahead of its first get", {"connector"}};
const Family kTeRefused{"stagelink_te_refused_total", Kind::counter, "",
                        "peers refused at the side channel's handshake and pulls without the put's capability",
                        {"connector"}};
const Family kTeOutstanding{"stagelink_te_outstanding_entries", Kind::gauge, "",
                            "puts of this sender not yet pulled by every reader", {"connector"}};
const Family kTePeerBytes{"stagelink_te_get_bytes_by_peer_total", Kind::counter, "bytes",
                          "bytes this receiver's gets pulled from each sender (its side-channel address)",
                          {"connector", "peer"}};
const Family kTeWriteBytes{"stagelink_te_write_bytes_total", Kind::counter, "bytes",
                           "bytes this sender's engine wrote into receivers (remote writes)", {"connector"}};
const Family kTePool{"stagelink_te_pool_bytes", Kind::gauge, "bytes", "the registered memory pool's size",
                     {"connector"}};
const Family kTePoolUsed{"stagelink_te_pool_used_bytes", Kind::gauge, "bytes",
                         "the registered memory pool's bytes in use", {"connector"}};
const Family kTeTransports{"stagelink_te_transports_info", Kind::gauge, "",
                           "1, labelled with the UCX protocol asked for and the transports and devices UCX "
                           "selected (its context report, condensed)",
                           {"connector", "protocol", "transports"}};
}  // namespace

void TeConnector::Metrics::collect(metrics::Sink& out) const {
  const std::string l = c.metrics_label();
  out.value(kTePulls, {l}, double(c.pulls_.load()));
  out.value(kTeServeErrors, {l}, double(c.errors_.load()));
  out.value(kTeGetsVia, {l, "ucx"}, double(c.gets_ucx_.load()));
  out.value(kTeGetsVia, {l, "side_channel"}, double(c.gets_side_.load()));
  out.value(kTeConnects, {l}, double(c.connects_.load()));
  out.value(kTeRefused, {l}, double(c.refused_pulls_.load()));
  {
    std::lock_guard<std::mutex> g(c.peers_mu_);
    for (const auto& [peer, n] : c.peer_bytes_) out.value(kTePeerBytes, {l, peer}, double(n));
  }
  if (c.engine_) {
    const Value info = c.engine_->info();
    auto num = [&](const char* k) {
      const Value* v = info.find(k);
      uint64_t n = 0;
      return v && v->get_u64(n) ? double(n) : 0.0;
    };
    auto str = [&](const char* k) {
      const Value* v = info.find(k);
      return v && v->is<std::string>() ? v->as<std::string>() : std::string();
    };
    out.value(kTeWriteBytes, {l}, num("write_bytes"));
    out.value(kTePool, {l}, num("pool_bytes"));
    out.value(kTePoolUsed, {l}, num("pool_used"));
    out.value(kTeTransports, {l, str("protocol"), str("transports")}, 1);
  }
  std::lock_guard<std::mutex> g(c.mu_);
  out.value(kTeOutstanding, {l}, double(c.entries_.size()));
}

void TeConnector::count_peer_bytes(const std::string& peer, size_t n) {
  std::lock_guard<std::mutex> l(peers_mu_);
  peer_bytes_[peer] += n;
}

void TeConnector::close() {
  metrics_reg_.reset();  // first, not under mu_ (a collection takes the tree's lock, then mu_)
  if (closed_.exchange(true)) return;
  if (fork_.inherited()) {
    // Inherited through fork(): the side-channel thread, the UCX engine (and its progress
    // thread), the sockets and the pool are the parent's. Nothing is joined, closed or freed.
    (void)new std::thread(std::move(server_));
    (void)new std::shared_ptr<ucx::Engine>(std::move(engine_));
    (void)new std::map<std::string, std::shared_ptr<Peer>>(std::move(peers_));
    ConnectionGuard::abandon(guard_);
    abandon_after_fork(ctx_, router_);
    (void)new std::shared_ptr<zap::Admission>(std::move(admission_));
    (void)new std::vector<Hello>(std::move(hellos_));  // the parent's threads
    return;
  }
  stop_.store(true);
  if (server_.joinable()) server_.join();
  join_hellos();
  guard_.reset();  // before the socket (its monitor)
  router_.reset();
  admission_.reset();  // after the socket, before the context: stops its ZAP handler
  {
    std::lock_guard<std::mutex> l(peers_mu_);
    peers_.clear();
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    entries_.clear();  // their memory goes with the pool
    released_locked();
  }
  if (engine_) engine_->close();
  ctx_.close();
}

Status TeConnector::reply_status(const Value& rep, const std::string& ik) {
  const Value* ok = rep.find("ok");
  if (!ok || !ok->is<bool>()) return make_error(Errc::corrupt, "side-channel reply without 'ok'");
  if (ok->as<bool>()) return {};
  const Value* code = rep.find("code");
  const Value* err = rep.find("err");
  return make_error(code && code->is<std::string>() ? errc_from(code->as<std::string>()) : Errc::io,
                    "sender, for '" + ik + "': " + (err && err->is<std::string>() ? err->as<std::string>() : "failed"));
}

Result<std::string> TeConnector::sender_endpoint(const Value* md, const std::string& key, const std::string& what,
                                                 uint64_t* size, bool* have_size, uint64_t* cap) {
  std::string host;
  uint64_t port = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    host = o_.sender_host;
    port = uint64_t(o_.sender_port);
  }
  if (md && md->is<Value::Map>()) {
    const Value* m = md;
    if (!key.empty() && m->as<Value::Map>().size() == 1 && m->find(key)) m = m->find(key);  // {key: metadata}
    const Value *h = m->find("source_host"), *pt = m->find("source_port"), *ds = m->find("data_size");
    if (h && pt) {
      uint64_t sz = 0;
      if (!h->is<std::string>() || !pt->get_u64(port) || port > 65535 || (ds && !ds->get_u64(sz)))
        return make_error(Errc::corrupt, "transfer-engine metadata: source_host must be a string, source_port a "
                                         "port, data_size a size");
      host = h->as<std::string>();
      if (const Value* c = m->find("cap"); c && cap && !c->get_u64(*cap))
        return make_error(Errc::corrupt, "transfer-engine metadata: cap must be an integer");
      if (size) *size = sz;
      if (have_size) *have_size = ds != nullptr;
    }
  }
  if (host.empty() || port == 0)
    return make_error(Errc::not_found, what + " needs the put's metadata (source_host, source_port) "
                                              "or the sender's address (update_sender_info / extra sender_host, "
                                              "sender_zmq_port)");
  return "tcp://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Result<Value> TeConnector::call(const std::string& peer, Value::Map req, double timeout_s) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard<std::mutex> l(peers_mu_);
    if (closed_) return make_error(Errc::closed, name_ + " is closed");
    auto& slot = peers_[peer];
    if (!slot) {
      slot = std::make_shared<Peer>(ctx_);
      slot->sock.set(zmq::sockopt::linger, 0);
      slot->sock.set(zmq::sockopt::maxmsgsize, int64_t(kSideChannelMaxReply));  // an inline payload at most
      if (o_.curve) SL_TRY(zap::connect_as(slot->sock, o_.curve->client));
      slot->sock.connect(peer);
    }
    p = slot;
  }
  std::lock_guard<std::mutex> l(p->mu);
  const uint64_t id = p->next_id++;
  req.emplace_back("rq", id);
  const auto bytes = value_to_msgpack(Value(std::move(req)));
  try {
    if (!p->sock.send(zmq::const_buffer(bytes.data(), bytes.size()), zmq::send_flags::dontwait))
      return make_error(Errc::timeout, "side channel to " + peer + " is not accepting requests");
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0)
        return make_error(Errc::timeout, "no reply from the sender at " + peer + " within " + std::to_string(timeout_s) + " s");
      zmq::pollitem_t it{p->sock.handle(), 0, ZMQ_POLLIN, 0};
      poll_through_signals(&it, 1, left);
      if (!(it.revents & ZMQ_POLLIN)) continue;
      zmq::message_t m;
      if (!p->sock.recv(m, zmq::recv_flags::dontwait)) continue;
      auto v = value_from_msgpack(std::span<const std::byte>(static_cast<const std::byte*>(m.data()), m.size()));
      if (!v.ok() || !v->is<Value::Map>()) return make_error(Errc::corrupt, "malformed side-channel reply from " + peer);
      uint64_t got = 0;
      const Value* rq = v->find("rq");
      if (!rq || !rq->get_u64(got) || got != id) continue;  // a late reply to an earlier request
      return std::move(v).value();
    }
  } catch (const zmq::error_t& e) {
    return make_error(Errc::io, "side channel to " + peer + ": " + e.what());
  }
}

void TeConnector::send_hello_replies() {
  uint64_t n;
  if (::read(hello_efd_, &n, sizeof n) < 0) {
  }
  std::vector<std::pair<std::string, std::vector<std::byte>>> out;
  {
    std::lock_guard<std::mutex> l(hello_mu_);
    out.swap(hello_replies_);
    reap_hellos_locked();
  }
  for (auto& [id, bytes] : out) {
    router_->send(zmq::const_buffer(id.data(), id.size()), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    router_->send(zmq::const_buffer(bytes.data(), bytes.size()), zmq::send_flags::dontwait);
  }
}

void TeConnector::sweep_locked() {
  const uint64_t ttl = uint64_t(o_.ttl_s * 1e9), now = mono_ns();
  if (!ttl) return;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.in_flight == 0 && now - it->second.created_ns > ttl) {
      SL_LOG_WARN("%s: put '%s' unclaimed after %.0f s (ttl_s): freed", name_.c_str(), it->first.c_str(), o_.ttl_s);
      engine_->free(it->second.offset, it->second.size);
      it = entries_.erase(it);
      released_locked();
    } else {
      ++it;
    }
  }
}

}  // namespace te

Result<std::unique_ptr<Connector>> make_te_connector(const std::string& name, const Value& extra) {
  SL_ASSIGN(te::TeOptions o, te::te_options(extra));
  auto c = std::make_unique<te::TeConnector>(std::move(o));
  SL_TRY(c->init(name));
  return std::unique_ptr<Connector>(std::move(c));
}

ConnectorDescriptor te_connector_descriptor() {
  ConnectorDescriptor d;
  d.name = "TransferEngineConnector";
  d.aliases = {"MooncakeTransferEngineConnector"};  // vLLM-Omni's name for the seed's
  d.schema = &te::kTeSchema;
  d.traits = uint32_t(ConnectorTrait::side_channel);
  d.factory = make_te_connector;
  d.check = [](const Value& extra) -> Status {
    SL_TRY(te::te_options(extra));
    return {};
  };
  d.doc = "between hosts over UCX (TCP or RDMA) from a registered pool; a ZeroMQ side channel per sender";
  return d;
}

}  // namespace stagelink
