// ControlInbox / ControlOutbox over ZeroMQ PUSH/PULL.
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <zmq.hpp>

#include "control/counted.hpp"

#include "control/shm_transport.hpp"
#include "core/log.hpp"
#include "core/proc.hpp"
#include "core/zap.hpp"
#include "core/zmq_fork.hpp"
#include "core/zmq_guard.hpp"
#include "core/zmq_util.hpp"
#include "stagelink/control.hpp"

namespace stagelink {

namespace {
// One ZeroMQ context per process for the control plane (one I/O thread). A context does not
// survive fork (its I/O thread stays in the parent): a forked child gets a fresh one. Never
// destroyed: sockets may outlive statics, and the parent's copy in a child must not be touched.
zmq::context_t& context() {
  static std::mutex mu;
  static zmq::context_t* ctx = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (!ctx || owner != ::getpid()) {
    ctx = new zmq::context_t(1);
    owner = ::getpid();
  }
  return *ctx;
}

// A tcp:// endpoint on an address other hosts may reach (not loopback).
bool off_host(const std::string& ep) {
  if (ep.rfind("tcp://", 0) != 0) return false;
  const std::string host = ep.substr(6, ep.rfind(':') - 6);
  return !(host.rfind("127.", 0) == 0 || host == "localhost" || host == "[::1]" || host == "::1");
}

int timeout_ms(double timeout_s) { return timeout_s < 0 ? -1 : int(std::min(timeout_s, 2.0e6) * 1000.0); }

Status check_endpoint(const std::string& ep) {
  if (ep.rfind("ipc://", 0) == 0 && ep.size() > 6) {
    if (ep.size() - 6 >= 108)  // sockaddr_un's path
      return make_error(Errc::invalid_argument, "ipc endpoint path '" + ep.substr(6) + "' is longer than 107 bytes");
    return {};
  }
  if (ep.rfind("tcp://", 0) == 0 && ep.find(':', 6) != std::string::npos) return {};
  return make_error(Errc::invalid_argument, "control endpoint '" + ep + "' is none of shm://name, ipc:///path, tcp://host:port");
}

class ZmqInbox final : public ControlInbox {
 public:
  ~ZmqInbox() override { close(); }

  Status init(const std::string& endpoint, const CurveServer* curve) {
    SL_TRY(check_endpoint(endpoint));
    if (curve) SL_TRY(check_curve(*curve));
    efd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd_ < 0) return make_error(Errc::io, std::string("eventfd: ") + std::strerror(errno));
    try {
      sock_ = std::make_unique<zmq::socket_t>(context(), zmq::socket_type::pull);
      sock_->set(zmq::sockopt::linger, 0);
      // A message travels in parts of at most kControlPartBytes (ZmqOutbox): what a connection
      // can make this process buffer before the CURVE handshake says who it is, where a cap of
      // the whole message (65 MiB) let strangers' greetings hold gigabytes. A peer declaring a
      // larger frame is disconnected before it is buffered; the guard bounds how many connect.
      sock_->set(zmq::sockopt::maxmsgsize, int64_t(kControlPartBytes + kCurveFrameOverhead));
      SL_ASSIGN(guard_, ConnectionGuard::attach(context(), *sock_, kControlMaxConnections));
      if (curve) {
        SL_ASSIGN(admission_, zap::serve(context(), *sock_, *curve));
      }
      sock_->bind(endpoint);
      endpoint_ = sock_->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return make_error(Errc::io, "binding control inbox " + endpoint + ": " + e.what());
    }
    if (!curve && off_host(endpoint_)) {
      static std::atomic<bool> said{false};
      if (!said.exchange(true))
        SL_LOG_WARN("control inbox %s serves a network address without CURVE: any host that reaches it can send "
                    "control messages (shutdown, abort, forged results). Give it keys (a pipeline does by itself; "
                    "SECURITY.md)", endpoint_.c_str());
    }
    return {};
  }

  uint64_t refused() const override {  // keys refused at the handshake, and connections over the guard's limit
    return (admission_ ? admission_->refused() : 0) + (guard_ ? guard_->refused() : 0);
  }
  bool authenticated() const override { return admission_ || !off_host(endpoint_); }

  const std::string& endpoint() const override { return endpoint_; }

  Result<ControlMessage> recv(double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);  // one receiver at a time
    if (closed_.load() || !sock_) return make_error(Errc::closed, "control inbox is closed");
    const uint64_t deadline = deadline_ns(timeout_s, mono_ns());
    zmq::pollitem_t items[2] = {{sock_->handle(), 0, ZMQ_POLLIN, 0}, {nullptr, efd_, ZMQ_POLLIN, 0}};
    for (;;) {
      zmq::message_t msg;
      if (sock_->recv(msg, zmq::recv_flags::dontwait)) {
        if (!msg.more())  // one part: decoded in place
          return counted(
              decode_control(std::span<const std::byte>(static_cast<const std::byte*>(msg.data()), msg.size())));
        // Several parts (all here: ZeroMQ delivers a message whole): one buffer, bounded by the
        // largest legal message; past that, the rest is drained and the message refused.
        std::vector<std::byte> whole;
        bool over = false;
        for (;;) {
          const auto* p = static_cast<const std::byte*>(msg.data());
          if (!over && whole.size() + msg.size() <= kControlMaxWire) whole.insert(whole.end(), p, p + msg.size());
          else over = true;
          if (!msg.more() || !sock_->recv(msg, zmq::recv_flags::dontwait)) break;
        }
        if (over)
          return counted(make_error(Errc::corrupt, "control message over " + std::to_string(kControlMaxWire) +
                                                       " bytes (dropped)"));
        return counted(decode_control(whole));
      }
      if (closed_.load()) return make_error(Errc::closed, "control inbox was closed");
      int wait = -1;
      if (timeout_s >= 0) {
        const uint64_t now = mono_ns();
        if (now >= deadline)
          return make_error(Errc::timeout, "no control message on " + endpoint_ + " within " +
                                               std::to_string(timeout_s) + " s");
        wait = int((deadline - now + 999'999) / 1'000'000);
      }
      poll_through_signals(items, 2, std::chrono::milliseconds(wait));
    }
  }

  void close() override {
    if (closed_.exchange(true)) return;
    // The eventfd wakes a recv blocked in this process; inherited through fork() it is the
    // parent's too (a wake never drained there would make its recv spin): not written then.
    if (efd_ >= 0 && !fork_.inherited()) {
      const uint64_t one = 1;
      if (::write(efd_, &one, sizeof one) < 0) {
      }
    }
    std::lock_guard<std::mutex> lock(mu_);  // after a blocked recv saw the wake-up
    if (fork_.inherited()) ConnectionGuard::abandon(guard_);  // the parent's watcher
    guard_.reset();  // before the socket (its monitor)
    if (fork_.inherited()) (void)sock_.release();  // the parent's (core/zmq_fork.hpp)
    sock_.reset();
    if (fork_.inherited()) {
      (void)new std::shared_ptr<zap::Admission>(std::move(admission_));  // the parent's handler: never stopped here
    }
    admission_.reset();  // after the socket: the last one stops the context's ZAP handler
    if (efd_ >= 0) ::close(efd_);
    efd_ = -1;
  }

 private:
  std::mutex mu_;
  std::atomic<bool> closed_{false};
  std::unique_ptr<zmq::socket_t> sock_;
  std::unique_ptr<ConnectionGuard> guard_;
  std::shared_ptr<zap::Admission> admission_;
  std::string endpoint_;
  int efd_ = -1;
  ForkStamp fork_;
};

class ZmqOutbox final : public ControlOutbox {
 public:
  ~ZmqOutbox() override { close(); }
  Status init(const std::string& endpoint, const CurveClient* curve) {
    SL_TRY(check_endpoint(endpoint));
    if (curve) SL_TRY(check_curve(*curve));
    try {
      // A context of its own: close() terminates it, which is ZeroMQ's one way to wait until the
      // queued messages are out (bounded by the linger), so nothing sent is lost when the
      // process exits right after.
      ctx_ = std::make_unique<zmq::context_t>(1);
      sock_ = std::make_unique<zmq::socket_t>(*ctx_, zmq::socket_type::push);
      sock_->set(zmq::sockopt::linger, 1000);  // close() flushes for at most 1 s
      sock_->set(zmq::sockopt::sndhwm, 10000);
      if (curve) SL_TRY(zap::connect_as(*sock_, *curve));
      sock_->connect(endpoint);
      endpoint_ = endpoint;
    } catch (const zmq::error_t& e) {
      return make_error(Errc::io, "connecting control outbox to " + endpoint + ": " + e.what());
    }
    return {};
  }
  Status send_bytes(std::span<const std::byte> bytes, double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sock_) return make_error(Errc::closed, "control outbox is closed");
    try {
      sock_->set(zmq::sockopt::sndtimeo, timeout_ms(timeout_s));
      // In parts of at most kControlPartBytes (the inbox's frame cap). Only the first part can
      // wait: ZeroMQ takes the rest of a message it has begun at once.
      for (size_t at = 0;;) {
        const size_t n = std::min(bytes.size() - at, kControlPartBytes);
        const bool last = at + n == bytes.size();
        if (!sock_->send(zmq::const_buffer(bytes.data() + at, n), last ? zmq::send_flags::none : zmq::send_flags::sndmore)) {
          if (at == 0)
            return make_error(Errc::timeout, "control message to " + endpoint_ + " not taken within " +
                                                 std::to_string(timeout_s) + " s (is the stage alive?)");
          return make_error(Errc::io, "control message to " + endpoint_ + " cut short");
        }
        at += n;
        if (last) break;
      }
    } catch (const zmq::error_t& e) {
      return make_error(Errc::io, "sending a control message to " + endpoint_ + ": " + e.what());
    }
    return {};
  }
  // Sends what is queued (for at most the 1 s linger), then releases everything. Idempotent.
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fork_.inherited()) abandon_after_fork(ctx_, sock_);  // the parent's
    sock_.reset();
    if (ctx_) ctx_->close();  // blocks until the queue is flushed or the linger passed
    ctx_.reset();
  }

 private:
  std::mutex mu_;
  std::unique_ptr<zmq::context_t> ctx_;
  std::unique_ptr<zmq::socket_t> sock_;
  std::string endpoint_;
  ForkStamp fork_;
};
}  // namespace

Result<std::string> make_private_socket_dir(const std::string& tag) {
  for (char c : tag)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_')
      return make_error(Errc::invalid_argument, "socket directory tag '" + tag + "' may hold only letters, digits, '-' and '_'");
  const char* base = std::getenv("XDG_RUNTIME_DIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/" + tag + "-XXXXXX";
  if (tmpl.size() > 60) tmpl = "/tmp/" + tag.substr(0, 16) + "-XXXXXX";  // room for socket names (108-byte limit)
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data()))  // mode 0700
    return make_error(Errc::io, "creating a private socket directory from " + tmpl + ": " + std::strerror(errno));
  return std::string(buf.data());
}

void remove_private_socket_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

Result<std::unique_ptr<ControlInbox>> ControlInbox::bind(const std::string& endpoint, const CurveServer* curve) {
  if (endpoint.rfind("shm://", 0) == 0) return bind_shm_inbox(endpoint);  // owner-checked; no network
  auto in = std::make_unique<ZmqInbox>();
  SL_TRY(in->init(endpoint, curve));
  return std::unique_ptr<ControlInbox>(std::move(in));
}

Result<std::unique_ptr<ControlOutbox>> ControlOutbox::connect(const std::string& endpoint, const CurveClient* curve) {
  if (endpoint.rfind("shm://", 0) == 0) return connect_shm_outbox(endpoint);
  auto out = std::make_unique<ZmqOutbox>();
  SL_TRY(out->init(endpoint, curve));
  return std::unique_ptr<ControlOutbox>(std::move(out));
}

}  // namespace stagelink
