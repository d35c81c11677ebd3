// What peers that never authenticate can make a listening ZeroMQ socket hold (internal).
//
// libzmq buffers a frame up to ZMQ_MAXMSGSIZE for every connection, before the CURVE handshake has
// said who the peer is, and keeps a connection in its handshake for ZMQ_HANDSHAKE_IVL (30 s by
// default): a stranger's 32 connections each sending a greeting and a 60 MiB command frame held
// 1.9 GB. Every socket stagelink binds therefore has three bounds: its owner's small frame cap
// (ZMQ_MAXMSGSIZE: what one connection can hold), a 5 s handshake (how long), and this guard (how
// many): a thread watching the socket's monitor counts the connections it accepted and not yet
// lost, and shuts down (shutdown(2), which makes libzmq drop it) each newcomer beyond `max_live`.
// Connections already up, the pipeline's own, are never touched; so what strangers hold in total
// is at most max_live x the frame cap, and the descriptors they use stay near max_live.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <zmq.hpp>

#include "stagelink/result.hpp"

namespace stagelink {

inline constexpr int kHandshakeMs = 5000;  // ZMQ_HANDSHAKE_IVL of every socket stagelink binds

class ConnectionGuard {
 public:
  // Watch `sock` (of `ctx`, not yet bound): sets its handshake interval, starts the watcher.
  // Errors: io (no monitor, no eventfd, no thread).
  static Result<std::unique_ptr<ConnectionGuard>> attach(zmq::context_t& ctx, zmq::socket_t& sock, size_t max_live);
  // Stops the monitor and joins the watcher: call it before closing the socket (libzmq's monitor
  // blocks the socket's I/O thread on events nobody reads) and the context.
  ~ConnectionGuard();
  // In a process forked from the owner: the watcher and the monitor are the parent's; leave them.
  static void abandon(std::unique_ptr<ConnectionGuard>& g) { (void)g.release(); }
  ConnectionGuard(const ConnectionGuard&) = delete;
  ConnectionGuard& operator=(const ConnectionGuard&) = delete;

  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }  // newcomers shut down

 private:
  ConnectionGuard() = default;
  void run();
  void on_accepted(int fd, const std::string& endpoint);

  void* sock_ = nullptr;  // the watched socket (its owner's)
  std::unique_ptr<zmq::socket_t> pair_;
  int stop_fd_ = -1;
  size_t max_live_ = 0;
  std::atomic<uint64_t> refused_{0};
  struct State;
  std::unique_ptr<State> st_;
};

}  // namespace stagelink
