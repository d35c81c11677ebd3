// The broadcast ring: one writer, up to 64 local readers, `max_chunks` chunks in shared memory.
//
// Each chunk carries `seq` (0: never written; else the message number + 1: the "written flag")
// and `read_mask` (one bit per reader rank: the reader flags). The writer may reuse a chunk when
// every live reader's bit is set; readers never overtake the writer because chunk k holds message
// k + i*max_chunks and a reader waits for exactly the seq it expects next.
//
// Ordering (every access is a std::atomic with an explicit order; correct on x86 and ARM):
//   writer: wait until (read_mask | ~live) covers all   [seq_cst loads: readers' reads happen-before]
//           read_mask = 0 (relaxed); write the bytes; seq = n + 1 (seq_cst store)
//           if pub_waiters: pub_seq++, futex wake
//   reader: wait until seq == n + 1                    [seq_cst load: the bytes are visible]
//           read the bytes; read_mask |= bit (seq_cst RMW)
//           if free_waiters: free_seq++, futex wake
// Waiting spins for `spin_ns`, then sleeps on pub_seq / free_seq (futex). The Dekker pairing
// "publish (seq_cst), then look at the waiter count" against "count yourself, read the futex
// word, re-check (seq_cst), then sleep on the word": either the publisher sees the sleeper and
// bumps + wakes, or the sleeper's re-check sees the publication. No lost wake-up, and when
// nobody sleeps the hot path writes no shared counter and makes no system call.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/proc.hpp"
#include "shm/segment.hpp"
#include "stagelink/result.hpp"

namespace stagelink::shm {

inline constexpr uint32_t kRingMagic = 0x474e5253;  // "SRNG"
inline constexpr uint32_t kRingVersion = 1;
inline constexpr uint32_t kRingMaxReaders = 64;
inline constexpr uint32_t kRingMaxChunks = 1u << 20;
inline constexpr uint64_t kRingMaxChunkBytes = 1ull << 32;

// kReaderAttaching: the slot is taken and its pid/start are being written; a writer treats it as
// alive (its identity is not readable yet), and it becomes kReaderAttached with a release store.
enum ReaderState : uint32_t { kReaderAbsent = 0, kReaderAttached = 1, kReaderDropped = 2, kReaderLeft = 3,
                              kReaderAttaching = 4 };

struct alignas(64) RingReader {
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> pid;
  std::atomic<uint64_t> start;
  std::atomic<uint64_t> consumed;  // messages this reader has released
};

struct alignas(64) RingChunk {
  std::atomic<uint64_t> seq;        // 0: empty; else message number + 1
  std::atomic<uint64_t> read_mask;  // bit r: reader r is done with it
  uint64_t len;                     // bytes in the data area (or of the out-of-line message)
  uint32_t kind;                    // RingMsgKind
  uint32_t reserved;
  uint64_t ov_offset;               // kOverflow: offset in the overflow arena
  uint64_t pad[3];
};
static_assert(sizeof(RingChunk) == 64);

enum RingMsgKind : uint32_t { kInline = 0, kOverflow = 1, kDedicated = 2 /* data area holds the segment name */ };

struct RingHeader {
  uint32_t magic, version;
  uint32_t n_readers, max_chunks;
  uint64_t chunk_bytes;     // data bytes per chunk
  uint64_t overflow_bytes;  // 0: no overflow arena
  uint32_t writer_pid;
  uint32_t pad0;
  uint64_t writer_start;
  uint64_t created_ns;
  char overflow_name[96];
  alignas(64) std::atomic<uint32_t> pub_seq;
  std::atomic<uint32_t> pub_waiters;
  alignas(64) std::atomic<uint32_t> free_seq;
  std::atomic<uint32_t> free_waiters;
  alignas(64) std::atomic<uint32_t> attach_seq;  // bumped on attach/detach (writer's wait_until_ready)
  std::atomic<uint32_t> shutdown;
  std::atomic<uint64_t> live_mask;               // readers the writer waits for
  alignas(64) RingReader readers[kRingMaxReaders];
};

struct RingOptions {
  uint32_t n_readers = 1;
  uint32_t max_chunks = 10;
  size_t chunk_bytes = 1u << 20;
  uint64_t spin_ns = 50'000;       // spin before sleeping in the kernel
  uint64_t liveness_ns = 500'000'000;  // how often a sleeping waiter checks its peers are alive
};

// Who a blocked wait is waiting for, for error messages and warnings.
struct Laggard {
  uint32_t index;    // local reader index in the ring
  uint32_t rank;     // the queue's rank of that reader (see set_rank_names)
  uint32_t pid;      // 0: never attached
  bool alive;
  uint64_t consumed;
};

class Ring {
 public:
  // Writer: create the segment `name` under `dir`.
  static Result<std::unique_ptr<Ring>> create(const std::string& dir, const std::string& name,
                                              const RingOptions& o);
  // Reader `rank`: attach to an existing ring.
  static Result<std::unique_ptr<Ring>> attach(const std::string& dir, const std::string& name,
                                              uint32_t rank, const RingOptions& o);
  ~Ring();

  RingHeader& header() { return *hdr_; }
  const std::string& name() const { return seg_->name(); }
  uint32_t n_readers() const { return hdr_->n_readers; }
  size_t chunk_bytes() const { return hdr_->chunk_bytes; }

  // ---- writer ----
  // Wait until the next chunk is free. `on_blocked(laggards, waited_s)` runs every `warn_ns`
  // while blocked (0: never). Errors: timeout / peer_dead (naming the readers), cancelled.
  // `drop_dead`: a dead reader is dropped (with a warning) instead of failing.
  Result<RingChunk*> acquire_write(uint64_t deadline_ns, bool drop_dead, uint64_t warn_ns,
                                   const std::function<void(const std::vector<Laggard>&, double)>& on_blocked);
  std::byte* data(RingChunk* c);
  // Publish the acquired chunk as message number next_seq(); advances it.
  void publish(RingChunk* c, uint64_t len, RingMsgKind kind, uint64_t ov_offset);
  uint64_t next_seq() const { return wseq_; }
  // The chunk that message `seq` used, if every live reader has finished it (writer reclaim).
  bool chunk_done(uint64_t seq);
  // Stop waiting for reader `rank` (dead or too slow); its later dequeues fail.
  Status drop_reader(uint32_t rank, const char* why);
  // Local readers attached (state attached), and the mask the writer waits for.
  uint32_t attached_count() const;
  // Wait until attach_seq moves (a reader attached or left) or the deadline.
  void wait_attach(uint32_t seen, uint64_t deadline_ns);
  std::vector<Laggard> laggards_for(RingChunk* c) const;
  // The dead-reader policy: a dead one among `lag` is a peer_dead error, or (drop_dead) dropped.
  Status handle_dead(const std::vector<Laggard>& lag, bool drop_dead);
  // Ranks to report for local indexes 0..n-1 in errors and warnings (default: the index).
  void set_rank_names(std::vector<uint32_t> ranks) { rank_names_ = std::move(ranks); }
  // Writer: run `done` (e.g. reclaim and allocate); if it fails, sleep until a reader releases
  // a chunk, the deadline, or a liveness slice. Returns what `done` returned.
  bool wait_free_until(const std::function<bool()>& done, uint64_t deadline_ns);
  // Laggards of the oldest unfinished message (for errors while waiting for overflow room).
  std::vector<Laggard> oldest_laggards();

  // ---- reader ----
  // Wait for the next message. Errors: timeout, cancelled (shutdown), peer_dead (writer died),
  // closed (this reader was dropped).
  Result<RingChunk*> acquire_read(uint64_t deadline_ns);
  // Wait for the next message without taking it (acquire_read then returns at once): the same
  // errors.
  Status wait_read(uint64_t deadline_ns);
  // Whether the next message is there (one load: no spin, no clock, no liveness check).
  bool next_ready() const { return chunks_[rseq_ % hdr_->max_chunks].seq.load(std::memory_order_seq_cst) == rseq_ + 1; }
  void release_read(RingChunk* c);
  // After copying a chunk's bytes: is it still the message we acquired? False only when the
  // writer dropped this reader and reused the chunk meanwhile (the copy may be torn).
  bool still_valid(RingChunk* c) const;
  uint64_t read_seq() const { return rseq_; }
  uint32_t rank() const { return rank_; }
  // Wake this process's blocked waits (local shutdown of one side).
  void cancel_local();

  // ---- both ----
  void shutdown();  // everyone: blocked waits fail with cancelled
  bool is_shutdown() const { return hdr_->shutdown.load(std::memory_order_acquire) != 0; }
  // Shut down for everyone, or cancelled in this process (cancel_local).
  bool stopping() const { return is_shutdown() || local_cancel_.load(std::memory_order_seq_cst); }
  bool writer_alive() const;

 private:
  Ring() = default;
  RingChunk* chunk(uint64_t seq) { return chunks_ + (seq % hdr_->max_chunks); }
  uint64_t all_mask() const {
    return hdr_->n_readers >= 64 ? ~0ull : ((1ull << hdr_->n_readers) - 1);
  }
  bool chunk_free(RingChunk* c) const;
  void map_layout();                                  // chunks_ and data_ from the header
  uint64_t slice_until(uint64_t deadline_ns) const;   // min(deadline, now + liveness slice)
  void wake_all_words();

  std::shared_ptr<Segment> seg_;
  RingHeader* hdr_ = nullptr;
  RingChunk* chunks_ = nullptr;
  std::byte* data_ = nullptr;
  RingOptions opts_;
  bool writer_ = false;
  uint32_t rank_ = 0;
  ForkStamp fork_;  // a Ring inherited through fork() leaves nothing on destruction
  uint64_t wseq_ = 0;  // writer: next message number
  // writer: the message whose acquire_write last blocked, since when, and its next warning
  uint64_t blocked_seq_ = ~0ull, blocked_t0_ = 0, blocked_next_warn_ = 0, blocked_left_ = 0;
  uint64_t rseq_ = 0;  // reader: next message number
  std::atomic<bool> local_cancel_{false};
  bool yield_ = false;  // more processes than cores: yield while spinning
  std::vector<uint32_t> rank_names_;
  uint32_t rank_name(uint32_t index) const { return index < rank_names_.size() ? rank_names_[index] : index; }
};

// "rank 1 (pid 42, read 17), rank 3 (never attached)" for errors and warnings.
std::string describe(const std::vector<Laggard>& l);

// Bytes a ring of these options occupies.
size_t ring_bytes(const RingOptions& o);

}  // namespace stagelink::shm
