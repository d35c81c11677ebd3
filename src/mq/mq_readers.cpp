// MessageQueue's readers: local ones on the shared-memory ring, remote ones over ZeroMQ SUB
// (message_queue.cpp is the writer).
#include "stagelink/mq.hpp"

#include "mq/mq_internal.hpp"

namespace stagelink {

// ---- readers ----
// What both kinds of reader share: no writing, and dequeue as a copy through dequeue_with.
class MqReader : public MessageQueue {
 public:
  MqReader(MessageQueueHandle h, int64_t rank) : h_(std::move(h)), rank_(rank) {}
  MessageQueueHandle export_handle() const override { return h_; }
  bool is_writer() const override { return false; }
  int64_t rank() const override { return rank_; }
  Status wait_until_ready(double) override { return {}; }
  Status enqueue(const Payload&, double) override {
    return make_error(Errc::invalid_argument, "enqueue on a reader of a message queue");
  }
  Status drop_reader(uint32_t) override { return make_error(Errc::invalid_argument, "only the writer drops readers"); }
  Result<Message> dequeue(double timeout_s) override {
    Message m;
    Status inner;
    SL_TRY(dequeue_with(timeout_s, [&](std::span<const std::byte> frame) {
      auto p = decode_frame_copy(frame);
      if (!p.ok()) inner = std::move(p).error();
      else m.payload = std::move(p).value();
      m.size = frame.size();
    }));
    SL_TRY(inner);
    m.seq = delivered() - 1;
    return m;
  }
  Value stats() override {
    Value::Map m;
    m.emplace_back("role", kind());
    m.emplace_back("rank", rank_);
    m.emplace_back("messages", delivered());
    return Value(std::move(m));
  }

 protected:
  virtual uint64_t delivered() const = 0;  // messages handed out so far
  virtual const char* kind() const = 0;
  MessageQueueHandle h_;
  int64_t rank_;
};

class MqLocalReader final : public MqReader {
 public:
  using MqReader::MqReader;

  Status init(uint32_t local_index) {
    // Map the overflow area first: the writer unlinks both names as soon as every reader has
    // attached to the ring.
    if (!h_.overflow_name.empty()) {
      auto o = Segment::open(h_.shm_dir, h_.overflow_name, false, true);  // pre-faulted
      if (!o.ok()) return gone(o.error());
      ovf_ = o.value();
    }
    shm::RingOptions ro;
    ro.spin_ns = h_.spin_us * 1000;
    auto r = Ring::attach(h_.shm_dir, h_.ring_name, local_index, ro);
    if (!r.ok()) return gone(r.error());
    ring_ = std::move(r).value();
    ring_->set_rank_names(h_.local_reader_ranks);
    return {};
  }

  Status dequeue_with(double timeout_s, const std::function<void(std::span<const std::byte>)>& fn) override {
    SL_ASSIGN(RingChunk * c, ring_->acquire_read(deadline_from(timeout_s)));
    std::shared_ptr<Segment> dedicated;
    auto frame = locate(c, dedicated);
    if (!frame.ok()) {
      ring_->release_read(c);
      return std::move(frame).error();
    }
    fn(*frame);
    const bool valid = ring_->still_valid(c);
    ring_->release_read(c);
    if (!valid) return make_error(Errc::closed, "reader rank " + std::to_string(rank_) + " was dropped while reading");
    return {};
  }

  Result<bool> wait_message(double timeout_s) override {
    if (ring_->next_ready()) return true;
    if (timeout_s == 0) return false;  // a poll: what is wrong, if anything, a wait will say
    Status st = ring_->wait_read(deadline_from(timeout_s));
    if (st.ok()) return true;
    if (st.error().code == Errc::timeout || st.error().code == Errc::cancelled) return false;
    return std::move(st).error();
  }

  void shutdown(bool) override { ring_->cancel_local(); }
  bool shutting_down() const override { return ring_->stopping(); }

 protected:
  uint64_t delivered() const override { return ring_->read_seq(); }
  const char* kind() const override { return "local reader"; }

 private:
  Error gone(const Error& e) const {
    if (e.code != Errc::not_found) return e;
    return Error{Errc::not_found, "message queue " + h_.ring_name +
                                      " is gone: the writer closed, or every reader had attached already (" + e.message + ")"};
  }

  Result<std::span<const std::byte>> locate(RingChunk* c, std::shared_ptr<Segment>& dedicated) {
    const uint64_t len = c->len;
    switch (c->kind) {
      case shm::kInline:
        if (len > ring_->chunk_bytes()) return make_error(Errc::corrupt, "ring chunk length exceeds the chunk");
        return std::span<const std::byte>(ring_->data(c), len);
      case shm::kOverflow:
        if (!ovf_ || c->ov_offset > ovf_->size() || len > ovf_->size() - c->ov_offset)
          return make_error(Errc::corrupt, "overflow message lies outside the overflow area");
        return std::span<const std::byte>(ovf_->data() + c->ov_offset, len);
      case shm::kDedicated: {
        const char* name = reinterpret_cast<const char*>(ring_->data(c));
        std::string n(name, strnlen(name, std::min<size_t>(kMaxSegName, ring_->chunk_bytes())));
        if (n.rfind(shm::user_prefix() + "mq.m", 0) != 0 || n.find('/') != std::string::npos)
          return make_error(Errc::corrupt, "dedicated message names a segment outside the queue's prefix");
        SL_ASSIGN(dedicated, Segment::open(h_.shm_dir, n, false, false, len));
        return std::span<const std::byte>(dedicated->data(), len);
      }
    }
    return make_error(Errc::corrupt, "unknown ring message kind " + std::to_string(c->kind));
  }

  std::unique_ptr<Ring> ring_;
  std::shared_ptr<Segment> ovf_;
};

class MqRemoteReader final : public MqReader {
 public:
  using MqReader::MqReader;
  bool is_remote_reader() const override { return true; }
  ~MqRemoteReader() override {
    if (fork_.inherited()) {  // inherited through fork(): the parent's socket and context
      abandon_after_fork(ctx_, sub_);
      if (efd_ >= 0) ::close(efd_);
      return;
    }
    sub_.reset();
    ctx_.close();
    if (efd_ >= 0) ::close(efd_);
  }

  Status init() {
    efd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd_ < 0) return make_error(Errc::io, "eventfd failed");
    try {
      sub_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::sub);
      sub_->set(zmq::sockopt::rcvhwm, 0);
      sub_->set(zmq::sockopt::linger, 0);
      sub_->set(zmq::sockopt::subscribe, std::string(1, kMsgTag));
      sub_->set(zmq::sockopt::subscribe, std::string(1, kShutdownTag));
      sub_->set(zmq::sockopt::subscribe, rank_topic(rank_));
      if (curve_) SL_TRY(zap::connect_as(*sub_, *curve_));
      sub_->connect(h_.remote_addr);
    } catch (const zmq::error_t& e) {
      return make_error(Errc::io, "connecting to " + h_.remote_addr + ": " + e.what());
    }
    return {};
  }

  Status dequeue_with(double timeout_s, const std::function<void(std::span<const std::byte>)>& fn) override {
    const uint64_t dl = deadline_from(timeout_s);
    for (;;) {
      if (cancelled_.load()) return make_error(Errc::cancelled, kShutDown);
      zmq::message_t head;
      if (sub_->recv(head, zmq::recv_flags::dontwait)) {
        std::vector<zmq::message_t> rest;
        for (bool more = head.more(); more; more = rest.back().more()) {
          rest.emplace_back();
          if (!sub_->recv(rest.back(), zmq::recv_flags::none)) return make_error(Errc::io, "truncated multipart message");
        }
        const char* d = static_cast<const char*>(head.data());
        if (head.size() >= 1 && d[0] == kShutdownTag) {
          cancelled_.store(true);
          return make_error(Errc::cancelled, "cancelled: message queue was shut down by the writer");
        }
        if (head.size() != 9 || d[0] != kMsgTag || rest.size() != 1)
          return make_error(Errc::corrupt, "malformed message from the writer");
        uint64_t seq;
        std::memcpy(&seq, d + 1, 8);
        if (seq != next_)
          return make_error(Errc::corrupt, "remote reader rank " + std::to_string(rank_) + " expected message " +
                                               std::to_string(next_) + " but got " + std::to_string(seq) +
                                               " (a send to remote readers timed out, or the writer enqueued before wait_until_ready)");
        ++next_;
        fn(std::span<const std::byte>(static_cast<const std::byte*>(rest[0].data()), rest[0].size()));
        return {};
      }
      if (dl && mono_ns() >= dl)
        return make_error(Errc::timeout, "remote reader rank " + std::to_string(rank_) + ": no message " +
                                             std::to_string(next_) + " from " + h_.remote_addr + " before the timeout");
      poll_until(dl);
    }
  }

  Result<bool> wait_message(double timeout_s) override {
    const uint64_t dl = deadline_from(timeout_s);
    for (;;) {
      if (cancelled_.load()) return false;
      if (sub_->get(zmq::sockopt::events) & ZMQ_POLLIN) return true;
      if (dl && mono_ns() >= dl) return false;
      poll_until(dl);
    }
  }

  bool shutting_down() const override { return cancelled_.load(); }
  void shutdown(bool) override {
    cancelled_.store(true);
    // The eventfd wakes this process's blocked dequeue; inherited through fork() it is the
    // parent's too, and a wake never drained there would make its waits spin.
    if (fork_.inherited()) return;
    uint64_t one = 1;
    if (::write(efd_, &one, sizeof one) < 0) {
    }
  }

 protected:
  uint64_t delivered() const override { return next_; }
  const char* kind() const override { return "remote reader"; }

 private:
  // Sleep until the socket has a message, shutdown() writes the eventfd, or `dl` (0: no limit).
  void poll_until(uint64_t dl) {
    zmq::pollitem_t items[2] = {{sub_->handle(), 0, ZMQ_POLLIN, 0}, {nullptr, efd_, ZMQ_POLLIN, 0}};
    int wait_ms = -1;
    if (dl) {
      const uint64_t now = mono_ns();
      wait_ms = now >= dl ? 0 : int(std::min<uint64_t>((dl - now + 999999) / 1000000, 1u << 30));
    }
    poll_through_signals(items, 2, std::chrono::milliseconds(wait_ms));
  }

  zmq::context_t ctx_{1};
  std::unique_ptr<zmq::socket_t> sub_;

 public:
  std::optional<CurveClient> curve_;  // set by create_from_handle before init()

 private:
  ForkStamp fork_;
  int efd_ = -1;
  std::atomic<bool> cancelled_{false};
  uint64_t next_ = 0;
};

Result<std::unique_ptr<MessageQueue>> MessageQueue::create_from_handle(const MessageQueueHandle& h, int64_t rank,
                                                                       const CurveClient* curve) {
  for (size_t i = 0; i < h.local_reader_ranks.size(); ++i) {
    if (int64_t(h.local_reader_ranks[i]) != rank) continue;
    auto r = std::make_unique<MqLocalReader>(h, rank);
    SL_TRY(r->init(uint32_t(i)));
    return std::unique_ptr<MessageQueue>(std::move(r));
  }
  if (h.remote_addr.empty())
    return make_error(Errc::invalid_argument, "rank " + std::to_string(rank) + " is not a local reader and the queue has no remote address");
  // Keys the writer made for the handle's holders (its default), where the reader has none.
  std::optional<CurveClient> from_handle;
  if (!curve && h.reader_keys) curve = &from_handle.emplace(CurveClient{*h.reader_keys, h.server_key});
  if (!h.server_key.empty() && !curve)
    return make_error(Errc::invalid_argument, "the message queue at " + h.remote_addr +
                                                  " serves remote readers with CURVE: this reader needs keys (curve=, "
                                                  "or STAGELINK_CURVE_SECRET_FILE)");
  if (curve && h.server_key.empty())  // a plain writer's handle, or a forged one: not what keys expect
    return make_error(Errc::permission_denied, "the message queue handle names no writer key, and this reader "
                                                   "was given keys: refused (a writer with keys puts its key in its handle)");
  auto r = std::make_unique<MqRemoteReader>(h, rank);
  if (curve) {
    // The writer's key is the reader's to know (its `server_key`; by default the deployment's
    // shared key), never the handle's: a handle travels unauthenticated, and a forged one naming
    // its own address and key would otherwise be trusted, its pickles included.
    SL_TRY(check_curve(*curve));
    if (!h.server_key.empty() && h.server_key != curve->server_key)
      return make_error(Errc::permission_denied, "the message queue handle names a writer key (" + h.server_key +
                                                     ") other than the one this reader expects (" + curve->server_key +
                                                     "): refused");
    r->curve_ = *curve;
  }
  SL_TRY(r->init());
  return std::unique_ptr<MessageQueue>(std::move(r));
}

}  // namespace stagelink
