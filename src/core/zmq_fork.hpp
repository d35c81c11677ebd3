// ZeroMQ objects inherited through fork(). Their context's I/O and reaper threads stayed in the
// parent: closing a socket or terminating the context in the child blocks for ever (libzmq waits
// for the reaper) or pokes the parent's threads through the descriptors they share. The child
// leaves them be: the sockets are released unclosed, the context moved into a heap object that is
// never destroyed; their memory goes with the process.
#pragma once
#include <memory>
#include <utility>
#include <zmq.hpp>

namespace stagelink {

template <class... Sockets>
void abandon_after_fork(zmq::context_t& ctx, std::unique_ptr<Sockets>&... socks) {
  ((void)socks.release(), ...);
  (void)new zmq::context_t(std::move(ctx));
}

template <class... Sockets>
void abandon_after_fork(std::unique_ptr<zmq::context_t>& ctx, std::unique_ptr<Sockets>&... socks) {
  ((void)socks.release(), ...);
  (void)ctx.release();
}

}  // namespace stagelink
