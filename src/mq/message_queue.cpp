// MessageQueue façade: frames over the shared-memory ring for local readers, ZeroMQ XPUB/SUB for
// remote ones, an overflow area for messages larger than a chunk. The writer is here; the readers
// are mq_readers.cpp.
#include "stagelink/mq.hpp"

#include "mq/mq_internal.hpp"
#include "cuda/arena.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <zmq.hpp>

#include "core/log.hpp"
#include "core/msgpack_io.hpp"
#include "core/net.hpp"
#include "core/proc.hpp"
#include "core/zmq_fork.hpp"
#include "core/zmq_guard.hpp"
#include "core/zap.hpp"
#include "core/zmq_util.hpp"
#include "shm/ring.hpp"
#include "stagelink/allocator.hpp"
#include "stagelink/metrics.hpp"
#include "stagelink/shm.hpp"

namespace stagelink {

namespace {
std::atomic<uint32_t> g_mq_counter{0};

using metrics::Family;
using metrics::Kind;
const Family kMqMessages{"stagelink_mq_messages_total", Kind::counter, "", "messages a queue's writer enqueued",
                         {"queue"}};
const Family kMqBytes{"stagelink_mq_bytes_total", Kind::counter, "bytes", "frame bytes a queue's writer enqueued",
                      {"queue"}};
const Family kMqDepth{"stagelink_mq_depth", Kind::gauge, "",
                      "messages enqueued that the slowest attached local reader has not read yet", {"queue"}};
const Family kMqLag{"stagelink_mq_reader_lag", Kind::gauge, "",
                    "messages enqueued that this local reader (its rank) has not read yet", {"queue", "reader"}};
}  // namespace

// ---- handle ----
std::vector<std::byte> MessageQueueHandle::to_msgpack() const {
  Value::Map m;
  m.emplace_back("v", uint64_t(1));
  m.emplace_back("dir", shm_dir);
  m.emplace_back("ring", ring_name);
  m.emplace_back("ovf", overflow_name);
  Value::List ranks;
  for (auto r : local_reader_ranks) ranks.emplace_back(uint64_t(r));
  m.emplace_back("ranks", Value(std::move(ranks)));
  m.emplace_back("n", uint64_t(n_reader));
  m.emplace_back("remote", remote_addr);
  m.emplace_back("spin", uint64_t(spin_us));
  m.emplace_back("cb", chunk_bytes);
  m.emplace_back("mc", uint64_t(max_chunks));
  if (!server_key.empty()) m.emplace_back("sk", server_key);
  if (reader_keys) {
    m.emplace_back("rp", reader_keys->public_key);
    m.emplace_back("rs", reader_keys->secret_key);
  }
  return value_to_msgpack(Value(std::move(m)));
}

Result<MessageQueueHandle> MessageQueueHandle::from_msgpack(std::span<const std::byte> bytes) {
  SL_ASSIGN(Value v, value_from_msgpack(bytes));
  auto bad = [](const char* why) { return make_error(Errc::invalid_argument, std::string("bad message queue handle: ") + why); };
  uint64_t ver = 0, n = 0, spin = 0;
  const Value* f;
  if (!(f = v.find("v")) || !f->get_u64(ver) || ver != 1) return bad("version");
  MessageQueueHandle h;
  auto str = [&](const char* k, std::string& out) {
    const Value* x = v.find(k);
    if (!x || !x->is<std::string>()) return false;
    out = x->as<std::string>();
    return true;
  };
  if (!str("dir", h.shm_dir) || !str("ring", h.ring_name) || !str("ovf", h.overflow_name) || !str("remote", h.remote_addr))
    return bad("missing fields");
  for (auto* s : {&h.shm_dir, &h.ring_name, &h.overflow_name, &h.remote_addr})
    if (!is_utf8(*s)) return bad("a field that is not UTF-8");
  if (!(f = v.find("n")) || !f->get_u64(n) || n == 0 || n > 4096) return bad("n_reader");
  if (!(f = v.find("spin")) || !f->get_u64(spin) || spin > 10'000'000) return bad("spin");
  h.n_reader = uint32_t(n);
  h.spin_us = spin;
  uint64_t cb = 0, mc = 0;
  if ((f = v.find("cb"))) f->get_u64(cb);
  if ((f = v.find("mc")) && f->get_u64(mc) && mc <= shm::kRingMaxChunks) h.max_chunks = uint32_t(mc);
  h.chunk_bytes = cb;
  // A CURVE key: 40 Z85 characters (printable ASCII, no space, quote or backslash).
  auto key = [](const Value* k) {
    if (!k || !k->is<std::string>() || k->as<std::string>().size() != 40) return false;
    for (char c : k->as<std::string>())
      if (c < '!' || c > '}' || std::strchr("\"',;\\_`|", c)) return false;
    return true;
  };
  if ((f = v.find("sk"))) {
    if (!key(f)) return bad("server_key");
    h.server_key = f->as<std::string>();
  }
  const Value *rp = v.find("rp"), *rs = v.find("rs");
  if (rp || rs) {
    if (!key(rp) || !key(rs) || h.server_key.empty()) return bad("reader keys");
    h.reader_keys = CurveKeyPair{rp->as<std::string>(), rs->as<std::string>()};
  }
  f = v.find("ranks");
  if (!f || !f->is<Value::List>()) return bad("ranks");
  for (auto& r : f->as<Value::List>()) {
    uint64_t x;
    if (!r.get_u64(x) || x > UINT32_MAX) return bad("rank out of range");
    h.local_reader_ranks.push_back(uint32_t(x));
  }
  if (h.shm_dir.empty() || h.shm_dir[0] != '/') return bad("shm_dir");
  for (auto* name : {&h.ring_name, &h.overflow_name})
    if (!name->empty() && (name->size() > kMaxSegName || name->rfind(shm::user_prefix(), 0) != 0 ||
                           name->find('/') != std::string::npos))
      return bad("segment name outside this user's prefix");
  if (!h.local_reader_ranks.empty() && h.ring_name.empty()) return bad("local readers without a ring");
  return h;
}

Status MessageQueue::enqueue_bytes(std::span<const std::byte> bytes, double timeout_s) {
  Payload p;
  p.tree = Value(TensorRef{0});
  p.tensors.push_back(Tensor::view_of(bytes));
  return enqueue(p, timeout_s);
}

Status MessageQueue::enqueue_held(const Payload&, double, std::shared_ptr<const void>) {
  return make_error(Errc::invalid_argument, "this side of the message queue keeps no device slots");
}

// ---- writer ----
class MqWriter final : public MessageQueue, private metrics::Source {
 public:
  explicit MqWriter(MessageQueueOptions o) : o_(std::move(o)) {}
  ~MqWriter() override { close(); }

  Status init() {
    if (o_.n_reader == 0) return make_error(Errc::invalid_argument, "n_reader must be at least 1");
    if (o_.n_local_reader > o_.n_reader)
      return make_error(Errc::invalid_argument, "n_local_reader (" + std::to_string(o_.n_local_reader) +
                                                    ") exceeds n_reader (" + std::to_string(o_.n_reader) + ")");
    if (o_.n_local_reader > shm::kRingMaxReaders)
      return make_error(Errc::invalid_argument, "at most 64 local readers");
    if (o_.local_reader_ranks.empty())
      for (uint32_t r = 0; r < o_.n_local_reader; ++r) o_.local_reader_ranks.push_back(r);
    if (o_.local_reader_ranks.size() != o_.n_local_reader)
      return make_error(Errc::invalid_argument, "local_reader_ranks must list n_local_reader ranks");
    std::set<uint32_t> seen;
    for (auto r : o_.local_reader_ranks)
      if (!seen.insert(r).second) return make_error(Errc::invalid_argument, "local_reader_ranks must be distinct");
    n_remote_ = o_.n_reader - o_.n_local_reader;
    const std::string base = shm::user_prefix() + "mq.";
    const uint32_t id = g_mq_counter.fetch_add(1);
    // 32 random bits in every name: another user cannot create one of them first (a squatted
    // name would fail the queue's creation; opening one is refused anyway: not ours).
    char rnd[12];
    std::snprintf(rnd, sizeof rnd, "-%08x", unsigned(std::random_device{}()));
    tag_ = std::to_string(getpid()) + "." + std::to_string(id) + rnd;
    if (o_.n_local_reader) {
      shm::RingOptions ro;
      ro.n_readers = o_.n_local_reader;
      ro.max_chunks = o_.max_chunks;
      ro.chunk_bytes = o_.max_chunk_bytes;
      ro.spin_ns = o_.spin_us * 1000;
      SL_ASSIGN(ring_, Ring::create(o_.shm_dir, base + "q" + tag_, ro));
      ring_->set_rank_names(o_.local_reader_ranks);
      ring_named_ = true;
      if (o_.overflow_bytes) {
        ovf_name_ = base + "o" + tag_;
        auto seg = Segment::create(o_.shm_dir, ovf_name_, o_.overflow_bytes, true);  // pre-faulted
        if (!seg.ok()) {
          Segment::unlink(o_.shm_dir, ring_->name());
          return std::move(seg).error();
        }
        ovf_ = seg.value();
        ovf_alloc_ = std::make_unique<BufferAllocator>(o_.overflow_bytes, 64);
      }
    }
    if (n_remote_) {
      try {
        pub_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::xpub);
        pub_->set(zmq::sockopt::xpub_verbose, 1);
        pub_->set(zmq::sockopt::xpub_nodrop, 1);
        pub_->set(zmq::sockopt::sndhwm, o_.remote_hwm);
        // What it receives: (un)subscriptions, and the handshake's commands (CURVE's INITIATE is ~300 B).
        pub_->set(zmq::sockopt::maxmsgsize, int64_t(4096));
        auto guard = ConnectionGuard::attach(ctx_, *pub_, kRemoteMaxConnections);
        if (!guard.ok()) {
          close();
          return std::move(guard).error();
        }
        guard_ = std::move(guard).value();
        if (!o_.curve) {
          // Safe by default (vLLM's callers never pass keys): a server key pair and one reader
          // key pair made here; the handle carries the reader's, so only holders of the handle
          // (which the caller's own channel carries) can subscribe.
          auto server = curve_keypair(), reader = curve_keypair();
          if (!server.ok() || !reader.ok()) {
            close();
            return std::move(server.ok() ? reader : server).error();
          }
          o_.curve = CurveServer{server.value(), {reader->public_key}};
          handle_reader_keys_ = reader.value();
        }
        if (o_.curve) {
          auto adm = zap::serve(ctx_, *pub_, *o_.curve);
          if (!adm.ok()) {
            close();
            return std::move(adm).error();
          }
          admission_ = std::move(adm).value();
        }
        pub_->set(zmq::sockopt::linger, 5000);  // bounded: close() waits at most 5 s to flush
        const std::string port = o_.remote_port ? std::to_string(o_.remote_port) : std::string("*");
        if (o_.connect_ip.empty()) {  // this host's address (not every interface), as advertised
          const std::string host = net::host_address();
          const bool v6 = host.find(':') != std::string::npos;
          if (v6) pub_->set(zmq::sockopt::ipv6, 1);
          pub_->bind("tcp://" + (v6 ? "[" + host + "]" : host) + ":" + port);
          remote_addr_ = pub_->get(zmq::sockopt::last_endpoint);
        } else {
          pub_->bind("tcp://" + o_.connect_ip + ":" + port);
          remote_addr_ = pub_->get(zmq::sockopt::last_endpoint);
        }
      } catch (const zmq::error_t& e) {
        close();
        return make_error(Errc::io, std::string("binding the remote-reader socket on ") +
                                        (o_.connect_ip.empty() ? net::host_address() : o_.connect_ip) + ": " + e.what());
      }
    }
    return {};
  }

  MessageQueueHandle export_handle() const override {
    MessageQueueHandle h;
    h.shm_dir = o_.shm_dir;
    h.ring_name = ring_ ? ring_->name() : "";
    h.overflow_name = ovf_name_;
    h.local_reader_ranks = o_.local_reader_ranks;
    h.n_reader = o_.n_reader;
    h.remote_addr = remote_addr_;
    h.spin_us = o_.spin_us;
    h.chunk_bytes = o_.max_chunk_bytes;
    h.max_chunks = o_.max_chunks;
    if (o_.curve && pub_) h.server_key = o_.curve->keys.public_key;
    if (handle_reader_keys_ && pub_) h.reader_keys = *handle_reader_keys_;
    return h;
  }
  bool is_writer() const override { return true; }
  int64_t rank() const override { return 0; }
  bool shutting_down() const override { return shutdown_flag_.load() || (ring_ && ring_->is_shutdown()); }

  Status wait_until_ready(double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return make_error(Errc::closed, "message queue is closed");
    const uint64_t dl = deadline_from(timeout_s);
    for (;;) {
      if (pub_) drain_subscriptions(0);
      const bool local_ok = !ring_ || ring_->attached_count() == o_.n_local_reader;
      const bool remote_ok = remote_seen_.size() >= n_remote_;
      if (local_ok && remote_ok) break;
      if (shutdown_flag_.load()) return make_error(Errc::cancelled, kShutDown);
      if (dl && mono_ns() >= dl) {
        std::vector<uint32_t> missing;
        for (size_t i = 0; i < o_.local_reader_ranks.size(); ++i)
          if (ring_->header().readers[i].state.load() == shm::kReaderAbsent) missing.push_back(o_.local_reader_ranks[i]);
        std::string what;
        if (!missing.empty()) what = "readers not connected: local ranks " + ranks_str(missing);
        if (remote_seen_.size() < n_remote_)
          what += (what.empty() ? "" : "; ") + std::to_string(n_remote_ - remote_seen_.size()) + " of " +
                  std::to_string(n_remote_) + " remote readers not subscribed to " + remote_addr_;
        return make_error(Errc::timeout, "message queue not ready after " + std::to_string(timeout_s) + " s: " + what);
      }
      if (!local_ok) {
        const uint32_t seen = ring_->header().attach_seq.load();
        if (ring_->attached_count() != o_.n_local_reader) ring_->wait_attach(seen, remote_ok ? dl : mono_ns() + 10'000'000);
      } else {
        drain_subscriptions(100);  // remote: block in zmq_poll for up to 100 ms
      }
    }
    // Everyone is in: take the names out of /dev/shm (the mappings live on).
    unlink_names();
    return {};
  }

  // Local readers only: a remote reader could not map the device slots a record names.
  size_t device_slots() const override { return ring_ && !pub_ && o_.n_reader == o_.n_local_reader ? cuda::kDefaultArenaBytes : 0; }

  Status enqueue_held(const Payload& p, double timeout_s, std::shared_ptr<const void> hold) override {
    if (!device_slots()) return MessageQueue::enqueue_held(p, timeout_s, std::move(hold));
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t seq = ring_->next_seq();  // the message enqueue_locked writes
    SL_TRY(enqueue_locked(p, timeout_s));
    if (hold) held_.emplace_back(seq, std::move(hold));
    return {};
  }

  Status enqueue(const Payload& p, double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    return enqueue_locked(p, timeout_s);
  }

  Status enqueue_locked(const Payload& p, double timeout_s) {
    if (closed_) return make_error(Errc::closed, "enqueue on a closed message queue");
    if (shutdown_flag_.load()) return make_error(Errc::cancelled, kShutDown);
    // The plan is kept from one message to the next: a message laid out as the one before (byte
    // messages of one size, tensors of one shape) is not planned again, and any other reuses its
    // buffers instead of allocating them.
    SL_TRY(plan_frame_into(plan_, p));
    const FramePlan& plan = plan_;
    const uint64_t dl = deadline_from(timeout_s);
    std::span<const std::byte> written;  // the frame as written to shared memory (for remote)
    if (ring_) {
      reclaim();
      if (plan.total <= ring_->chunk_bytes()) {
        SL_ASSIGN(RingChunk * c, acquire(dl));
        std::byte* dst = ring_->data(c);
        write_frame(plan, p.tensors, dst);
        written = {dst, plan.total};
        ring_->publish(c, plan.total, shm::kInline, 0);
      } else {
        SL_TRY(enqueue_large(plan, p, dl, written));
      }
    }
    // The message's number is spent once the message reached anyone: if the remote send fails
    // after the local readers got it, the remote readers see the gap (corrupt) instead of
    // silently missing a message their local peers have.
    const uint64_t seq = seq_;
    if (ring_) ++seq_;
    bytes_ += plan.total;
    m_messages_.add();
    m_bytes_.add(plan.total);
    if (pub_) {
      if (written.empty()) {
        scratch_.resize(plan.total);
        write_frame(plan, p.tensors, scratch_.data());
        written = {scratch_.data(), scratch_.size()};
      }
      SL_TRY(send_remote(seq, written, dl, bool(ring_)));
      if (!ring_) ++seq_;
    }
    return {};
  }

  Result<Message> dequeue(double) override {
    return make_error(Errc::invalid_argument, "dequeue on the writer side of a message queue");
  }
  Status dequeue_with(double, const std::function<void(std::span<const std::byte>)>&) override {
    return make_error(Errc::invalid_argument, "dequeue on the writer side of a message queue");
  }
  Result<bool> wait_message(double) override {
    return make_error(Errc::invalid_argument, "wait_message on the writer side of a message queue");
  }

  // No lock: the ring's reader state is atomic, and another thread may call this while enqueue blocks.
  Status drop_reader(uint32_t rank) override {
    for (size_t i = 0; i < o_.local_reader_ranks.size(); ++i)
      if (o_.local_reader_ranks[i] == rank && ring_) return ring_->drop_reader(uint32_t(i), "drop_reader()");
    return make_error(Errc::invalid_argument, "rank " + std::to_string(rank) + " is not a local reader");
  }

  // vLLM's semantics: the writer's own waits end (and its later calls fail) with `cancelled`;
  // readers are told only with `everyone` (close() does that: the queue has ended).
  void shutdown(bool everyone) override {
    shutdown_flag_.store(true);
    // Inherited through fork(): the queue is the parent's; this copy stops, nobody else's does.
    if (fork_.inherited()) everyone = false;
    if (ring_) {
      if (everyone) ring_->shutdown();
      else ring_->cancel_local();
    }
    if (!everyone) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (pub_ && !shutdown_sent_) {
      shutdown_sent_ = true;
      try {
        pub_->set(zmq::sockopt::sndtimeo, 1000);
        pub_->send(zmq::const_buffer(&kShutdownTag, 1), zmq::send_flags::none);
      } catch (const zmq::error_t&) {
      }
    }
  }

  Value stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    Value::Map m;
    m.emplace_back("role", "writer");
    m.emplace_back("messages", uint64_t(seq_));
    m.emplace_back("bytes", uint64_t(bytes_));
    m.emplace_back("overflow_messages", uint64_t(overflow_msgs_));
    m.emplace_back("dedicated_messages", uint64_t(dedicated_msgs_));
    m.emplace_back("local_readers_attached", uint64_t(ring_ ? ring_->attached_count() : 0));
    m.emplace_back("remote_readers_subscribed", uint64_t(remote_seen_.size()));
    if (pub_) {  // remote readers: authenticated (CURVE), and the keys refused
      m.emplace_back("curve", bool(admission_));
      m.emplace_back("refused_peers", uint64_t((admission_ ? admission_->refused() : 0) + (guard_ ? guard_->refused() : 0)));
    }
    m.emplace_back("overflow_used", uint64_t(ovf_alloc_ ? ovf_alloc_->used() : 0));
    if (ring_) m.emplace_back("live_mask", uint64_t(ring_->header().live_mask.load()));
    return Value(std::move(m));
  }

 private:
  struct OutOfLine {
    uint64_t seq;
    size_t offset, length;         // overflow arena
    std::string dedicated;         // or a segment of its own
    std::shared_ptr<Segment> seg;
  };

  Result<RingChunk*> acquire(uint64_t dl) {
    const uint64_t warn_ns = o_.warn_interval_s > 0 ? uint64_t(o_.warn_interval_s * 1e9) : 0;
    return ring_->acquire_write(dl, o_.drop_dead_readers, warn_ns, [&](const std::vector<shm::Laggard>& lag, double waited) {
      SL_LOG_WARN("message queue %s: enqueue of message %llu blocked for %.1f s; waiting for %s", ring_->name().c_str(),
                  static_cast<unsigned long long>(ring_->next_seq()), waited, shm::describe(lag).c_str());
    });
  }

  // Free overflow space and dedicated segments of messages every live reader has read, and the
  // device slots they named.
  void reclaim() {
    while (!held_.empty() && ring_->chunk_done(held_.front().first)) held_.pop_front();
    while (!ool_.empty() && ring_->chunk_done(ool_.front().seq)) {
      auto& r = ool_.front();
      if (!r.dedicated.empty()) Segment::unlink(o_.shm_dir, r.dedicated);
      else if (ovf_alloc_) (void)ovf_alloc_->free(r.offset, r.length);
      ool_.pop_front();
    }
  }

  Status enqueue_large(const FramePlan& plan, const Payload& p, uint64_t dl, std::span<const std::byte>& written) {
    const uint64_t seq = ring_->next_seq();
    if (ovf_alloc_ && plan.total <= ovf_alloc_->capacity()) {
      // Room in the overflow area: wait (kernel sleep) for readers to finish older messages.
      size_t off = 0;
      for (;;) {
        const bool got = ring_->wait_free_until([&] {
          reclaim();
          auto a = ovf_alloc_->allocate(plan.total);
          if (a.ok()) off = *a;
          return a.ok();
        }, dl);
        if (got) break;
        if (ring_->stopping()) return make_error(Errc::cancelled, kShutDown);
        SL_TRY(ring_->handle_dead(ring_->oldest_laggards(), o_.drop_dead_readers));  // a dead reader holds the area
        if (dl && mono_ns() >= dl)
          return make_error(Errc::timeout, "message queue " + ring_->name() + ": no overflow room for a " +
                                               std::to_string(plan.total) + "-byte message; not caught up: " +
                                               shm::describe(ring_->oldest_laggards()));
      }
      auto c = acquire(dl);
      if (!c.ok()) {
        (void)ovf_alloc_->free(off, plan.total);
        return std::move(c).error();
      }
      std::byte* dst = ovf_->data() + off;
      write_frame(plan, p.tensors, dst);
      written = {dst, plan.total};
      ool_.push_back(OutOfLine{seq, off, plan.total, "", nullptr});
      ring_->publish(*c, plan.total, shm::kOverflow, off);
      ++overflow_msgs_;
      return {};
    }
    // Larger than the overflow area: a segment of its own, named in the chunk, unlinked when read.
    const std::string name = shm::user_prefix() + "mq.m" + tag_ + "x" + std::to_string(seq);
    SL_ASSIGN(auto seg, Segment::create(o_.shm_dir, name, plan.total, false));
    write_frame(plan, p.tensors, seg->data());
    auto c = acquire(dl);
    if (!c.ok()) {
      Segment::unlink(o_.shm_dir, name);
      return std::move(c).error();
    }
    std::memcpy(ring_->data(*c), name.c_str(), name.size() + 1);
    written = {seg->data(), plan.total};
    ool_.push_back(OutOfLine{seq, 0, 0, name, seg});
    ring_->publish(*c, plan.total, shm::kDedicated, 0);
    ++dedicated_msgs_;
    return {};
  }

  Status send_remote(uint64_t seq, std::span<const std::byte> frame, uint64_t dl, bool local_got_it) {
    char head[9];
    head[0] = kMsgTag;
    std::memcpy(head + 1, &seq, 8);
    int timeout_ms = -1;
    if (dl) timeout_ms = int(std::max<int64_t>(0, int64_t(dl - std::min(dl, mono_ns())) / 1000000));
    try {
      pub_->set(zmq::sockopt::sndtimeo, timeout_ms);
      if (!pub_->send(zmq::const_buffer(head, sizeof head), zmq::send_flags::sndmore) ||
          !pub_->send(zmq::const_buffer(frame.data(), frame.size()), zmq::send_flags::none))
        return make_error(Errc::timeout, "message queue: remote readers (" + remote_ranks_str() +
                                             ") did not take message " + std::to_string(seq) + " before the timeout (" +
                                             std::to_string(o_.remote_hwm) + " messages queued)" +
                                             (local_got_it ? "; the local readers got it, the remote ones will report the gap" : ""));
    } catch (const zmq::error_t& e) {
      return make_error(Errc::io, std::string("sending to remote readers: ") + e.what());
    }
    return {};
  }

  // Read subscription notices: "\x01\xffR<rank>" (joined) and "\x00\xffR<rank>" (left).
  void drain_subscriptions(int wait_ms) {
    zmq::pollitem_t item{pub_->handle(), 0, ZMQ_POLLIN, 0};
    for (int i = 0;; ++i) {
      if (poll_through_signals(&item, 1, std::chrono::milliseconds(i == 0 ? wait_ms : 0)) <= 0) return;
      zmq::message_t m;
      if (!pub_->recv(m, zmq::recv_flags::dontwait)) return;
      std::string s(static_cast<const char*>(m.data()), m.size());
      if (s.size() < 3 || s[1] != '\xff' || s[2] != 'R') continue;
      const int64_t r = std::strtoll(s.c_str() + 3, nullptr, 10);
      if (s[0] == 1) {
        // A bounded table: a peer that subscribes under ever new topics grows nothing past it.
        if (remote_seen_.size() < 4 * size_t(n_remote_) + 64) remote_seen_[s.substr(1)] = r;
      } else if (remote_seen_.erase(s.substr(1))) {
        // At most once a second: a peer that subscribes and unsubscribes in a loop cannot flood the log.
        const uint64_t now = mono_ns();
        if (now - last_leave_log_ns_ > 1'000'000'000ull) {
          last_leave_log_ns_ = now;
          SL_LOG_WARN("message queue: remote reader rank %lld disconnected", static_cast<long long>(r));
        }
      }
    }
  }

  void unlink_names() {
    if (ring_named_) {
      Segment::unlink(o_.shm_dir, ring_->name());
      if (!ovf_name_.empty()) Segment::unlink(o_.shm_dir, ovf_name_);
      ring_named_ = false;
    }
  }

  void close() {
    reg_.reset();  // out of the metrics tree before anything it reads goes
    if (fork_.inherited()) {
      // Inherited through fork(): the queue is the parent's, which goes on writing. Nothing shared
      // is touched (no shutdown, no unlink); the socket is the parent's too, and is left as it is.
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      closed_ = true;
      ool_.clear();
      ConnectionGuard::abandon(guard_);
      abandon_after_fork(ctx_, pub_);
      (void)new std::shared_ptr<zap::Admission>(std::move(admission_));
      return;
    }
    shutdown(true);
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    // Device slots of messages a reader may still read: never reused (kept until the process exits).
    if (ring_) reclaim();
    for (auto& h : held_) cuda::keep_until_exit(std::move(h.second));
    held_.clear();
    if (ring_) unlink_names();
    for (auto& r : ool_)
      if (!r.dedicated.empty()) Segment::unlink(o_.shm_dir, r.dedicated);
    ool_.clear();
    guard_.reset();  // before the socket (its monitor)
    pub_.reset();
    admission_.reset();  // after the socket, before the context
    ctx_.close();
  }

  MessageQueueOptions o_;
  std::mutex mu_;
  bool closed_ = false, shutdown_sent_ = false, ring_named_ = false;
  ForkStamp fork_;  // see close()
  std::unique_ptr<Ring> ring_;
  std::string tag_, ovf_name_, remote_addr_;
  std::shared_ptr<Segment> ovf_;
  std::unique_ptr<BufferAllocator> ovf_alloc_;
  std::deque<OutOfLine> ool_;
  std::deque<std::pair<uint64_t, std::shared_ptr<const void>>> held_;  // enqueue_held: (message, its slots)
  uint32_t n_remote_ = 0;
  std::map<std::string, int64_t> remote_seen_;  // subscription topic -> the reader's rank
  std::atomic<bool> shutdown_flag_{false};
  std::string remote_ranks_str() const {
    std::string s;
    for (auto& [t, r] : remote_seen_) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return std::to_string(n_remote_) + " expected" + (s.empty() ? "" : "; subscribed ranks " + s);
  }
  zmq::context_t ctx_{1};
  std::unique_ptr<zmq::socket_t> pub_;
  std::optional<CurveKeyPair> handle_reader_keys_;  // keys made here for the handle's holders
  std::unique_ptr<ConnectionGuard> guard_;  // how many may connect (core/zmq_guard.hpp)
  std::shared_ptr<zap::Admission> admission_;
  uint64_t last_leave_log_ns_ = 0;
  std::vector<std::byte> scratch_;
  FramePlan plan_;  // the last message's layout (enqueue, under mu_)
  uint64_t seq_ = 0;  // messages sent (to the ring, the remote readers, or both)
  uint64_t bytes_ = 0, overflow_msgs_ = 0, dedicated_msgs_ = 0;

  // The metrics tree reads relaxed atomics and the ring's header, never mu_: an enqueue blocked on
  // a slow reader holds mu_, and a scrape must not wait for it.
  metrics::Counter m_messages_, m_bytes_;
  metrics::Registration reg_;
  void collect(metrics::Sink& out) const override {
    const uint64_t sent = m_messages_.value();
    out.value(kMqMessages, {tag_}, double(sent));
    out.value(kMqBytes, {tag_}, double(m_bytes_.value()));
    if (!ring_) return;
    auto& h = const_cast<shm::Ring&>(*ring_).header();
    uint64_t depth = 0;
    for (uint32_t i = 0; i < h.n_readers && i < o_.local_reader_ranks.size(); ++i) {
      const auto& r = h.readers[i];
      if (r.state.load(std::memory_order_acquire) != shm::kReaderAttached) continue;
      const uint64_t consumed = r.consumed.load(std::memory_order_relaxed);
      const uint64_t lag = sent > consumed ? sent - consumed : 0;
      depth = std::max(depth, lag);
      out.value(kMqLag, {tag_, std::to_string(o_.local_reader_ranks[i])}, double(lag));
    }
    out.value(kMqDepth, {tag_}, double(depth));
  }

 public:
  void register_metrics() { reg_ = metrics::Registration(this); }
};

Result<std::unique_ptr<MessageQueue>> MessageQueue::create(const MessageQueueOptions& o) {
  auto w = std::make_unique<MqWriter>(o);
  SL_TRY(w->init());
  w->register_metrics();
  return std::unique_ptr<MessageQueue>(std::move(w));
}

}  // namespace stagelink
