// TransferEngineConnector, the sender's side channel (te_impl.hpp): a ROUTER answering queries and
// pulls, connect-backs for receivers' engines, and the tokens that let a receiver's UCX pulls in.
#include "connectors/te_impl.hpp"

#include <sys/random.h>

namespace stagelink::te {

void TeConnector::serve() {
  pthread_setname_np(pthread_self(), "sl-te-side");
  while (!stop_.load()) {
    zmq::pollitem_t its[2] = {{router_->handle(), 0, ZMQ_POLLIN, 0}, {nullptr, hello_efd_, ZMQ_POLLIN, 0}};
    try {
      poll_through_signals(its, 2, std::chrono::milliseconds(100));
      if (its[1].revents & ZMQ_POLLIN) send_hello_replies();
      if (!(its[0].revents & ZMQ_POLLIN)) {
        std::lock_guard<std::mutex> l(mu_);
        sweep_locked();
        continue;
      }
      zmq::message_t ident, body;
      if (!router_->recv(ident, zmq::recv_flags::dontwait)) continue;
      if (!ident.more() || !router_->recv(body, zmq::recv_flags::dontwait)) continue;
      while (body.more()) {  // not ours: drain
        zmq::message_t rest;
        if (!router_->recv(rest, zmq::recv_flags::dontwait)) break;
        body = std::move(rest);
      }
      const std::span<const std::byte> req(static_cast<const std::byte*>(body.data()), body.size());
      if (start_hello(ident, req)) continue;  // answered later, from another thread's result
      Value rep = handle(req);
      const auto bytes = value_to_msgpack(rep);
      router_->send(ident, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router_->send(zmq::const_buffer(bytes.data(), bytes.size()), zmq::send_flags::dontwait);
    } catch (const zmq::error_t& e) {
      if (stop_.load()) return;
      SL_LOG_WARN("%s side channel: %s", name_.c_str(), e.what());
    }
  }
}

bool TeConnector::start_hello(zmq::message_t& ident, std::span<const std::byte> req) {
  auto v = value_from_msgpack(req);
  const Value* op = v.ok() && v->is<Value::Map>() ? v->find("op") : nullptr;
  if (!op || !op->is<std::string>() || op->as<std::string>() != "hello") return false;
  std::lock_guard<std::mutex> l(hello_mu_);
  reap_hellos_locked();
  Value rep;
  if (hellos_.size() >= kMaxHellos) {
    uint64_t rq = 0;
    if (const Value* r = v->find("rq")) r->get_u64(rq);
    rep = fail(Errc::exhausted, "the sender is connecting back to " + std::to_string(kMaxHellos) +
                                    " receivers already; try again", rq);
  }
  auto id = std::make_shared<std::string>(static_cast<const char*>(ident.data()), ident.size());
  if (!rep.is_nil()) {
    hello_replies_.emplace_back(*id, value_to_msgpack(rep));
    signal_hello();
    return true;
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::vector<std::byte> copy(req.begin(), req.end());
  hellos_.push_back({std::thread([this, id, done, copy = std::move(copy)] {
                       Value r = handle(copy);  // the connect-back, with its own deadline
                       {
                         std::lock_guard<std::mutex> g(hello_mu_);
                         hello_replies_.emplace_back(*id, value_to_msgpack(r));
                       }
                       signal_hello();
                       done->store(true);
                     }),
                     done});
  return true;
}

void TeConnector::reap_hellos_locked() {
  for (auto it = hellos_.begin(); it != hellos_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = hellos_.erase(it);
    } else {
      ++it;
    }
  }
}

void TeConnector::join_hellos() {
  std::vector<Hello> all;
  {
    std::lock_guard<std::mutex> l(hello_mu_);
    all.swap(hellos_);
  }
  for (auto& h : all) h.thread.join();  // each bounded by its connect's deadline
}

Value TeConnector::fail(Errc c, const std::string& msg, uint64_t rq) {
  Value::Map m;
  m.emplace_back("ok", false);
  m.emplace_back("code", errc_str(c));
  m.emplace_back("err", msg);
  m.emplace_back("rq", rq);
  return Value(std::move(m));
}

Value TeConnector::handle(std::span<const std::byte> bytes) {
  auto v = value_from_msgpack(bytes);
  uint64_t rq = 0;
  if (!v.ok() || !v->is<Value::Map>()) {
    errors_.fetch_add(1);
    return fail(Errc::corrupt, "malformed request", 0);
  }
  if (const Value* r = v->find("rq")) r->get_u64(rq);
  const Value *op = v->find("op"), *key = v->find("key");
  if (!op || !op->is<std::string>() || !key || !key->is<std::string>())
    return fail(Errc::corrupt, "request without op/key", rq);
  const std::string& ik = key->as<std::string>();
  if (op->as<std::string>() == "hello") {  // a receiver's connect
    const Value* w = v->find("worker");
    if (!w || !w->is<Value::Bytes>() || w->as<Value::Bytes>().empty())
      return fail(Errc::corrupt, "hello without the receiver's worker address", rq);
    Status st = engine_->connect(w->as<Value::Bytes>(), 0, deadline_after(o_.timeout_s));
    if (!st.ok()) return fail(st.error().code, "connecting back to the receiver: " + st.error().message, rq);
    Value::Map m;
    m.emplace_back("ok", true);
    m.emplace_back("rq", rq);
    m.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
    m.emplace_back("auth", issue_auth(w->as<Value::Bytes>()));
    return Value(std::move(m));
  }
  if (op->as<std::string>() == "query") {
    std::lock_guard<std::mutex> l(mu_);
    auto it = entries_.find(ik);
    if (it == entries_.end() || it->second.readers_left == 0)
      return fail(Errc::not_found, "no put of '" + ik + "' here", rq);
    if (Status st = admit(it->second, *v, ik); !st.ok()) return fail(st.error().code, st.error().message, rq);
    Value::Map m;
    m.emplace_back("ok", true);
    m.emplace_back("size", uint64_t(it->second.size));
    m.emplace_back("fast", it->second.fast);
    m.emplace_back("rq", rq);
    m.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
    return Value(std::move(m));
  }
  if (op->as<std::string>() != "pull") return fail(Errc::invalid_argument, "unknown op", rq);
  // The receiver names its engine and a token; the payload goes back as an active message that
  // its engine lands in the region it set aside. No address of the receiver's memory is ever
  // taken from a request: a remote write (RMA) to an address a message named was the older
  // path, removed (a request naming the sender's own engine made it write into itself).
  uint64_t len = 0, token = 0;
  const Value *n = v->find("len"), *w = v->find("worker"), *tk = v->find("token");
  if (!n || !n->get_u64(len) || !w || !w->is<Value::Bytes>() || w->as<Value::Bytes>().empty() || !tk ||
      !tk->get_u64(token))
    return fail(Errc::corrupt, "pull request without len/worker/token", rq);
  uint64_t inline_max = 0;
  if (const Value* im = v->find("inline_max")) im->get_u64(inline_max);
  Entry e;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = entries_.find(ik);
    // A reader is counted when its pull is accepted (given back if the transfer fails): a put
    // for N readers is never read by N + 1.
    if (it == entries_.end() || it->second.readers_left == 0)
      return fail(Errc::not_found, "no put of '" + ik + "' here", rq);
    if (Status st = admit(it->second, *v, ik); !st.ok()) return fail(st.error().code, st.error().message, rq);
    if (it->second.size <= std::min<uint64_t>(inline_max, kInlineMax)) {
      // Small: the bytes go back in the reply (one round trip, no UCX write to wait for).
      Value::Map m;
      m.emplace_back("ok", true);
      m.emplace_back("rq", rq);
      m.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
      m.emplace_back("auth", issue_auth_locked(w->as<Value::Bytes>()));
      m.emplace_back("data", Value::copy_bytes(std::span<const std::byte>(engine_->pool_base() + it->second.offset,
                                                                          it->second.size)));
      if (--it->second.readers_left == 0 && it->second.in_flight == 0) {
        engine_->free(it->second.offset, it->second.size);
        entries_.erase(it);
        released_locked();
      }
      pulls_.fetch_add(1);
      return Value(std::move(m));
    }
    if (len < it->second.size)
      return fail(Errc::invalid_argument, "destination of " + std::to_string(len) + " bytes for a payload of " +
                                              std::to_string(it->second.size), rq);
    --it->second.readers_left;
    ++it->second.in_flight;
    e = it->second;
  }
  const std::span<const std::byte> src(engine_->pool_base() + e.offset, e.size);
  const Deadline dl = deadline_after(timeout_for(o_.timeout_s, e.size));
  Status st = engine_->send(w->as<Value::Bytes>(), token, src, dl);
  end_pull(ik, st);
  if (!st.ok()) return fail(st.error().code, st.error().message, rq);
  Value::Map m;
  m.emplace_back("ok", true);
  m.emplace_back("rq", rq);
  m.emplace_back("am", true);
  m.emplace_back("worker", Value::copy_bytes(engine_->worker_address()));
  m.emplace_back("auth", issue_auth(w->as<Value::Bytes>()));
  return Value(std::move(m));
}

void TeConnector::end_pull(const std::string& ik, const Status& st) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(ik);
  if (it != entries_.end()) {
    --it->second.in_flight;
    if (!st.ok()) ++it->second.readers_left;
    if (it->second.readers_left == 0 && it->second.in_flight == 0) {
      engine_->free(it->second.offset, it->second.size);
      entries_.erase(it);
      released_locked();
    }
  }
  (st.ok() ? pulls_ : errors_).fetch_add(1);
  release_cv_.notify_all();  // a put waiting for this key's transfer to end
}

void TeConnector::serve_am_pull(std::span<const std::byte> bytes) {
  auto v = value_from_msgpack(bytes);
  const Value *k = v.ok() ? v->find("key") : nullptr, *n = v.ok() ? v->find("len") : nullptr,
              *t = v.ok() ? v->find("token") : nullptr, *w = v.ok() ? v->find("worker") : nullptr;
  uint64_t len = 0, token = 0;
  if (!k || !k->is<std::string>() || !n || !n->get_u64(len) || !t || !t->get_u64(token) || !w ||
      !w->is<Value::Bytes>() || w->as<Value::Bytes>().empty()) {
    errors_.fetch_add(1);
    // Answered only to a receiver engine the side channel met: an address from the message
    // itself is never dialled (it would let anyone aim this engine at any address).
    if (t && t->get_u64(token) && w && w->is<Value::Bytes>() && known_worker(w->as<Value::Bytes>()))
      engine_->send_error(w->as<Value::Bytes>(), token, make_error(Errc::corrupt, "malformed pull request"));
    return;
  }
  const std::string& ik = k->as<std::string>();
  const auto& worker = w->as<Value::Bytes>();
  std::span<const std::byte> src;
  {
    std::lock_guard<std::mutex> l(mu_);
    // Served only to a receiver the side channel (CURVE-authenticated where configured) met:
    // the token it issued that receiver's engine. Nothing is counted as read before that.
    uint64_t auth = 0;
    const Value* a = v->find("auth");
    auto issued = auth_by_worker_.find(std::vector<std::byte>(worker.begin(), worker.end()));
    if (!a || !a->get_u64(auth) || issued == auth_by_worker_.end() || issued->second != auth) {
      errors_.fetch_add(1);
      refused_pulls_.fetch_add(1);
      if (issued == auth_by_worker_.end()) return;  // an engine the side channel never met: dropped, unanswered
      return engine_->send_error(worker, token, make_error(Errc::permission_denied,
                                                           "a pull over UCX without a token this sender's side "
                                                           "channel issued to that receiver"));
    }
    auto it = entries_.find(ik);
    if (it == entries_.end() || it->second.readers_left == 0)
      return engine_->send_error(worker, token, make_error(Errc::not_found, "no put of '" + ik + "' here"));
    if (Status st = admit(it->second, *v, ik); !st.ok()) return engine_->send_error(worker, token, std::move(st).error());
    if (len != it->second.size)
      return engine_->send_error(worker, token, make_error(Errc::invalid_argument,
                                                           "destination of " + std::to_string(len) +
                                                               " bytes for a payload of " + std::to_string(it->second.size)));
    --it->second.readers_left;
    ++it->second.in_flight;
    src = {engine_->pool_base() + it->second.offset, it->second.size};
  }
  engine_->send_async(worker, token, src, deadline_after(timeout_for(o_.timeout_s, src.size())),
                      [this, ik](Status st) { end_pull(ik, st); });
}

Status TeConnector::admit(const Entry& e, const Value& req, const std::string& ik) {
  const Value* c = req.find("cap");
  uint64_t cap = 0;
  if (c && c->get_u64(cap) && cap == e.cap) return {};
  if (c) return make_error(Errc::not_found, "no put of '" + ik + "' here");  // another (replaced) put's, or forged
  if (o_.curve || o_.serve_by_key) return {};
  refused_pulls_.fetch_add(1);
  return make_error(Errc::permission_denied,
                    "a get of '" + ik + "' without the put's metadata: this sender gives a put only to a get naming "
                    "its metadata (which the caller carries), unless its side channel has extra.curve or "
                    "extra.serve_by_key (SECURITY.md)");
}

uint64_t TeConnector::new_capability() {  // the kernel's random bits: unpredictable from others seen
  uint64_t v = 0;
  if (::getrandom(&v, sizeof v, 0) != ssize_t(sizeof v)) {
    std::random_device rd;
    v = uint64_t(rd()) << 32 | rd();
  }
  return v | 1;  // never 0 (none)
}

uint64_t TeConnector::issue_auth_locked(const Value::Bytes& worker) {
  std::vector<std::byte> key(worker.begin(), worker.end());
  if (auto it = auth_by_worker_.find(key); it != auth_by_worker_.end()) return it->second;
  static constexpr size_t kMaxAuth = 4096;
  if (auth_order_.size() >= kMaxAuth) {
    auth_by_worker_.erase(auth_order_.front());
    auth_order_.pop_front();
  }
  std::random_device rd;
  const uint64_t t = (uint64_t(rd()) << 32 | rd()) | 1;  // never 0 (no token)
  auth_by_worker_.emplace(key, t);
  auth_order_.push_back(std::move(key));
  return t;
}

}  // namespace stagelink::te
