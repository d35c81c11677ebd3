// Process-wide counters of what peers did to this process's sockets and decoders (refusals,
// drops), in the metrics tree: the places that refuse count here, once.
#pragma once
#include <cstddef>

namespace stagelink::counts {

void curve_refused() noexcept;         // a peer refused at a CURVE handshake (zap.cpp)
void connection_refused() noexcept;    // a connection over a socket's limit (zmq_guard.cpp)
void control_received(size_t type) noexcept;  // a control message received (ControlType)
void control_dropped() noexcept;       // a malformed or oversized control message dropped
void pickle_refused() noexcept;        // a payload holding a pickled object refused (allow_pickle off)

}  // namespace stagelink::counts
