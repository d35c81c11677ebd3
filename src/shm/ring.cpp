#include "shm/ring.hpp"

#include <cstring>
#include <sched.h>

#include <thread>

#include "core/log.hpp"
#include "shm/futex.hpp"

namespace stagelink::shm {

namespace {
constexpr size_t align64(size_t v) { return (v + 63) / 64 * 64; }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spin on `ready()` for up to spin_ns, checking the clock every 64 rounds. `yield`: more
// processes than cores (the readers and the writer cannot all spin at once): after 0.5 us of pure
// spinning, give the core away on every round so the peer we wait for can run.
template <class F>
bool spin_until(F&& ready, uint64_t spin_ns, bool yield) {
  if (ready() || spin_ns == 0) return ready();  // the common case reads no clock
  const uint64_t start = mono_ns(), until = start + spin_ns;
  for (uint32_t i = 0;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if ((i & 63) == 63) {
      const uint64_t now = mono_ns();
      if (now >= until) return ready();
      if (yield && now - start > 500) sched_yield();
    }
  }
}

// The sleep half of every wait in the ring. Count yourself, read the futex word, re-check, and
// only then sleep on the word read: against wake_sleepers (publish, then read the count) either
// the waker sees us or our re-check sees its publication. `ready` includes the stop conditions.
template <class F>
bool sleep_on(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters, F&& ready, uint64_t until_ns) {
  waiters.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t seen = word.load(std::memory_order_seq_cst);
  bool ok = ready();
  if (!ok) futex_wait(&word, seen, until_ns);
  waiters.fetch_sub(1, std::memory_order_seq_cst);
  return ok || ready();
}

// The wake half on the hot path: no shared write and no system call unless someone sleeps.
void wake_sleepers(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters) {
  if (waiters.load(std::memory_order_seq_cst) != 0) {
    word.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&word);
  }
}

// State changes off the hot path (attach, leave, drop, shutdown): always move the word, so a
// waiter between its re-check and futex_wait returns at once instead of sleeping a slice.
void bump_and_wake(std::atomic<uint32_t>& word) {
  word.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&word);
}

}  // namespace

std::string describe(const std::vector<Laggard>& l) {
  std::string s;
  for (auto& g : l) {
    if (!s.empty()) s += ", ";
    s += "rank " + std::to_string(g.rank);
    if (g.pid == 0) s += " (never attached)";
    else s += " (pid " + std::to_string(g.pid) + (g.alive ? "" : ", dead") + ", read " + std::to_string(g.consumed) + ")";
  }
  return s;
}

size_t ring_bytes(const RingOptions& o) {
  return align64(sizeof(RingHeader)) + align64(sizeof(RingChunk) * o.max_chunks) +
         size_t(o.max_chunks) * align64(o.chunk_bytes);
}

Result<std::unique_ptr<Ring>> Ring::create(const std::string& dir, const std::string& name, const RingOptions& o) {
  if (o.n_readers > kRingMaxReaders)
    return make_error(Errc::invalid_argument, "at most 64 local readers, got " + std::to_string(o.n_readers));
  if (o.max_chunks < 1 || o.max_chunks > kRingMaxChunks)
    return make_error(Errc::invalid_argument, "max_chunks must be in [1, 1048576], got " + std::to_string(o.max_chunks));
  if (o.chunk_bytes < 64 || o.chunk_bytes > kRingMaxChunkBytes)
    return make_error(Errc::invalid_argument, "max_chunk_bytes must be in [64, 4 GiB], got " + std::to_string(o.chunk_bytes));
  SL_ASSIGN(auto seg, Segment::create(dir, name, ring_bytes(o), true));
  std::unique_ptr<Ring> r(new Ring());
  r->seg_ = seg;
  r->opts_ = o;
  r->writer_ = true;
  r->yield_ = o.n_readers + 1 > std::thread::hardware_concurrency();
  r->hdr_ = new (seg->data()) RingHeader();  // the segment is zero-filled: placement-new sets up atomics
  auto& h = *r->hdr_;
  h.n_readers = o.n_readers;
  h.max_chunks = o.max_chunks;
  h.chunk_bytes = align64(o.chunk_bytes);
  const ProcId me = self_proc();
  h.writer_pid = me.pid;
  h.writer_start = me.start;
  h.created_ns = now_ns();
  h.live_mask.store(r->all_mask(), std::memory_order_relaxed);
  r->map_layout();
  h.version = kRingVersion;
  std::atomic_ref<uint32_t>(h.magic).store(kRingMagic, std::memory_order_release);
  return r;
}

Result<std::unique_ptr<Ring>> Ring::attach(const std::string& dir, const std::string& name, uint32_t rank,
                                           const RingOptions& o) {
  SL_ASSIGN(auto seg, Segment::open(dir, name, true, true, sizeof(RingHeader)));
  auto* h = reinterpret_cast<RingHeader*>(seg->data());
  if (std::atomic_ref<uint32_t>(h->magic).load(std::memory_order_acquire) != kRingMagic || h->version != kRingVersion)
    return make_error(Errc::corrupt, "'" + name + "' is not a stagelink ring (bad magic or version)");
  if (h->n_readers > kRingMaxReaders || h->max_chunks < 1 || h->max_chunks > kRingMaxChunks ||
      h->chunk_bytes > kRingMaxChunkBytes || ring_bytes(RingOptions{h->n_readers, h->max_chunks, h->chunk_bytes}) > seg->size())
    return make_error(Errc::corrupt, "ring '" + name + "' header does not match its size");
  if (rank >= h->n_readers)
    return make_error(Errc::invalid_argument, "local reader rank " + std::to_string(rank) + " out of range: the ring has " +
                                                  std::to_string(h->n_readers) + " local readers");
  RingReader& me = h->readers[rank];
  uint32_t st = kReaderAbsent;
  // Two steps: take the slot (attaching), write who we are, then say attached. The writer judges
  // a reader by its pid and start only once attached: on a machine with many cores it once read
  // the pid between the claim and its store (pid 0) and named a live reader dead.
  if (!me.state.compare_exchange_strong(st, kReaderAttaching, std::memory_order_acq_rel)) {
    if (st == kReaderAttaching)
      return make_error(Errc::exists, "reader rank " + std::to_string(rank) + " of '" + name + "' is being attached");
    const uint32_t pid = me.pid.load();
    if (st == kReaderAttached && proc_alive(ProcId{pid, me.start.load()}))
      return make_error(Errc::exists, "reader rank " + std::to_string(rank) + " of '" + name + "' is already attached (pid " +
                                          std::to_string(pid) + ")");
    return make_error(Errc::invalid_argument, "reader rank " + std::to_string(rank) + " of '" + name +
                                                  "' was attached before and left or was dropped");
  }
  const ProcId self = self_proc();
  me.pid.store(self.pid, std::memory_order_relaxed);
  me.start.store(self.start, std::memory_order_relaxed);
  me.consumed.store(0, std::memory_order_relaxed);
  st = kReaderAttaching;  // a writer may have dropped us meanwhile: then we stay dropped
  me.state.compare_exchange_strong(st, kReaderAttached, std::memory_order_acq_rel);
  bump_and_wake(h->attach_seq);
  std::unique_ptr<Ring> r(new Ring());
  r->seg_ = seg;
  r->opts_ = o;
  r->hdr_ = h;
  r->rank_ = rank;
  r->yield_ = h->n_readers + 1 > std::thread::hardware_concurrency();
  r->map_layout();
  return r;
}

void Ring::map_layout() {
  chunks_ = reinterpret_cast<RingChunk*>(seg_->data() + align64(sizeof(RingHeader)));
  data_ = seg_->data() + align64(sizeof(RingHeader)) + align64(sizeof(RingChunk) * hdr_->max_chunks);
}

uint64_t Ring::slice_until(uint64_t deadline_ns) const {
  const uint64_t until = mono_ns() + opts_.liveness_ns;
  return deadline_ns && deadline_ns < until ? deadline_ns : until;
}

Ring::~Ring() {
  if (!hdr_) return;
  // Inherited through fork(): the attachment is the parent's reader (which goes on reading); only
  // the mapping goes.
  if (fork_.inherited()) return;
  if (!writer_) {
    // Leaving: the writer stops waiting for us.
    RingReader& me = hdr_->readers[rank_];
    uint32_t st = kReaderAttached;
    if (me.state.compare_exchange_strong(st, kReaderLeft, std::memory_order_acq_rel)) {
      hdr_->live_mask.fetch_and(~(1ull << rank_), std::memory_order_acq_rel);
      bump_and_wake(hdr_->free_seq);
      bump_and_wake(hdr_->attach_seq);
    }
  }
}

std::byte* Ring::data(RingChunk* c) { return data_ + size_t(c - chunks_) * hdr_->chunk_bytes; }

// seq_cst loads: they pair with the readers' seq_cst release (see release_read).
bool Ring::chunk_free(RingChunk* c) const {
  if (c->seq.load(std::memory_order_seq_cst) == 0) return true;
  const uint64_t live = hdr_->live_mask.load(std::memory_order_seq_cst);
  return ((c->read_mask.load(std::memory_order_seq_cst) | ~live) & all_mask()) == all_mask();
}

bool Ring::chunk_done(uint64_t seq) {
  RingChunk* c = chunk(seq);
  const uint64_t s = c->seq.load(std::memory_order_acquire);
  if (s != seq + 1) return s > seq + 1;  // reused since: it was done
  return chunk_free(c);
}

std::vector<Laggard> Ring::laggards_for(RingChunk* c) const {
  std::vector<Laggard> out;
  const uint64_t live = hdr_->live_mask.load(std::memory_order_acquire);
  const uint64_t mask = c->read_mask.load(std::memory_order_acquire);
  for (uint32_t r = 0; r < hdr_->n_readers; ++r) {
    if (!(live >> r & 1) || (mask >> r & 1)) continue;
    const RingReader& rd = hdr_->readers[r];
    Laggard g{r, rank_name(r), 0, false, rd.consumed.load(std::memory_order_relaxed)};
    if (rd.state.load(std::memory_order_acquire) == kReaderAttached) {
      g.pid = rd.pid.load(std::memory_order_relaxed);
      g.alive = proc_alive(ProcId{g.pid, rd.start.load(std::memory_order_relaxed)});
    } else {
      g.alive = true;  // not attached yet: not dead
    }
    out.push_back(g);
  }
  return out;
}

Result<RingChunk*> Ring::acquire_write(uint64_t deadline_ns, bool drop_dead, uint64_t warn_ns,
                                       const std::function<void(const std::vector<Laggard>&, double)>& on_blocked) {
  RingChunk* c = chunk(wseq_);
  if (spin_until([&] { return chunk_free(c) || is_shutdown(); }, opts_.spin_ns, yield_)) {
    if (is_shutdown()) return make_error(Errc::cancelled, "cancelled: message queue was shut down");
    blocked_seq_ = ~0ull;
    return c;
  }
  // A caller that waits in several calls back to back (Python waits in slices, to run signal
  // handlers) goes on with the same clock for the same message: the warnings and the timeout's
  // "after" count from when this message first blocked. A call after a pause starts anew.
  const uint64_t entered = mono_ns();
  if (blocked_seq_ != wseq_ || entered - blocked_left_ > 1'000'000'000ull) {
    blocked_seq_ = wseq_;
    blocked_t0_ = entered;
    blocked_next_warn_ = warn_ns ? blocked_t0_ + warn_ns : 0;
  }
  const uint64_t t0 = blocked_t0_;
  uint64_t& next_warn = blocked_next_warn_;
  for (;;) {
    uint64_t until = slice_until(deadline_ns);
    if (next_warn && next_warn < until) until = next_warn;
    sleep_on(hdr_->free_seq, hdr_->free_waiters, [&] { return chunk_free(c) || stopping(); }, until);
    const uint64_t now = mono_ns();
    if (stopping()) return make_error(Errc::cancelled, "cancelled: message queue was shut down");
    if (chunk_free(c)) {
      blocked_seq_ = ~0ull;
      return c;
    }
    // Still blocked: who is behind, and are they alive?
    auto lag = laggards_for(c);
    SL_TRY(handle_dead(lag, drop_dead));
    if (chunk_free(c)) {
      blocked_seq_ = ~0ull;
      return c;
    }
    if (next_warn && now >= next_warn) {
      if (on_blocked) on_blocked(lag, double(now - t0) / 1e9);
      next_warn = now + warn_ns;
    }
    if (deadline_ns && now >= deadline_ns) {
      blocked_left_ = now;
      return make_error(Errc::timeout, "message queue " + name() + ": message " + std::to_string(wseq_) +
                                           " has no free chunk after " + std::to_string(double(now - t0) / 1e9) +
                                           " s; not caught up: " + describe(lag));
    }
  }
}

Status Ring::handle_dead(const std::vector<Laggard>& lag, bool drop_dead) {
  for (auto& g : lag) {
    if (g.alive) continue;
    if (!drop_dead)
      return make_error(Errc::peer_dead, "message queue " + name() + ": reader rank " + std::to_string(g.rank) +
                                             " (pid " + std::to_string(g.pid) + ") died; drop_reader(" +
                                             std::to_string(g.rank) + ") to go on without it");
    SL_LOG_WARN("message queue %s: reader rank %u (pid %u) died; dropping it", name().c_str(), g.rank, g.pid);
    (void)drop_reader(g.index, "died");
  }
  return {};
}

void Ring::publish(RingChunk* c, uint64_t len, RingMsgKind kind, uint64_t ov_offset) {
  c->len = len;
  c->kind = kind;
  c->ov_offset = ov_offset;
  c->read_mask.store(0, std::memory_order_relaxed);
  // seq_cst store, then the waiter count: either we see a sleeper (and bump + wake), or the
  // sleeper's re-check, ordered after its count, sees this store. No shared write otherwise.
  c->seq.store(wseq_ + 1, std::memory_order_seq_cst);
  ++wseq_;
  wake_sleepers(hdr_->pub_seq, hdr_->pub_waiters);
}

Status Ring::drop_reader(uint32_t rank, const char* why) {
  if (rank >= hdr_->n_readers) return make_error(Errc::invalid_argument, "no local reader rank " + std::to_string(rank));
  hdr_->live_mask.fetch_and(~(1ull << rank), std::memory_order_acq_rel);
  RingReader& rd = hdr_->readers[rank];
  uint32_t st = rd.state.load();
  while (st != kReaderLeft && st != kReaderDropped && !rd.state.compare_exchange_weak(st, kReaderDropped)) {
  }
  SL_LOG_INFO("message queue %s: reader rank %u dropped (%s)", name().c_str(), rank_name(rank), why);
  bump_and_wake(hdr_->pub_seq);  // a dropped reader that is still alive and blocked learns it now
  return {};
}

uint32_t Ring::attached_count() const {
  uint32_t n = 0;
  for (uint32_t r = 0; r < hdr_->n_readers; ++r)
    if (hdr_->readers[r].state.load(std::memory_order_acquire) != kReaderAbsent) ++n;
  return n;
}

void Ring::wait_attach(uint32_t seen, uint64_t deadline_ns) { futex_wait(&hdr_->attach_seq, seen, slice_until(deadline_ns)); }

bool Ring::wait_free_until(const std::function<bool()>& done, uint64_t deadline_ns) {
  bool ok = false;
  sleep_on(hdr_->free_seq, hdr_->free_waiters, [&] { return (ok = ok || done()) || stopping(); },
           slice_until(deadline_ns));
  return ok;
}

std::vector<Laggard> Ring::oldest_laggards() {
  for (uint64_t s = wseq_ > hdr_->max_chunks ? wseq_ - hdr_->max_chunks : 0; s < wseq_; ++s)
    if (!chunk_done(s)) return laggards_for(chunk(s));
  return {};
}

bool Ring::still_valid(RingChunk* c) const {
  // A read-modify-write with release order keeps the data reads before it (a plain load would
  // not); ThreadSanitizer models it, where it does not model a standalone fence.
  return c->seq.fetch_add(0, std::memory_order_acq_rel) == rseq_ + 1;
}

bool Ring::writer_alive() const { return proc_alive(ProcId{hdr_->writer_pid, hdr_->writer_start}); }

Status Ring::wait_read(uint64_t deadline_ns) {
  auto ready = [&] { return next_ready(); };
  auto dropped = [&] { return hdr_->readers[rank_].state.load(std::memory_order_acquire) == kReaderDropped; };
  if (spin_until([&] { return ready() || is_shutdown(); }, opts_.spin_ns, yield_) && ready()) return {};
  for (;;) {
    sleep_on(hdr_->pub_seq, hdr_->pub_waiters, [&] { return ready() || stopping() || dropped(); },
             slice_until(deadline_ns));
    if (ready()) return {};  // pending messages are delivered even after a shutdown
    if (dropped()) return make_error(Errc::closed, "reader rank " + std::to_string(rank_name(rank_)) + " was dropped by the writer");
    if (stopping()) return make_error(Errc::cancelled, "cancelled: message queue was shut down");
    const uint64_t now = mono_ns();
    if (!writer_alive())
      return make_error(Errc::peer_dead, "message queue " + name() + ": the writer (pid " +
                                             std::to_string(hdr_->writer_pid) + ") died");
    if (deadline_ns && now >= deadline_ns)
      return make_error(Errc::timeout, "message queue " + name() + ": no message " + std::to_string(rseq_) +
                                           " for reader rank " + std::to_string(rank_name(rank_)) + " before the timeout (writer pid " +
                                           std::to_string(hdr_->writer_pid) + " alive)");
  }
}

Result<RingChunk*> Ring::acquire_read(uint64_t deadline_ns) {
  SL_TRY(wait_read(deadline_ns));
  return chunk(rseq_);
}

void Ring::release_read(RingChunk* c) {
  c->read_mask.fetch_or(1ull << rank_, std::memory_order_seq_cst);
  ++rseq_;
  hdr_->readers[rank_].consumed.store(rseq_, std::memory_order_release);
  wake_sleepers(hdr_->free_seq, hdr_->free_waiters);
}

// Both move every word (not only wake): a waiter between its re-check and futex_wait would
// otherwise sleep a whole slice. cancel_local wakes the other processes' waiters too; they
// re-check and sleep again.
void Ring::cancel_local() {
  local_cancel_.store(true, std::memory_order_seq_cst);
  wake_all_words();
}

void Ring::shutdown() {
  hdr_->shutdown.store(1, std::memory_order_seq_cst);
  wake_all_words();
}

void Ring::wake_all_words() {
  bump_and_wake(hdr_->pub_seq);
  bump_and_wake(hdr_->free_seq);
  bump_and_wake(hdr_->attach_seq);
}

}  // namespace stagelink::shm
