#include "core/zmq_guard.hpp"

#include "core/counts.hpp"

#include <netinet/in.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_set>

#include "core/log.hpp"
#include "core/zmq_util.hpp"

namespace stagelink {

struct ConnectionGuard::State {
  std::thread thread;
  std::unordered_set<int> live;  // the descriptors of the connections accepted and not yet lost
};

namespace {
std::atomic<uint64_t> g_next{0};

// Whether `fd` is still a connection accepted on the listener of `endpoint` (its local address
// is the listener's): the descriptor number of an event may have been closed and reused by the
// time the event is read, and only a connection of this listener may be shut down.
bool accepted_on(int fd, const std::string& endpoint) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return false;
  if (ss.ss_family == AF_UNIX) {
    const auto* un = reinterpret_cast<const sockaddr_un*>(&ss);
    return endpoint.rfind("ipc://", 0) == 0 && endpoint.compare(6, std::string::npos, un->sun_path) == 0;
  }
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) port = ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  else if (ss.ss_family == AF_INET6) port = ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  else return false;
  const size_t colon = endpoint.rfind(':');
  return colon != std::string::npos && endpoint.compare(colon + 1, std::string::npos, std::to_string(port)) == 0;
}
}  // namespace

Result<std::unique_ptr<ConnectionGuard>> ConnectionGuard::attach(zmq::context_t& ctx, zmq::socket_t& sock,
                                                                 size_t max_live) {
  std::unique_ptr<ConnectionGuard> g(new ConnectionGuard());
  g->max_live_ = max_live;
  g->sock_ = sock.handle();
  g->st_ = std::make_unique<State>();
  const std::string addr = "inproc://stagelink-guard-" + std::to_string(::getpid()) + "-" +
                           std::to_string(g_next.fetch_add(1));
  try {
    sock.set(zmq::sockopt::handshake_ivl, kHandshakeMs);
    if (zmq_socket_monitor(sock.handle(), addr.c_str(),
                           ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_MONITOR_STOPPED) != 0)
      return make_error(Errc::io, std::string("monitoring a socket: ") + zmq_strerror(zmq_errno()));
    g->pair_ = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::pair);
    g->pair_->set(zmq::sockopt::linger, 0);
    g->pair_->connect(addr);
  } catch (const zmq::error_t& e) {
    return make_error(Errc::io, std::string("monitoring a socket: ") + e.what());
  }
  g->stop_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (g->stop_fd_ < 0) return make_error(Errc::io, std::string("eventfd: ") + std::strerror(errno));
  try {
    g->st_->thread = std::thread([p = g.get()] { p->run(); });
  } catch (const std::system_error& e) {
    return make_error(Errc::io, std::string("starting a connection guard: ") + e.what());
  }
  return g;
}

ConnectionGuard::~ConnectionGuard() {
  if (sock_) (void)zmq_socket_monitor(sock_, nullptr, 0);  // MONITOR_STOPPED: the watcher ends
  if (st_ && st_->thread.joinable()) {
    const uint64_t one = 1;
    if (::write(stop_fd_, &one, sizeof one) < 0) {
    }
    st_->thread.join();
  }
  pair_.reset();
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

void ConnectionGuard::run() {
  pthread_setname_np(pthread_self(), "sl-zmq-guard");
  for (;;) {
    zmq::pollitem_t items[2] = {{pair_->handle(), 0, ZMQ_POLLIN, 0}, {nullptr, stop_fd_, ZMQ_POLLIN, 0}};
    try {
      poll_through_signals(items, 2, std::chrono::milliseconds(-1));  // woken by an event or the stop
      if (items[1].revents & ZMQ_POLLIN) return;
      zmq::message_t ev, where;
      if (!pair_->recv(ev, zmq::recv_flags::dontwait)) continue;
      if (!ev.more() || !pair_->recv(where, zmq::recv_flags::dontwait) || ev.size() < 6) continue;
      uint16_t event = 0;
      uint32_t value = 0;
      std::memcpy(&event, ev.data(), 2);
      std::memcpy(&value, static_cast<const char*>(ev.data()) + 2, 4);
      if (event == ZMQ_EVENT_MONITOR_STOPPED) return;  // the socket was closed
      const int fd = int(value);
      if (event == ZMQ_EVENT_ACCEPTED) {
        on_accepted(fd, where.to_string());
      } else if (event == ZMQ_EVENT_DISCONNECTED) {
        st_->live.erase(fd);  // a newcomer shut down was never counted
      }
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      // Keep draining: a monitor nobody reads would block the socket's I/O thread.
      SL_LOG_WARN("connection guard: %s", e.what());
    }
  }
}

void ConnectionGuard::on_accepted(int fd, const std::string& endpoint) {
  if (st_->live.size() < max_live_) {
    st_->live.insert(fd);
    return;
  }
  // Full: this newcomer goes. libzmq reads end of file, drops the connection, closes the
  // descriptor and reports it disconnected (not counted: it never was).
  if (accepted_on(fd, endpoint) && ::shutdown(fd, SHUT_RDWR) == 0) {
    counts::connection_refused();
    if (refused_.fetch_add(1, std::memory_order_relaxed) == 0)
      SL_LOG_WARN("%s: %zu connections already; newcomers are shut down until some leave (a peer opening "
                  "connections without authenticating?)", endpoint.c_str(), max_live_);
  }
}

}  // namespace stagelink
