// SharedMemoryConnector's implementation, shared by shm_connector.cpp (puts, gets, the arena,
// reclaiming) and shm_loan.cpp (loans: writing in place, then publishing). Internal.
#pragma once
#include "connectors/shm_connector.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "connectors/capabilities.hpp"
#include "connectors/internal_key.hpp"
#include "connectors/names.hpp"
#include "core/log.hpp"
#include "core/options.hpp"
#include "stagelink/allocator.hpp"
#include "core/proc.hpp"
#include "shm/directory.hpp"

namespace stagelink {

using shm::Claim;
using shm::Directory;
using shm::Segment;

namespace shmc {
inline std::atomic<uint32_t> g_segment_counter{0};  // segments this process made (their names)

// Held by a zero-copy payload: keeps the claim (and the mapping) until the last view is dropped.
// Non-copyable: a copied or moved-from temporary would release the slot early (a bug the
// ReaderDyingMidRead test caught: the view was freed while still in use).
struct Lease {
  Lease(std::shared_ptr<Directory> d, std::shared_ptr<Segment> s, Claim c)
      : dir(std::move(d)), seg(std::move(s)), claim(c) {}
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() { dir->release(claim); }
  std::shared_ptr<Directory> dir;
  std::shared_ptr<Segment> seg;
  Claim claim;
};

}  // namespace shmc
using shmc::Lease;
using shmc::g_segment_counter;

class ShmConnector;
// Loans point back to their connector through this gate, cleared by close(): a loan dropped after
// its connector closed (or was destroyed) returns nothing instead of touching freed memory.
struct LoanGate {
  std::mutex mu;
  ShmConnector* owner = nullptr;
};

namespace shmc {
struct Outstanding {
  uint32_t idx, gen;
  size_t offset, length;
  std::shared_ptr<Segment> dedicated;  // null: lives in the arena
  uint32_t arena_idx, arena_gen;
  uint64_t created_ns;
  std::shared_ptr<const void> hold;  // PutHooks::hold: device slots, dropped when the entry is reclaimed
};

// The internal key on the stack: validate_edge bounds it by an entry's key field, and a key past
// 15 bytes costs no heap allocation (make_internal_key's string would).
class InternalKey {
 public:
  InternalKey(const std::string& key, const std::string& from, const std::string& to)
      : len_(internal_key_size(key, from, to)) {
    write_internal_key(buf_, key, from, to);
  }
  operator std::string_view() const { return {buf_, len_}; }
  std::string str() const { return std::string(buf_, len_); }

 private:
  char buf_[shm::kKeyMax];
  size_t len_;
};
}  // namespace shmc
using shmc::InternalKey;
using shmc::Outstanding;

class ShmConnector final : public Connector,
                           public Lending,
                           public WaitingGets,
                           public ArrivalSignals,
                           public ReleaseTracking,
                           public BindingFields {
 public:
  explicit ShmConnector(ShmConnectorOptions o)
      : opts_(std::move(o)), gate_(std::make_shared<LoanGate>()), metrics_(*this), metrics_reg_(&metrics_) {
    gate_->owner = this;
  }
  ~ShmConnector() override { close(); }

  Status init();

  const std::string& name() const override { return name_; }
  // The metadata a put writes: "inline" holds a small payload's frame, "entry" (with "gen") names
  // the directory entry, so a get by it is one lookup.
  std::string_view inline_frame_field() const override { return "inline"; }
  std::string_view direct_lookup_field() const override { return "entry"; }
  size_t device_slots() const override { return opts_.cuda_ipc ? opts_.cuda_arena_bytes : 0; }

  Result<PutResult> do_put(const std::string& from, const std::string& to, const std::string& key,
                           const Payload& payload, const PutOptions& po) override {
    return put_impl(from, to, key, payload, nullptr, po);
  }

  Result<Loan> loan(const Value& tree, std::span<const TensorSpec> specs) override;
  Result<PutResult> put_loan(const std::string& from, const std::string& to, const std::string& key,
                             Loan&& loan, const PutOptions& po) override;

  Result<GetResult> do_get(const std::string& from, const std::string& to, const std::string& key, const Value* metadata, Deadline deadline, const GetOptions& go) override;

  size_t do_cleanup(const std::string& request_id) override;

  size_t abandon_get(const std::string& key) override;

  size_t reap_consumed() override;

  Result<bool> put_released(const Value& md) override;

  uint64_t release_epoch() override {
    std::lock_guard<std::mutex> lock(mu_);
    return dir_ ? dir_->release_seq() : 0;
  }

  bool wait_release_epoch(uint64_t seen, Deadline deadline) override;

  Result<uint64_t> arrival_epoch() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_locked()) return make_error(Errc::closed, "SharedMemoryConnector is closed");
    return uint64_t(dir_->publish_seq());
  }

  bool wait_arrival(uint64_t seen, Deadline deadline) override;

  Result<std::vector<std::string>> pending_keys() override;

  void* find_capability(CapabilityId id) override;

  Value health() override;

  void close() override;

  // Loans call back here to return unpublished memory.
  void return_loan(size_t off, size_t len, std::shared_ptr<Segment> dedicated, uint32_t aidx, uint32_t agen) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    free_region_locked(dedicated, aidx, agen, off, len);
  }

 private:
  struct Region {
    std::byte* base;
    size_t offset, length;
    std::shared_ptr<Segment> dedicated;
    uint32_t arena_idx, arena_gen;
  };

  // A put's memory back: its range of the arena freed, or its own segment kept as the spare
  // (opts_.spare_bytes) or unlinked.
  void free_region_locked(const std::shared_ptr<Segment>& dedicated, uint32_t arena_idx, uint32_t arena_gen, size_t offset, size_t length);

  // The directory, for a call that then waits or reads without mu_ held; null once closed.
  std::shared_ptr<Directory> live_dir() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_locked() ? dir_ : nullptr;
  }

  // Under mu_: whether the connector is open, having first made one inherited through fork() this
  // process's own (a load and a compare when it is not).
  bool open_locked();

  // This process is a fork of the one that made (or last used) the connector: the entries and the
  // arena of that process's puts and its directory attachment are its own, and it goes on using
  // them (writing into its arena from here, with a copy of its allocator, would overwrite its
  // puts). Drop this copy of them -- unmapping is all, nothing shared is touched -- and, unless
  // closing, attach as this process: its puts then take an arena of its own.
  void forget_parent_locked(bool reattach);

  // A counter only written under mu_: a plain increment (readers of health() load it atomically).
  static void bump_locked(std::atomic<uint64_t>& c, uint64_t by = 1) {
    c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }

  // `rid`: the request a put is tied to ("" for none, and for gets); it is stored beside the key.
  static Status validate_edge(const std::string& from, const std::string& to, const std::string& key, std::string_view rid = {});

  // A segment under a name of ours no one holds: names are predictable (pid, counter), and another
  // user may have created the next one first; O_EXCL then fails and the next number is tried.
  template <class Create>
  // The segment is listed in the directory (register_arena, `reg`) before its file is made: a
  // process killed while making it leaves a record under its own pid, which the next reaper
  // unlinks (made first and listed after, a kill in between left a file nobody reaps).
  Result<std::shared_ptr<Segment>> create_fresh(char kind, std::string& name, uint64_t size, bool dedicated,
                                                std::pair<uint32_t, uint32_t>& reg, Create&& create) {
    for (int attempt = 0;; ++attempt) {
      name = dir_->prefix() + kind + std::to_string(getpid()) + "." + std::to_string(g_segment_counter.fetch_add(1));
      SL_ASSIGN(reg, dir_->register_arena(name, size, dedicated));
      auto seg = create(name);
      if (!seg.ok()) dir_->unregister_arena(reg.first, reg.second);
      if (seg.ok() || seg.error().code != Errc::exists) return seg;
      if (attempt == 15)
        return make_error(Errc::exists, seg.error().message + " (and 15 names before it: squatted by another user?)");
      SL_LOG_WARN("%s: taken by someone else; trying the next name", seg.error().message.c_str());
    }
  }

  Status ensure_arena_locked();

  // The arena is reserved up to a high-water mark, grown in kReserveStep steps as allocations
  // reach past it (one posix_fallocate per step; none once the puts' working set is covered).
  // No space: the allocation is given back and the put fails with exhausted.
  static constexpr size_t kReserveStep = 2u << 20;
  Result<Region> reserved_locked(size_t off, size_t size);

  // Return memory of entries every reader released (and of expired ones). `all`: scan everything,
  // not only the in-order prefix.
  void reclaim_locked(bool all, uint64_t now = mono_ns());
  void reclaim_all_locked() { reclaim_locked(true); }

  // A directory entry for ikey. Entries of ours that every reader released are only returned
  // lazily: when the probe window is full, return them all and try once more.
  Result<Claim> reserve_locked(std::string_view ikey, uint16_t put_len, std::string_view rid, uint64_t now);

  Result<Region> allocate_locked(std::unique_lock<std::mutex>& lock, size_t size, uint64_t now);

  Result<PutResult> publish_locked(Claim& cl, const Region& reg, size_t total, uint32_t readers, std::span<const std::byte> inline_bytes, uint64_t now, const std::function<void(std::span<const std::byte>)>* sink = nullptr, const std::shared_ptr<const void>* hold = nullptr);

  Result<PutResult> put_loan_impl(const std::string& from, const std::string& to, const std::string& key, Loan&& loan,
                                  const PutOptions& po);
  Result<PutResult> put_impl(const std::string& from, const std::string& to, const std::string& key, const Payload& payload, const FramePlan* given_plan, const PutOptions& po);

  Result<GetResult> get_impl(const std::string& from, const std::string& to, const std::string& key, const Value* metadata, Deadline deadline, const GetOptions& go);

  // The fields of metadata this connector wrote (entry, gen, inline), found in one pass; all null
  // for metadata it cannot use (another connector's, empty, not a map), which then falls back to
  // the by-key lookup. {key: metadata}, as some callers wrap it, is unwrapped first.
  static void find_own_fields(const Value& md, const std::string& key, const Value*& entry, const Value*& genv, const Value*& inl);

  void wake_waiters();

  // A keyless get blocked in the directory; abandon_get/close set `stop` and wake it.
  struct Waiter {
    std::string_view put_key;
    std::atomic<uint32_t> stop{0};
  };

  friend struct Loan::Impl;
  ShmConnectorOptions opts_;
  std::string name_ = "SharedMemoryConnector";
  std::shared_ptr<Directory> dir_;
  std::mutex mu_;
  bool closed_ = false;
  ForkStamp fork_;  // of the process whose state this is (see open_locked)
  std::shared_ptr<Segment> arena_;
  std::unique_ptr<BufferAllocator> arena_alloc_;
  uint32_t arena_idx_ = 0, arena_gen_ = 0;
  size_t arena_reserved_ = 0;  // bytes of the arena reserved in /dev/shm (from its start)
  std::deque<Outstanding> out_;
  // The last released segment of its own (a frame larger than the arena), still registered, for
  // the next such put: a new one costs the kernel's zeroing and a fault per page (a 256 MiB put
  // took 173-190 ms in a new segment, 15 ms in the arena). At most one; none past spare_bytes.
  struct Spare {
    std::shared_ptr<Segment> seg;
    uint32_t idx = 0, gen = 0;
  } spare_;
  void drop_spare_locked();
  std::shared_ptr<LoanGate> gate_;
  uint64_t last_reap_ns_ = 0;
  std::mutex wait_mu_;
  std::vector<Waiter*> waiters_;
  // Beyond what the Connector base counts: written under mu_ (a plain increment, bump_locked).
  std::atomic<uint64_t> inline_puts_{0}, dedicated_puts_{0}, spare_reused_{0}, replaced_{0};
  // This connector's own samples in the metrics tree (collected under the tree's lock, then mu_:
  // the registration goes at the start of close(), never under mu_).
  struct Metrics final : metrics::Source {
    explicit Metrics(ShmConnector& c) : c(c) {}
    void collect(metrics::Sink& out) const override;
    ShmConnector& c;
  } metrics_;
  metrics::Registration metrics_reg_;  // last: gone before the rest
};

}  // namespace stagelink
