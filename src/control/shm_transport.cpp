// ControlInbox / ControlOutbox over shared memory, for stages on one host: `shm://NAME`.
//
// The inbox owns one segment (/dev/shm/sl.<uid>.ci.NAME): a byte ring that any number of
// outboxes (processes) append records to and the inbox alone reads. A record is a 16-byte header
// { commit: u64 = len << 1 | 1, claim: u64 = pid << 32 | len } followed by the message, padded to
// 16 bytes; a record never wraps (a producer that would cross the end reserves the tail as a
// padding record in the same step).
//
//   producer: CAS tail from t to t + need, if need fits beside head (else wait for room);
//             write claim, bytes, then commit (seq_cst); if the reader sleeps: bump doorbell, wake
//   reader:   commit at head (seq_cst load) != 0 -> read; zero the record; head += size
//             (release); if producers wait for room: bump space, wake
// Waiting spins briefly, then sleeps on a futex with the same publish / look-at-sleepers pairing
// as the message queue's ring (no lost wake-up; no system call when nobody sleeps). A producer
// that died between its reservation and its commit is skipped once its claim names a dead pid.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstddef>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "control/shm_transport.hpp"
#include "control/counted.hpp"
#include "core/proc.hpp"
#include "shm/futex.hpp"
#include "shm/segment.hpp"
#include "stagelink/shm.hpp"

namespace stagelink {
namespace {

constexpr uint32_t kMagic = 0x49435453;  // "STCI"
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kRingBytes = 4u << 20;
constexpr size_t kRecHeader = 16;
// Spin this long before sleeping (a reply in a ping-pong arrives within it: no futex round trip).
// STAGELINK_CONTROL_SPIN_US overrides it (0: sleep at once, best when cores are oversubscribed).
uint64_t spin_ns() {
  static const uint64_t v = [] {
    const char* e = std::getenv("STAGELINK_CONTROL_SPIN_US");
    return e ? uint64_t(std::strtoull(e, nullptr, 10)) * 1000 : uint64_t(50'000);
  }();
  return v;
}

struct alignas(64) InboxHeader {
  std::atomic<uint32_t> magic;  // set last: openers wait for it
  uint32_t version;
  uint64_t capacity;
  uint32_t owner_pid;
  uint32_t pad0;
  uint64_t owner_start;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleeping;
  std::atomic<uint32_t> closed;
  alignas(64) std::atomic<uint32_t> space;
  std::atomic<uint32_t> space_waiters;
};
static_assert(sizeof(InboxHeader) <= kHeaderBytes);
// `stagelink shm ls/reap` read the owner at these offsets (src/shm/admin.cpp).
static_assert(offsetof(InboxHeader, owner_pid) == 16 && offsetof(InboxHeader, owner_start) == 24);

struct RecHeader {
  std::atomic<uint64_t> commit;
  std::atomic<uint64_t> claim;
};
static_assert(sizeof(RecHeader) == kRecHeader);

size_t round16(size_t n) { return (n + 15) & ~size_t(15); }

Status check_name(const std::string& name) {
  if (name.empty() || name.size() > 100)
    return make_error(Errc::invalid_argument, "shm control endpoint name must be 1-100 characters");
  for (char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.')
      return make_error(Errc::invalid_argument, "shm control endpoint 'shm://" + name +
                                                    "' may hold only letters, digits, '-', '_' and '.'");
  return {};
}

std::string seg_name(const std::string& name) { return shm::user_prefix() + "ci." + name; }

InboxHeader* header_of(const std::shared_ptr<shm::Segment>& s) { return reinterpret_cast<InboxHeader*>(s->data()); }
RecHeader* rec_at(const std::shared_ptr<shm::Segment>& s, uint64_t pos, uint64_t cap) {
  return reinterpret_cast<RecHeader*>(s->data() + kHeaderBytes + (pos % cap));
}

class ShmInbox final : public ControlInbox {
 public:
  ~ShmInbox() override { close(); }

  Status init(const std::string& endpoint, const std::string& name) {
    SL_TRY(check_name(name));
    endpoint_ = endpoint;
    name_ = seg_name(name);
    SL_ASSIGN(seg_, shm::Segment::create("/dev/shm", name_, kHeaderBytes + kRingBytes, true));
    auto* h = new (seg_->data()) InboxHeader();
    h->version = kVersion;
    h->capacity = kRingBytes;
    const ProcId me = self_proc();
    h->owner_pid = me.pid;
    h->owner_start = me.start;
    h->magic.store(kMagic, std::memory_order_release);
    hdr_ = h;
    return {};
  }

  const std::string& endpoint() const override { return endpoint_; }

  Result<ControlMessage> recv(double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.load() || !seg_) return make_error(Errc::closed, "control inbox is closed");
    const uint64_t start = mono_ns();
    const uint64_t deadline = deadline_ns(timeout_s, start);
    const uint64_t cap = hdr_->capacity;
    uint64_t stuck_since = 0;
    for (uint32_t spins = 0;; ++spins) {
      const uint64_t head = hdr_->head.load(std::memory_order_relaxed);
      RecHeader* r = rec_at(seg_, head, cap);
      const uint64_t c = r->commit.load(std::memory_order_seq_cst);
      if (c) {
        const uint64_t len = r->claim.load(std::memory_order_relaxed) & 0xffffffffu;
        std::optional<Result<ControlMessage>> m = take(head, r, c >> 1, len, true);
        if (m) return counted(std::move(*m));
        continue;  // a padding record
      }
      if (closed_.load()) return make_error(Errc::closed, "control inbox was closed");
      const uint64_t now = mono_ns();
      // A reservation not committed: its producer may have died mid-write.
      if (hdr_->tail.load(std::memory_order_acquire) != head) {
        if (!stuck_since) {
          stuck_since = now;
        } else if (now - stuck_since > 100'000'000ull) {
          const uint64_t cl = r->claim.load(std::memory_order_acquire);
          if (cl && !proc_alive(ProcId{uint32_t(cl >> 32), 0})) {
            const uint64_t len = cl & 0xffffffffu;
            const uint64_t size = len ? kRecHeader + round16(len) : cap - head % cap;
            std::optional<Result<ControlMessage>> m = take(head, r, size, len, false);
            stuck_since = 0;
            if (m) return counted(std::move(*m));
            continue;
          }
        }
      } else {
        stuck_since = 0;
      }
      if (deadline && now >= deadline)
        return make_error(Errc::timeout, "no control message on " + endpoint_ + " within " +
                                             std::to_string(timeout_s) + " s");
      if (now - start < spin_ns()) {
        if ((spins & 63) == 63) std::this_thread::yield();
        continue;
      }
      // Sleep: announce, re-check, wait on the doorbell (at most 100 ms: dead-producer checks).
      const uint32_t seen = hdr_->doorbell.load(std::memory_order_seq_cst);
      hdr_->sleeping.store(1, std::memory_order_seq_cst);
      if (!r->commit.load(std::memory_order_seq_cst) && !closed_.load()) {
        uint64_t until = now + 100'000'000ull;
        if (deadline) until = std::min(until, deadline);
        shm::futex_wait(&hdr_->doorbell, seen, until);
      }
      hdr_->sleeping.store(0, std::memory_order_relaxed);
    }
  }

  void close() override {
    if (closed_.exchange(true)) return;
    if (hdr_) {
      hdr_->closed.store(1, std::memory_order_seq_cst);
      hdr_->doorbell.fetch_add(1, std::memory_order_seq_cst);
      shm::futex_wake_all(&hdr_->doorbell);
      hdr_->space.fetch_add(1, std::memory_order_seq_cst);
      shm::futex_wake_all(&hdr_->space);
    }
    std::lock_guard<std::mutex> lock(mu_);  // after a blocked recv saw the wake-up
    if (seg_) shm::Segment::unlink("/dev/shm", name_);
    seg_.reset();
    hdr_ = nullptr;
  }

 private:
  // Consume the record at `head`: `size` bytes in all, `len` of them a message (0: padding, no
  // message: nullopt). A producer that died mid-write gives a `corrupt` error (dropped).
  std::optional<Result<ControlMessage>> take(uint64_t head, RecHeader* r, uint64_t size, uint64_t len,
                                             bool committed) {
    const uint64_t cap = hdr_->capacity;
    if (size < kRecHeader || size % 16 || (head % cap) + size > cap || len > size - kRecHeader) {
      // A header no producer of ours writes: drop what is in the ring rather than read past it.
      const uint64_t tail = hdr_->tail.load(std::memory_order_acquire);
      std::memset(seg_->data() + kHeaderBytes, 0, cap);
      hdr_->head.store(tail, std::memory_order_seq_cst);
      return Result<ControlMessage>(make_error(Errc::corrupt, "control inbox " + endpoint_ +
                                                                  ": a record header out of bounds (ring dropped)"));
    }
    std::optional<Result<ControlMessage>> m;
    if (len) {
      if (committed)
        m = decode_control(std::span<const std::byte>(reinterpret_cast<const std::byte*>(r) + kRecHeader, len));
      else
        m = Result<ControlMessage>(make_error(Errc::corrupt, "control message from a producer that died mid-write (dropped)"));
    }
    std::memset(static_cast<void*>(r), 0, size);  // free: every future header position reads 0
    hdr_->head.store(head + size, std::memory_order_seq_cst);
    if (hdr_->space_waiters.load(std::memory_order_seq_cst)) {
      hdr_->space.fetch_add(1, std::memory_order_seq_cst);
      shm::futex_wake_all(&hdr_->space);
    }
    return m;
  }

  std::mutex mu_;
  std::atomic<bool> closed_{false};
  std::shared_ptr<shm::Segment> seg_;
  InboxHeader* hdr_ = nullptr;
  std::string endpoint_, name_;
};

class ShmOutbox final : public ControlOutbox {
 public:
  ~ShmOutbox() override { close(); }
  Status init(const std::string& endpoint, const std::string& name) {
    SL_TRY(check_name(name));
    endpoint_ = endpoint;
    name_ = seg_name(name);
    return {};
  }
  Status send_bytes(std::span<const std::byte> bytes, double timeout_s) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return make_error(Errc::closed, "control outbox is closed");
    const uint64_t deadline = deadline_ns(timeout_s, mono_ns());
    SL_TRY(open_locked(deadline));
    InboxHeader* h = header_of(seg_);
    const uint64_t cap = h->capacity;
    const size_t len = bytes.size();
    if (len == 0 || len > cap / 2)
      return make_error(Errc::invalid_argument, "control message of " + std::to_string(len) + " bytes for " +
                                                    endpoint_ + "; 1 to " + std::to_string(cap / 2) + " fit");
    const uint64_t size = kRecHeader + round16(len);
    const ProcId me = self_proc();
    for (;;) {
      if (h->closed.load(std::memory_order_acquire))
        return make_error(Errc::closed, "control inbox " + endpoint_ + " was closed");
      uint64_t tail = h->tail.load(std::memory_order_acquire);
      const uint64_t off = tail % cap;
      const uint64_t pad = off + size > cap ? cap - off : 0;  // the record would cross the end
      const uint64_t head = h->head.load(std::memory_order_acquire);
      if (tail + pad + size - head <= cap) {
        if (!h->tail.compare_exchange_weak(tail, tail + pad + size, std::memory_order_acq_rel)) continue;
        if (pad) {  // a padding record to the end: committed with len 0
          RecHeader* p = rec_at(seg_, tail, cap);
          p->claim.store(uint64_t(me.pid) << 32, std::memory_order_relaxed);
          p->commit.store(pad << 1 | 1, std::memory_order_seq_cst);
        }
        RecHeader* r = rec_at(seg_, tail + pad, cap);
        r->claim.store(uint64_t(me.pid) << 32 | len, std::memory_order_relaxed);
        std::memcpy(reinterpret_cast<std::byte*>(r) + kRecHeader, bytes.data(), len);
        r->commit.store(size << 1 | 1, std::memory_order_seq_cst);
        if (h->sleeping.load(std::memory_order_seq_cst)) {
          h->doorbell.fetch_add(1, std::memory_order_seq_cst);
          shm::futex_wake_all(&h->doorbell);
        }
        return {};
      }
      // Full: wait for the reader to free room (or notice it is gone).
      const uint64_t now = mono_ns();
      if (deadline && now >= deadline)
        return make_error(Errc::timeout, "control message to " + endpoint_ + " not taken within " +
                                             std::to_string(timeout_s) + " s (is the stage alive?)");
      if (!proc_alive(ProcId{h->owner_pid, h->owner_start}))
        return make_error(Errc::peer_dead, "the process of control inbox " + endpoint_ + " (pid " +
                                               std::to_string(h->owner_pid) + ") is gone");
      const uint32_t seen = h->space.load(std::memory_order_seq_cst);
      h->space_waiters.fetch_add(1, std::memory_order_seq_cst);
      if (h->head.load(std::memory_order_seq_cst) == head) {
        uint64_t until = now + 100'000'000ull;
        if (deadline) until = std::min(until, deadline);
        shm::futex_wait(&h->space, seen, until);
      }
      h->space_waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    seg_.reset();  // what was sent is in the ring already: nothing to flush
  }

 private:
  // Map the inbox's ring, waiting for it to be created (a peer may start after us).
  Status open_locked(uint64_t deadline) {
    if (seg_) return {};
    for (uint32_t i = 0;; ++i) {
      auto s = shm::Segment::open("/dev/shm", name_, true, false, kHeaderBytes);
      if (s.ok() && header_of(s.value())->magic.load(std::memory_order_acquire) == kMagic) {
        InboxHeader* h = header_of(s.value());
        if (h->version != kVersion || h->capacity == 0 || kHeaderBytes + h->capacity > s.value()->size())
          return make_error(Errc::corrupt, "control inbox " + endpoint_ + " has an unknown layout");
        seg_ = std::move(s).value();
        return {};
      }
      // Absent, or being created (still short of its header, or its magic not set): wait.
      if (!s.ok() && s.error().code != Errc::not_found && s.error().code != Errc::corrupt)
        return std::move(s).error();
      if (deadline && mono_ns() >= deadline)
        return make_error(Errc::timeout, "no control inbox at " + endpoint_ + " (not bound yet, or gone)");
      std::this_thread::sleep_for(std::chrono::microseconds(i < 100 ? 100 : 2000));
    }
  }

  std::mutex mu_;
  bool closed_ = false;
  std::shared_ptr<shm::Segment> seg_;
  std::string endpoint_, name_;
};

}  // namespace

Result<std::unique_ptr<ControlInbox>> bind_shm_inbox(const std::string& endpoint) {
  auto in = std::make_unique<ShmInbox>();
  SL_TRY(in->init(endpoint, endpoint.substr(6)));
  return std::unique_ptr<ControlInbox>(std::move(in));
}

Result<std::unique_ptr<ControlOutbox>> connect_shm_outbox(const std::string& endpoint) {
  auto out = std::make_unique<ShmOutbox>();
  SL_TRY(out->init(endpoint, endpoint.substr(6)));
  return std::unique_ptr<ControlOutbox>(std::move(out));
}

}  // namespace stagelink
