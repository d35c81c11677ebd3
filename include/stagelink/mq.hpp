// MessageQueue: one writer, N readers (vLLM's shm_broadcast, done right).
//
// Local readers read a shared-memory ring (stagelink::shm::Ring); messages larger than a chunk go
// through a shared-memory overflow area (or a segment of their own when larger than that), never a
// socket. Remote readers (other hosts) subscribe over ZeroMQ (XPUB/SUB over TCP) and receive the
// same messages in the same order. Every message is a frame (frame.hpp).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "stagelink/curve.hpp"
#include "stagelink/frame.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink {

struct MessageQueueOptions {
  uint32_t n_reader = 1;                 // all readers, local and remote
  uint32_t n_local_reader = 1;           // readers on this host (ring)
  // Ranks of the local readers (default 0..n_local_reader-1): any distinct numbers, e.g. the
  // group ranks of a process group ([1, 2, 3] beside a writer of rank 0). The other
  // n_reader - n_local_reader readers are remote, whatever their ranks.
  std::vector<uint32_t> local_reader_ranks;
  size_t max_chunk_bytes = 10u << 20;    // ring chunk size (vLLM's default)
  uint32_t max_chunks = 10;              // ring length (vLLM's default)
  size_t overflow_bytes = 64u << 20;     // shared-memory area for messages larger than a chunk
  // Address remote readers connect to, and the only one the socket binds. Empty: this host's
  // address (net::host_address(): an up, non-loopback interface, or STAGELINK_HOST_IP /
  // VLLM_HOST_IP). vLLM binds every interface; stagelink binds only the one it advertises.
  std::string connect_ip;
  // Remote readers authenticated and encrypted (CurveZMQ): only readers holding a listed key
  // subscribe. Unset: anyone who reaches the address may subscribe (logged once).
  std::optional<CurveServer> curve;
  int remote_port = 0;                   // 0: an ephemeral port
  int remote_hwm = 1000;                 // writer-side queue per remote reader; a reader that stops
                                         // taking data makes enqueue block, then time out
  double warn_interval_s = 60.0;         // a blocked writer logs the readers it waits for this often
  bool drop_dead_readers = false;        // a dead local reader is dropped instead of failing enqueue
  uint64_t spin_us = 50;                 // spin before sleeping in the kernel
  std::string shm_dir = "/dev/shm";
};

// What a reader needs to attach; small and serializable (to_msgpack/from_msgpack).
struct MessageQueueHandle {
  std::string shm_dir, ring_name, overflow_name;
  std::vector<uint32_t> local_reader_ranks;
  uint32_t n_reader = 0;
  std::string remote_addr;  // empty: no remote readers
  std::string server_key;   // the writer's CURVE public key; empty: remote readers not authenticated
  // A key pair the writer made for its readers when it was given none (the default): whoever
  // holds the handle may subscribe, nobody else. Empty where the deployment gave keys.
  std::optional<CurveKeyPair> reader_keys;
  uint64_t spin_us = 50;
  uint64_t chunk_bytes = 0;   // ring chunk size (0: unknown, an older handle)
  uint32_t max_chunks = 0;
  std::vector<std::byte> to_msgpack() const;
  static Result<MessageQueueHandle> from_msgpack(std::span<const std::byte> bytes);
};

// A received message. The payload owns its bytes (copied out of the ring once).
struct Message {
  uint64_t seq = 0;
  Payload payload;
  size_t size = 0;  // frame bytes
};

class MessageQueue {
 public:
  static Result<std::unique_ptr<MessageQueue>> create(const MessageQueueOptions& o);
  // `rank` in h.local_reader_ranks: a local reader; any other (-1 included): a remote one.
  // A remote reader of a queue whose handle names a server_key needs `curve` (its keys and the
  // writer's public key, which must match the handle's: never taken from it). Errors:
  // invalid_argument (keys missing or malformed), permission_denied (the handle names another key).
  static Result<std::unique_ptr<MessageQueue>> create_from_handle(const MessageQueueHandle& h, int64_t rank,
                                                                  const CurveClient* curve = nullptr);
  virtual ~MessageQueue() = default;

  virtual MessageQueueHandle export_handle() const = 0;
  virtual bool is_writer() const = 0;
  // A reader over TCP (what it reads crossed a network): never a CUDA device record.
  virtual bool is_remote_reader() const { return false; }
  virtual int64_t rank() const = 0;  // readers: their rank (the writer: 0)
  // Whether shutdown() was called here or (readers) the writer ended the queue.
  virtual bool shutting_down() const = 0;
  // Writer: until every local reader attached and every remote reader subscribed (then the ring's
  // name is unlinked: nothing is left in /dev/shm even if a process crashes). Readers: until the
  // subscription is up (remote) / immediately (local). Errors: timeout naming who is missing.
  virtual Status wait_until_ready(double timeout_s) = 0;

  // timeout_s < 0: wait forever (with the periodic warning); 0: one attempt.
  // Errors: timeout (naming the readers behind), peer_dead (a reader died), cancelled, invalid_argument.
  virtual Status enqueue(const Payload& p, double timeout_s) = 0;
  Status enqueue_bytes(std::span<const std::byte> bytes, double timeout_s);
  // Writer with local readers only (device_slots() > 0): enqueue, keeping `hold` until every
  // reader has read the message (the device slots of CUDA tensors left on their GPU, whose records
  // the payload carries; a reader finishes its copy out of a slot before it marks the message
  // read). Errors: as enqueue, and invalid_argument where device_slots() is 0.
  virtual Status enqueue_held(const Payload& p, double timeout_s, std::shared_ptr<const void> hold);
  // Each device arena's size where enqueue_held is available (a writer without remote readers);
  // 0 otherwise (CUDA tensors are then staged through host memory).
  virtual size_t device_slots() const { return 0; }
  // Readers. Errors: timeout, cancelled (shutdown), peer_dead (writer died), closed (dropped), corrupt.
  virtual Result<Message> dequeue(double timeout_s) = 0;
  // Zero-copy read: `fn` sees the frame in place (shared memory) before the chunk is released.
  virtual Status dequeue_with(double timeout_s, const std::function<void(std::span<const std::byte> frame)>& fn) = 0;
  // Readers: wait, at most timeout_s (< 0: forever), until the next message is there, without
  // taking it (the next dequeue then returns at once). true: it is there; false: the timeout
  // passed, or this side is shutting down with nothing left to read (dequeue says which).
  // Errors: peer_dead (the writer died), closed (dropped), invalid_argument (the writer).
  virtual Result<bool> wait_message(double timeout_s) = 0;

  // Writer: stop waiting for local reader `rank`.
  virtual Status drop_reader(uint32_t rank) = 0;
  // This side's blocked calls, and its later ones, end with `cancelled` (vLLM's semantics: a
  // reader's or the writer's shutdown is its own). `everyone` (writer): the queue ends for every
  // reader too, once it has read what was enqueued before; destroying the writer does this.
  // Idempotent.
  virtual void shutdown(bool everyone = false) = 0;
  // Counters: messages, bytes, overflow and dedicated messages, readers attached, ...
  virtual Value stats() = 0;
};

}  // namespace stagelink
