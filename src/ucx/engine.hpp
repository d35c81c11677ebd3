// The UCX engine of the transfer-engine connector: one context and worker, a memory pool
// registered once (ucp_mem_map) and carved by BufferAllocator, endpoints to peers by worker
// address, and one progress thread woken by the worker's event file descriptor (never a busy
// loop; a receiving worker is always progressed while data arrives).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "stagelink/connector.hpp"
#include "stagelink/result.hpp"

namespace stagelink::ucx {

struct EngineOptions {
  std::string protocol = "tcp";  // tcp | rdma | shm | any: which UCX transports may run
  std::string device;            // a NIC (UCX_NET_DEVICES form, e.g. "eth0" or "mlx5_0:1"); empty: any
  size_t pool_bytes = 256u << 20;
  // A payload is split over up to `lanes` endpoints (each its own connection on TCP) to the same
  // peer, in parts of at least `lane_min_bytes`: one TCP stream does not fill a link, several do.
  unsigned lanes = 1;
  size_t lane_min_bytes = 256u << 10;
};

class Engine {
 public:
  // Errors: unsupported (no UCX transport for `protocol`/`device`), io, exhausted.
  static Result<std::shared_ptr<Engine>> create(const EngineOptions& o);
  ~Engine();
  void close();  // stops the thread, closes endpoints, deregisters the pool. Idempotent.

  std::byte* pool_base() const;
  size_t pool_size() const;
  // A region of the pool, waiting for room until `deadline`. Errors: exhausted, closed.
  Result<size_t> allocate(size_t n, Deadline deadline);
  void free(size_t offset, size_t n);
  size_t pool_used() const;
  // Whether this UCX moves CUDA memory (a CUDA transport is loaded: ucp_context_query's memory
  // types include CUDA), which GPU pools registered with it would need.
  bool cuda_memory() const;

  // This engine's UCX worker address, wrapped (magic, UCX version, length, checksum) so that a peer
  // checks it before UCX reads it: what peers pass back as `peer` below. An address that does not
  // check out is a corrupt error (unsupported for another UCX major) where an endpoint is made.
  const std::vector<std::byte>& worker_address() const;

  // Active-message data path (the only one: RMA emulated over TCP could abort a receiver whose
  // sender died mid-put, and a remote write needs an address taken from a message). Receiving side: expect(token) names where the message tagged `token`
  // lands; `keep` stays referenced until nothing can write there any more (a receive under way
  // outlives a caller that gave up). wait_landed() then waits for it; forget() gives up.
  void expect(uint64_t token, std::byte* dst, size_t len, std::shared_ptr<void> keep);
  // With `watch` (a peer's worker address): returns peer_dead early if the endpoint to it fails.
  Status wait_landed(uint64_t token, Deadline deadline, std::span<const std::byte> watch = {});
  void forget(uint64_t token);
  // Sending side: `src` to the peer's worker, tagged `token`, split over the lanes, then flush:
  // when it returns ok the peer's UCX has the bytes (rendezvous: in the destination). Errors as
  // write().
  Status send(std::span<const std::byte> peer, uint64_t token, std::span<const std::byte> src, Deadline deadline);
  // The same without waiting: `done` runs once, on the progress thread (or inline when everything
  // completed at once). Operations still under way at `deadline` are cancelled (done: timeout).
  // `src` must stay valid until `done` runs.
  void send_async(std::span<const std::byte> peer, uint64_t token, std::span<const std::byte> src, Deadline deadline,
                  std::function<void(Status)> done);
  // Set up the endpoints to `peer` ahead of the first transfer (UCX connects and wires an
  // endpoint up at its first use: milliseconds over TCP): the first `lanes` of them (0: all the
  // lanes a send uses), each sent an empty message and flushed, so the peer's side is connected
  // too. Errors: timeout, peer_dead, io, closed.
  Status connect(std::span<const std::byte> peer, unsigned lanes, Deadline deadline);
  // Tell the peer that the transfer `token` failed: its wait_landed() returns `e` (code and text).
  void send_error(std::span<const std::byte> peer, uint64_t token, const Error& e);

  // Small requests between engines (a pull without the ZeroMQ side channel's thread hops): the
  // handler runs on the progress thread and must not block; request() posts `msg` to the peer.
  void on_request(std::function<void(std::span<const std::byte>)> handler);
  Status request(std::span<const std::byte> peer, std::span<const std::byte> msg, Deadline deadline);

  // The transports and devices UCX actually runs for this context, and counters.
  Value info() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace stagelink::ucx
