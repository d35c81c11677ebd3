// CURVE on ZeroMQ sockets, with a ZAP handler (ZeroMQ's authentication protocol, RFC 27) that
// admits only listed client keys (internal).
//
// One handler thread per ZeroMQ context, started by the first server socket that needs it and
// stopped (socket closed, thread joined) when the last one goes, so a context can always be
// terminated. Each server socket has a ZAP domain of its own with its allow list and a count of
// the clients it refused. ZMQ_ZAP_ENFORCE_DOMAIN (a draft option: set where libzmq has it) makes
// a missing handler refuse, never admit; where libzmq lacks it the handler is up before a socket
// is configured and outlives it, so no connection meets a socket without one.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <zmq.hpp>

#include "stagelink/curve.hpp"

namespace stagelink::zap {

class Admission {
 public:
  virtual ~Admission() = default;
  // Clients refused so far (unknown key, or not CURVE at all).
  virtual uint64_t refused() const = 0;
};

// Make `sock` (not yet bound) a CURVE server of `ctx` admitting only s.allowed_clients. Keep the
// result as long as the socket; destroy it after closing the socket. Errors: invalid_argument
// (bad keys), unsupported (no CURVE in this libzmq), io.
Result<std::shared_ptr<Admission>> serve(zmq::context_t& ctx, zmq::socket_t& sock, const CurveServer& s);

// Make `sock` (not yet connected) a CURVE client. Errors: invalid_argument, unsupported.
Status connect_as(zmq::socket_t& sock, const CurveClient& c);

}  // namespace stagelink::zap
