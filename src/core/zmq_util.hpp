// ZeroMQ calls as stagelink's waits need them (internal).
#pragma once
#include <cerrno>
#include <chrono>
#include <zmq.hpp>

namespace stagelink {

// zmq::poll, except that a signal (EINTR: the process has a handler, e.g. Python's for Ctrl-C)
// counts as "nothing ready yet" instead of throwing: every caller loops to its own deadline, and
// Python runs the handler between the slices it waits in. Other errors throw as zmq::poll does.
inline int poll_through_signals(zmq::pollitem_t* items, size_t n, std::chrono::milliseconds timeout) {
  const int rc = zmq_poll(items, int(n), long(timeout.count()));
  if (rc < 0) {
    if (zmq_errno() == EINTR) return 0;
    throw zmq::error_t();
  }
  return rc;
}

}  // namespace stagelink
