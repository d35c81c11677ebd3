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

namespace {
std::atomic<uint32_t> g_segment_counter{0};

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

}  // namespace

class ShmConnector;
// Loans point back to their connector through this gate, cleared by close(): a loan dropped after
// its connector closed (or was destroyed) returns nothing instead of touching freed memory.
struct LoanGate {
  std::mutex mu;
  ShmConnector* owner = nullptr;
};

namespace {
struct Outstanding {
  uint32_t idx, gen;
  size_t offset, length;
  std::shared_ptr<Segment> dedicated;  // null: lives in the arena
  uint32_t arena_idx, arena_gen;
  uint64_t created_ns;
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
}  // namespace

class ShmConnector final : public Connector,
                           public Lending,
                           public WaitingGets,
                           public ArrivalSignals,
                           public ReleaseTracking,
                           public BindingFields {
 public:
  explicit ShmConnector(ShmConnectorOptions o) : opts_(std::move(o)), gate_(std::make_shared<LoanGate>()) {
    gate_->owner = this;
  }
  ~ShmConnector() override { close(); }

  Status init() {
    SL_ASSIGN(dir_, Directory::attach(opts_.shm_dir, opts_.ns, opts_.max_entries));
    if (opts_.preallocate_arena) {  // the whole arena reserved now: a full /dev/shm fails here
      std::lock_guard<std::mutex> lock(mu_);
      SL_TRY(ensure_arena_locked());
    }
    return {};
  }

  const std::string& name() const override { return name_; }
  // The metadata a put writes: "inline" holds a small payload's frame, "entry" (with "gen") names
  // the directory entry, so a get by it is one lookup.
  std::string_view inline_frame_field() const override { return "inline"; }
  std::string_view direct_lookup_field() const override { return "entry"; }

  Result<PutResult> put(const std::string& from, const std::string& to, const std::string& key,
                        const Payload& payload, const PutOptions& po) override {
    auto r = put_impl(from, to, key, payload, nullptr, po);
    count_error(r);
    return r;
  }

  Result<Loan> loan(const Value& tree, std::span<const TensorSpec> specs) override;
  Result<PutResult> put_loan(const std::string& from, const std::string& to, const std::string& key,
                             Loan&& loan, const PutOptions& po) override;

  Result<GetResult> get(const std::string& from, const std::string& to, const std::string& key,
                        const Value* metadata, Deadline deadline, const GetOptions& go) override {
    auto r = get_impl(from, to, key, metadata, deadline, go);
    if (r.ok()) {
      gets_.fetch_add(1, std::memory_order_relaxed);
      get_bytes_.fetch_add(r->size, std::memory_order_relaxed);
    } else if (r.error().code == Errc::timeout) {
      timeouts_.fetch_add(1, std::memory_order_relaxed);
    } else if (r.error().code != Errc::not_found) {
      errors_.fetch_add(1, std::memory_order_relaxed);
    }
    return r;
  }

  size_t cleanup(const std::string& request_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_locked()) return 0;
    // Every unread entry of the request on this host: ours, other producers' (abort).
    const size_t n = dir_->cancel_request(request_id);
    reclaim_all_locked();
    cleanups_.fetch_add(1, std::memory_order_relaxed);
    return n;
  }

  size_t abandon_get(const std::string& key) override {
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(wait_mu_);
      for (Waiter* w : waiters_)
        if (w->put_key == key) {
          w->stop.store(1, std::memory_order_release);
          ++n;
        }
    }
    if (n) wake_waiters();
    return n;
  }

  size_t reap_consumed() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_locked()) return 0;
    const size_t before = out_.size();
    reclaim_all_locked();
    return before - out_.size();
  }

  Result<bool> put_released(const Value& md) override {
    const Value *entry = nullptr, *genv = nullptr, *inl = nullptr;
    find_own_fields(md, std::string(), entry, genv, inl);
    uint64_t idx = 0, gen = 0;
    if (!entry || !genv || !entry->get_u64(idx) || !genv->get_u64(gen) || gen > UINT32_MAX)
      return make_error(Errc::corrupt, "put_released: metadata lacks entry/gen (not a SharedMemoryConnector put?)");
    std::shared_ptr<Directory> dir;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!open_locked()) return true;  // close() freed every put
      dir = dir_;
    }
    if (idx >= dir->n_entries()) return make_error(Errc::corrupt, "put_released: entry out of range");
    return dir->is_released(uint32_t(idx), uint32_t(gen));
  }

  uint64_t release_epoch() override {
    std::lock_guard<std::mutex> lock(mu_);
    return dir_ ? dir_->release_seq() : 0;
  }

  bool wait_release_epoch(uint64_t seen, Deadline deadline) override {
    const std::shared_ptr<Directory> dir = live_dir();
    if (!dir) return true;  // close() freed every put
    auto rem = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
    if (rem <= 0) return dir->release_seq() != uint32_t(seen);
    return dir->wait_release(uint32_t(seen), mono_ns() + uint64_t(rem)) || dir->release_seq() != uint32_t(seen);
  }

  Result<uint64_t> arrival_epoch() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_locked()) return make_error(Errc::closed, "SharedMemoryConnector is closed");
    return uint64_t(dir_->publish_seq());
  }

  bool wait_arrival(uint64_t seen, Deadline deadline) override {
    const std::shared_ptr<Directory> dir = live_dir();
    if (!dir) return false;
    auto rem = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
    return dir->wait_publish(uint32_t(seen), mono_ns() + uint64_t(std::max<int64_t>(rem, 0)));
  }

  Result<std::vector<std::string>> pending_keys() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> keys;
    if (!open_locked()) return keys;
    for (const auto& o : out_)
      if (auto k = dir_->unread_put_key(o.idx, o.gen)) keys.push_back(std::move(*k));
    return keys;
  }

  void* find_capability(CapabilityId id) override {
    switch (id) {
      case CapabilityId::lending: return static_cast<Lending*>(this);
      case CapabilityId::waiting_gets: return static_cast<WaitingGets*>(this);
      case CapabilityId::arrivals: return static_cast<ArrivalSignals*>(this);
      case CapabilityId::releases: return static_cast<ReleaseTracking*>(this);
      case CapabilityId::binding: return static_cast<BindingFields*>(this);
      default: return nullptr;
    }
  }

  Value health() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (open_locked() && dir_) reclaim_all_locked();
    Value::Map m;
    m.emplace_back("status", closed_ ? "closed" : "healthy");
    options::add_ignored(m, opts_.ignored);
    m.emplace_back("connector", name_);
    m.emplace_back("puts", uint64_t(puts_.load()));
    m.emplace_back("gets", uint64_t(gets_.load()));
    m.emplace_back("bytes_transferred", uint64_t(put_bytes_.load() + get_bytes_.load()));
    m.emplace_back("errors", uint64_t(errors_.load()));
    m.emplace_back("timeouts", uint64_t(timeouts_.load()));
    m.emplace_back("inline_puts", uint64_t(inline_puts_.load()));
    m.emplace_back("dedicated_segments", uint64_t(dedicated_puts_.load()));
    m.emplace_back("cleanups", uint64_t(cleanups_.load()));
    m.emplace_back("replaced", uint64_t(replaced_.load()));
    m.emplace_back("outstanding", uint64_t(out_.size()));
    m.emplace_back("arena_bytes", uint64_t(arena_alloc_ ? arena_alloc_->capacity() : 0));
    m.emplace_back("arena_used", uint64_t(arena_alloc_ ? arena_alloc_->used() : 0));
    m.emplace_back("arena_reserved", uint64_t(arena_reserved_));
    m.emplace_back("arena_largest_free", uint64_t(arena_alloc_ ? arena_alloc_->largest_free() : 0));
    m.emplace_back("arena_name", arena_ ? arena_->name() : std::string());
    m.emplace_back("namespace", opts_.ns);
    m.emplace_back("shm_threshold_bytes", uint64_t(opts_.shm_threshold_bytes));
    if (dir_) {
      m.emplace_back("directory_entries", uint64_t(dir_->n_entries()));
      m.emplace_back("directory_live_entries", uint64_t(dir_->live_entries()));
    }
    return Value(std::move(m));
  }

  void close() override {
    {
      // First, and not under mu_ (a loan's destructor takes the gate, then mu_).
      std::lock_guard<std::mutex> g(gate_->mu);
      gate_->owner = nullptr;
    }
    {
      // Blocked keyless gets end now (cancelled) instead of at their deadline.
      std::lock_guard<std::mutex> lock(wait_mu_);
      for (Waiter* w : waiters_) w->stop.store(1, std::memory_order_release);
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    // Inherited through fork(): everything it holds is the parent's; this process has nothing to free.
    if (fork_.inherited()) forget_parent_locked(false);
    closed_ = true;
    if (!dir_) return;
    dir_->wake_getters();
    // Everything we own goes: entries (readers holding views keep their own mapping), dedicated
    // segments and the arena.
    for (auto& o : out_) {
      dir_->free_entry(o.idx, o.gen);
      if (o.dedicated) {
        dir_->unregister_arena(o.arena_idx, o.arena_gen);
        Segment::unlink(opts_.shm_dir, o.dedicated->name());
      }
    }
    out_.clear();
    if (arena_) {
      dir_->unregister_arena(arena_idx_, arena_gen_);
      Segment::unlink(opts_.shm_dir, arena_->name());
      arena_.reset();
      arena_alloc_.reset();
    }
    dir_.reset();
  }

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

  // A put's memory back: its own segment unlinked, or its range of the arena freed.
  void free_region_locked(const std::shared_ptr<Segment>& dedicated, uint32_t arena_idx, uint32_t arena_gen,
                          size_t offset, size_t length) {
    if (dedicated) {
      dir_->unregister_arena(arena_idx, arena_gen);
      Segment::unlink(opts_.shm_dir, dedicated->name());
    } else if (arena_alloc_) {
      auto st = arena_alloc_->free(offset, length);
      if (!st.ok()) SL_LOG_ERROR("arena free: %s", st.error().to_string().c_str());
    }
  }

  // The directory, for a call that then waits or reads without mu_ held; null once closed.
  std::shared_ptr<Directory> live_dir() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_locked() ? dir_ : nullptr;
  }

  // Under mu_: whether the connector is open, having first made one inherited through fork() this
  // process's own (a load and a compare when it is not).
  bool open_locked() {
    if (closed_) return false;
    if (fork_.inherited()) [[unlikely]]
      forget_parent_locked(true);
    return !closed_;
  }

  // This process is a fork of the one that made (or last used) the connector: the entries and the
  // arena of that process's puts and its directory attachment are its own, and it goes on using
  // them (writing into its arena from here, with a copy of its allocator, would overwrite its
  // puts). Drop this copy of them -- unmapping is all, nothing shared is touched -- and, unless
  // closing, attach as this process: its puts then take an arena of its own.
  void forget_parent_locked(bool reattach) {
    fork_.adopt();
    out_.clear();
    arena_.reset();  // a mapping: its destructor unmaps, never unlinks
    arena_alloc_.reset();
    arena_idx_ = arena_gen_ = 0;
    arena_reserved_ = 0;
    {
      std::lock_guard<std::mutex> w(wait_mu_);
      waiters_.clear();  // the threads that waited are not in this process
    }
    dir_.reset();  // an inherited Directory detaches nothing (its fork generation differs)
    if (!reattach) return;
    auto d = Directory::attach(opts_.shm_dir, opts_.ns, opts_.max_entries);
    if (!d.ok()) {
      SL_LOG_ERROR("SharedMemoryConnector after fork(): cannot attach to the directory: %s",
                   d.error().to_string().c_str());
      closed_ = true;
      return;
    }
    dir_ = std::move(d).value();
  }

  // Successful puts are counted in publish_locked, under mu_; failed ones here.
  template <class R>
  void count_error(const R& r) {
    if (!r.ok()) errors_.fetch_add(1, std::memory_order_relaxed);
  }
  // A counter only written under mu_: a plain increment (readers of health() load it atomically).
  static void bump_locked(std::atomic<uint64_t>& c, uint64_t by = 1) {
    c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  }

  // `rid`: the request a put is tied to ("" for none, and for gets); it is stored beside the key.
  static Status validate_edge(const std::string& from, const std::string& to, const std::string& key,
                              std::string_view rid = {}) {
    const size_t ikey_len = internal_key_size(key, from, to);
    if (name_is_valid(from, 64) && name_is_valid(to, 64) && name_is_valid(key, 160) &&
        (rid.empty() || name_is_valid(rid, 160)) && ikey_len + rid.size() <= shm::kKeyMax) [[likely]]
      return {};
    SL_TRY(validate_name("from_stage", from, 64));
    SL_TRY(validate_name("to_stage", to, 64));
    SL_TRY(validate_name("key", key, 160));
    if (!rid.empty()) SL_TRY(validate_name("request_id", rid, 160));
    return make_error(Errc::invalid_argument, "key '" + key + "' with stages '" + from + "' and '" + to + "'" +
                                                  (rid.empty() ? "" : " and request id '" + std::string(rid) + "'") +
                                                  " take " + std::to_string(ikey_len + rid.size()) +
                                                  " bytes of a directory entry; at most " +
                                                  std::to_string(shm::kKeyMax) + " fit");
  }

  // A segment under a name of ours no one holds: names are predictable (pid, counter), and another
  // user may have created the next one first; O_EXCL then fails and the next number is tried.
  template <class Create>
  Result<std::shared_ptr<Segment>> create_fresh(char kind, std::string& name, Create&& create) {
    for (int attempt = 0;; ++attempt) {
      name = dir_->prefix() + kind + std::to_string(getpid()) + "." + std::to_string(g_segment_counter.fetch_add(1));
      auto seg = create(name);
      if (seg.ok() || seg.error().code != Errc::exists) return seg;
      if (attempt == 15)
        return make_error(Errc::exists, seg.error().message + " (and 15 names before it: squatted by another user?)");
      SL_LOG_WARN("%s: taken by someone else; trying the next name", seg.error().message.c_str());
    }
  }

  Status ensure_arena_locked() {
    if (arena_ || opts_.arena_bytes == 0) return {};
    std::string name;
    // Never pre-faulted: a page is mapped where a put first writes it (faulting in all of it
    // costs ~0.5 ms per MiB here, wasted where an edge's payloads use the first slots only).
    // Reserved whole now when asked (preallocate_arena), else as puts reach into it
    // (reserved_locked): either way before a byte is written, so a full /dev/shm is an error,
    // never a SIGBUS.
    SL_ASSIGN(auto seg, create_fresh('a', name, [&](const std::string& n) {
      return opts_.preallocate_arena ? Segment::create(opts_.shm_dir, n, opts_.arena_bytes, false)
                                     : Segment::create_sparse(opts_.shm_dir, n, opts_.arena_bytes);
    }));
    auto reg = dir_->register_arena(name, opts_.arena_bytes, false);
    if (!reg.ok()) {
      Segment::unlink(opts_.shm_dir, name);
      return std::move(reg).error();
    }
    arena_ = seg;
    arena_reserved_ = opts_.preallocate_arena ? opts_.arena_bytes : 0;
    arena_idx_ = reg->first;
    arena_gen_ = reg->second;
    arena_alloc_ = std::make_unique<BufferAllocator>(opts_.arena_bytes, 64);
    return {};
  }

  // The arena is reserved up to a high-water mark, grown in kReserveStep steps as allocations
  // reach past it (one posix_fallocate per step; none once the puts' working set is covered).
  // No space: the allocation is given back and the put fails with exhausted.
  static constexpr size_t kReserveStep = 2u << 20;
  Result<Region> reserved_locked(size_t off, size_t size) {
    if (off + size > arena_reserved_) [[unlikely]] {
      const size_t step_end = (off + size + kReserveStep - 1) / kReserveStep * kReserveStep;
      const size_t end = std::min(opts_.arena_bytes, step_end);
      if (auto st = arena_->reserve(arena_reserved_, end - arena_reserved_); !st.ok()) {
        (void)arena_alloc_->free(off, size);
        return std::move(st).error();
      }
      arena_reserved_ = end;
    }
    return Region{arena_->data() + off, off, size, nullptr, arena_idx_, arena_gen_};
  }

  // Return memory of entries every reader released (and of expired ones). `all`: scan everything,
  // not only the in-order prefix.
  void reclaim_locked(bool all, uint64_t now = mono_ns()) {
    const uint64_t ttl_ns = uint64_t(opts_.ttl_s * 1e9);
    for (auto it = out_.begin(); it != out_.end();) {
      if (ttl_ns && now - it->created_ns > ttl_ns) {
        if (dir_->cancel(it->idx, it->gen))
          SL_LOG_WARN("put '%s' unread after %.0f s (ttl_s): cancelled", dir_->key_of(it->idx).c_str(), opts_.ttl_s);
      }
      if (!dir_->is_done(it->idx, it->gen)) {
        if (!all) break;
        ++it;
        continue;
      }
      dir_->free_entry(it->idx, it->gen);
      free_region_locked(it->dedicated, it->arena_idx, it->arena_gen, it->offset, it->length);
      it = out_.erase(it);
    }
  }
  void reclaim_all_locked() { reclaim_locked(true); }

  // A directory entry for ikey. Entries of ours that every reader released are only returned
  // lazily: when the probe window is full, return them all and try once more.
  Result<Claim> reserve_locked(std::string_view ikey, uint16_t put_len, std::string_view rid, uint64_t now) {
    const uint64_t h = shm::key_hash(ikey);
    auto cl = dir_->reserve(ikey, put_len, rid, h, now, opts_.replace_existing);
    if (!cl.ok() && cl.error().code == Errc::exhausted) {
      reclaim_all_locked();
      cl = dir_->reserve(ikey, put_len, rid, h, now, opts_.replace_existing);
    }
    if (cl.ok() && cl->replaced) bump_locked(replaced_, cl->replaced);
    return cl;
  }

  Result<Region> allocate_locked(std::unique_lock<std::mutex>& lock, size_t size, uint64_t now) {
    reclaim_locked(false, now);
    if (now - last_reap_ns_ > 1'000'000'000ull) {  // periodic: dead readers, TTL
      last_reap_ns_ = now;
      reclaim_all_locked();
      for (auto& r : dir_->reap()) SL_LOG_INFO("reaped: %s", r.c_str());
    }
    if (size > opts_.arena_bytes) {
      std::string name;
      SL_ASSIGN(auto seg, create_fresh('x', name, [&](const std::string& n) {
        return Segment::create(opts_.shm_dir, n, size, false);
      }));
      auto reg = dir_->register_arena(name, size, true);
      if (!reg.ok()) {
        Segment::unlink(opts_.shm_dir, name);
        return std::move(reg).error();
      }
      dedicated_puts_.fetch_add(1, std::memory_order_relaxed);
      return Region{seg->data(), 0, size, seg, reg->first, reg->second};
    }
    SL_TRY(ensure_arena_locked());
    const uint64_t deadline = now + uint64_t(opts_.put_timeout_s * 1e9);
    for (;;) {
      uint32_t seen = dir_->release_seq();
      auto off = arena_alloc_->allocate(size);
      if (off.ok()) return reserved_locked(off.value(), size);
      reclaim_all_locked();
      off = arena_alloc_->allocate(size);
      if (off.ok()) return reserved_locked(off.value(), size);
      if (mono_ns() >= deadline)
        return make_error(Errc::exhausted,
                          "arena " + arena_->name() + " has no room for " + std::to_string(size) + " bytes after " +
                              std::to_string(opts_.put_timeout_s) + " s (" + std::to_string(arena_alloc_->used()) +
                              " of " + std::to_string(arena_alloc_->capacity()) + " bytes held by " +
                              std::to_string(out_.size()) + " unreleased puts)");
      lock.unlock();
      // Every transition to DONE bumps release_seq and wakes sleepers: no periodic re-check needed.
      dir_->wait_release(seen, deadline);
      lock.lock();
      if (closed_) return make_error(Errc::closed, "connector closed while waiting for arena room");
    }
  }

  Result<PutResult> publish_locked(Claim& cl, const Region& reg,
                                   size_t total, uint32_t readers, std::span<const std::byte> inline_bytes,
                                   uint64_t now, const std::function<void(std::span<const std::byte>)>* sink = nullptr) {
    cl.arena = reg.arena_idx;
    cl.arena_gen = reg.arena_gen;
    cl.offset = reg.offset;
    cl.length = total;
    if (!dir_->publish(cl, uint8_t(readers))) {
      // A reaper judged this producer dead mid-put and freed the entry: the put is lost, say so.
      free_region_locked(reg.dedicated, reg.arena_idx, reg.arena_gen, reg.offset, reg.length);
      return make_error(Errc::io, "put: its directory entry " + std::to_string(cl.idx) +
                                      " was reclaimed while it was written (a reaper judged this producer "
                                      "dead); nothing was published");
    }
    out_.push_back(Outstanding{cl.idx, cl.gen, reg.offset, reg.length, reg.dedicated, reg.arena_idx,
                               reg.arena_gen, now});
    PutResult pr;
    pr.size = total;
    // Every put names its entry (reader accounting). Inline payloads carry their frame; the
    // others name the segment holding it, as the seed's {"shm": {"name", "size"}} did. Flat and
    // few fields: cheaper to build, ship and convert (a Python dict each way).
    Value::Map md;
    md.reserve(4);
    md.emplace_back("size", uint64_t(total));
    md.emplace_back("entry", uint64_t(cl.idx));
    md.emplace_back("gen", uint64_t(cl.gen));
    if (!inline_bytes.empty()) {
      if (sink && *sink)
        (*sink)(inline_bytes);  // the caller adds "inline" itself (PutHooks::inline_sink)
      else
        md.emplace_back("inline", Value::copy_bytes(inline_bytes));
      bump_locked(inline_puts_);
    } else {
      Value::Map shm;
      shm.reserve(3);
      shm.emplace_back("name", reg.dedicated ? reg.dedicated->name() : arena_->name());
      shm.emplace_back("size", uint64_t(total));
      shm.emplace_back("offset", uint64_t(reg.offset));
      md.emplace_back("shm", Value(std::move(shm)));
    }
    pr.metadata = Value(std::move(md));
    bump_locked(puts_);
    bump_locked(put_bytes_, total);
    return pr;
  }

  Result<PutResult> put_impl(const std::string& from, const std::string& to, const std::string& key,
                             const Payload& payload, const FramePlan* given_plan, const PutOptions& po) {
    SL_TRY(validate_edge(from, to, key, po.request_id));
    const uint32_t readers = po.readers ? po.readers : opts_.readers;
    if (readers > shm::kMaxFanout)
      return make_error(Errc::invalid_argument, "readers must be in [1, 8], got " + std::to_string(readers));
    if (!given_plan) {
      thread_local FramePlan scratch;  // reused: planning a put allocates nothing once warm
      SL_TRY(plan_frame_into(scratch, payload));
      given_plan = &scratch;
    }
    const FramePlan& plan = *given_plan;
    const InternalKey ikey(key, from, to);
    std::unique_lock<std::mutex> lock(mu_);
    if (!open_locked()) return make_error(Errc::closed, "put on a closed SharedMemoryConnector");
    const uint64_t now = mono_ns();
    SL_ASSIGN(Claim cl, reserve_locked(ikey, uint16_t(key.size()), po.request_id, now));
    auto reg = allocate_locked(lock, plan.total, now);
    if (!reg.ok() || closed_) {
      if (!closed_) dir_->abandon(cl);
      return reg.ok() ? make_error(Errc::closed, "connector closed during put") : std::move(reg).error();
    }
    write_frame(plan, payload.tensors, reg->base);
    std::span<const std::byte> inl;
    if (plan.total <= opts_.shm_threshold_bytes) inl = std::span<const std::byte>(reg->base, plan.total);
    return publish_locked(cl, reg.value(), plan.total, readers, inl, now, po.hooks ? &po.hooks->inline_sink : nullptr);
  }

  Result<GetResult> get_impl(const std::string& from, const std::string& to, const std::string& key,
                             const Value* metadata, Deadline deadline, const GetOptions& go) {
    SL_TRY(validate_edge(from, to, key));
    const std::shared_ptr<Directory> dir = live_dir();
    if (!dir) return make_error(Errc::closed, "get on a closed SharedMemoryConnector");
    const InternalKey ikey(key, from, to);
    Result<Claim> cl = Claim{};  // set below on every path
    const Value *entry = nullptr, *genv = nullptr, *inl = nullptr;
    if (metadata) find_own_fields(*metadata, key, entry, genv, inl);
    if (entry || genv) {  // ours: every inconsistency below is an error
      uint64_t idx = 0, gen = 0;
      if (!entry || !genv || !entry->get_u64(idx) || !genv->get_u64(gen) || idx > UINT32_MAX || gen > UINT32_MAX)
        return make_error(Errc::corrupt, "metadata lacks entry/gen (not from a stagelink SharedMemoryConnector?)");
      cl = dir->claim(uint32_t(idx), uint32_t(gen), ikey);
      // The inline frame: the metadata's own, or the one its caller handed beside it.
      const bool in_md = inl && inl->is<Value::Bytes>();
      const std::span<const std::byte> frame = in_md ? std::span<const std::byte>(inl->as<Value::Bytes>()) : (go.hooks ? go.hooks->metadata_inline : std::span<const std::byte>());
      if (in_md || !frame.empty()) {
        // Small payload: the bytes are in the metadata; only the reader accounting touches shm.
        // An entry already gone (producer closed or died) does not stop it; metadata of another
        // key does.
        if (!cl.ok() && cl.error().code == Errc::corrupt) return std::move(cl).error();
        GetResult g;
        g.size = frame.size();
        Status st = go.zero_copy && go.hooks && go.hooks->view_metadata ? decode_frame_into(frame, nullptr, g.payload, !go.hooks->raw_tree)
                                                     : decode_frame_copy_into(frame, g.payload);
        if (cl.ok()) dir->release(cl.value());
        if (!st.ok()) return std::move(st).error();
        return g;
      }
      if (!cl.ok()) return std::move(cl).error();
    } else {
      // The directory's clock (CLOCK_MONOTONIC ns; 0: one look) at `d`.
      auto mono_at = [](Deadline d) {
        auto rem = std::chrono::duration_cast<std::chrono::nanoseconds>(d - Clock::now()).count();
        return mono_ns() + uint64_t(std::max<int64_t>(rem, 1));
      };
      if (deadline == kNoWait) {
        cl = dir->wait_claim_key(ikey, shm::key_hash(ikey), 0);
      } else {  // a blocking wait: abandon_get() and close() can end it, and go.keep_waiting
        Waiter w{key};
        {
          std::lock_guard<std::mutex> lock(wait_mu_);
          waiters_.push_back(&w);
        }
        for (;;) {
          const Deadline until = wait_slice_end(deadline, go.keep_waiting);
          cl = dir->wait_claim_key(ikey, shm::key_hash(ikey), mono_at(until), &w.stop);
          if (cl.ok() || cl.error().code != Errc::timeout || until >= deadline) break;
          if (!go.keep_waiting()) {
            cl = make_error(Errc::cancelled, "the get of '" + ikey.str() + "' was interrupted while it waited");
            break;
          }
        }
        std::lock_guard<std::mutex> lock(wait_mu_);
        waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &w));
      }
      if (!cl.ok()) return std::move(cl).error();
    }
    const Claim c = cl.value();
    auto seg = dir->map_arena(c.arena, c.arena_gen);
    if (!seg.ok()) {
      dir->release(c);
      return std::move(seg).error();
    }
    if (c.offset > seg.value()->size() || c.length > seg.value()->size() - c.offset) {
      dir->release(c);
      return make_error(Errc::corrupt, "entry of '" + ikey.str() + "' points outside its segment");
    }
    std::span<const std::byte> bytes(seg.value()->data() + c.offset, c.length);
    GetResult g;
    g.size = c.length;
    if (go.zero_copy) {
      SL_TRY(decode_frame_into(bytes, std::make_shared<Lease>(dir, seg.value(), c), g.payload, !(go.hooks && go.hooks->raw_tree)));
      return g;
    }
    Status st = decode_frame_copy_into(bytes, g.payload);
    dir->release(c);
    if (!st.ok()) return std::move(st).error();
    return g;
  }

  // The fields of metadata this connector wrote (entry, gen, inline), found in one pass; all null
  // for metadata it cannot use (another connector's, empty, not a map), which then falls back to
  // the by-key lookup. {key: metadata}, as some callers wrap it, is unwrapped first.
  static void find_own_fields(const Value& md, const std::string& key, const Value*& entry, const Value*& genv,
                              const Value*& inl) {
    using namespace std::string_view_literals;
    if (!md.is<Value::Map>()) return;
    const Value::Map& m = md.as<Value::Map>();
    if (m.size() == 1 && m[0].first == key && m[0].second.is<Value::Map>())
      return find_own_fields(m[0].second, key, entry, genv, inl);
    for (const auto& [k, v] : m) {  // string_view compares: a length check and an inlined memcmp
      const std::string_view ks(k);
      if (ks == "entry"sv) entry = &v;
      else if (ks == "gen"sv) genv = &v;
      else if (ks == "inline"sv) inl = &v;
    }
  }

  void wake_waiters() {
    std::shared_ptr<Directory> dir;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dir = dir_;
    }
    if (dir) dir->wake_getters();
  }

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
  std::shared_ptr<LoanGate> gate_;
  uint64_t last_reap_ns_ = 0;
  std::mutex wait_mu_;
  std::vector<Waiter*> waiters_;
  // puts_, put_bytes_, inline_puts_: written under mu_ only; the others by concurrent gets too.
  std::atomic<uint64_t> puts_{0}, put_bytes_{0}, inline_puts_{0}, gets_{0}, get_bytes_{0}, errors_{0}, timeouts_{0},
      dedicated_puts_{0}, cleanups_{0}, replaced_{0};
};

// ---- Loans ----
struct Loan::Impl {
  std::shared_ptr<LoanGate> gate;
  FramePlan plan;
  std::byte* base = nullptr;
  size_t offset = 0, length = 0;
  std::shared_ptr<Segment> dedicated;  // a segment of its own; else `arena` holds the mapping
  std::shared_ptr<Segment> arena;      // keeps region() writable after the connector closed
  // Only for a segment of its own: to remove it if the connector is gone when the loan drops.
  std::shared_ptr<Directory> dir;
  std::string shm_dir;
  uint32_t arena_idx = 0, arena_gen = 0;
  bool published = false;
  ForkStamp fork;  // a loan inherited through fork() is the parent's memory
  ~Impl() {
    if (published || !gate || fork.inherited()) return;
    std::lock_guard<std::mutex> g(gate->mu);  // close() cannot finish meanwhile
    if (gate->owner) {
      gate->owner->return_loan(offset, length, dedicated, arena_idx, arena_gen);
    } else if (dedicated) {  // the connector is gone: its arena went with it, this segment did not
      dir->unregister_arena(arena_idx, arena_gen);
      Segment::unlink(shm_dir, dedicated->name());
    }
  }
};

Loan::Loan() = default;
Loan::Loan(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loan::Loan(Loan&&) noexcept = default;
Loan& Loan::operator=(Loan&&) noexcept = default;
Loan::~Loan() = default;
size_t Loan::tensor_count() const { return impl_ ? impl_->plan.offsets.size() : 0; }
std::span<std::byte> Loan::region(size_t i) {
  if (!impl_ || i >= impl_->plan.offsets.size()) return {};
  return std::span<std::byte>(impl_->base + impl_->plan.offsets[i], impl_->plan.lengths[i]);
}
size_t Loan::frame_size() const { return impl_ ? impl_->plan.total : 0; }

Result<Loan> ShmConnector::loan(const Value& tree, std::span<const TensorSpec> specs) {
  SL_ASSIGN(FramePlan plan, plan_frame(tree, specs));
  std::unique_lock<std::mutex> lock(mu_);
  if (!open_locked()) return make_error(Errc::closed, "loan on a closed SharedMemoryConnector");
  SL_ASSIGN(Region reg, allocate_locked(lock, plan.total, mono_ns()));
  auto impl = std::make_unique<Loan::Impl>();
  impl->gate = gate_;
  if (reg.dedicated) {
    impl->dir = dir_;
    impl->shm_dir = opts_.shm_dir;
  } else {
    impl->arena = arena_;
  }
  impl->base = reg.base;
  impl->offset = reg.offset;
  impl->length = reg.length;
  impl->dedicated = reg.dedicated;
  impl->arena_idx = reg.arena_idx;
  impl->arena_gen = reg.arena_gen;
  write_frame_head(plan, reg.base);
  impl->plan = std::move(plan);
  return Loan(std::move(impl));
}

Result<PutResult> ShmConnector::put_loan(const std::string& from, const std::string& to, const std::string& key,
                                         Loan&& loan, const PutOptions& po) {
  auto* impl = loan.impl();
  if (!impl || impl->gate != gate_)
    return make_error(Errc::invalid_argument, "loan is empty or belongs to another connector");
  SL_TRY(validate_edge(from, to, key, po.request_id));
  const uint32_t readers = po.readers ? po.readers : opts_.readers;
  if (readers < 1 || readers > shm::kMaxFanout)
    return make_error(Errc::invalid_argument, "readers must be in [1, 8]");
  const InternalKey ikey(key, from, to);
  if (impl->fork.inherited())
    return make_error(Errc::invalid_argument, "put_loan: the loan was taken before fork(), in the parent process, "
                                              "whose memory it is; take a new loan in this process");
  std::unique_lock<std::mutex> lock(mu_);
  if (!open_locked()) return make_error(Errc::closed, "put_loan on a closed SharedMemoryConnector");
  const uint64_t now = mono_ns();
  SL_ASSIGN(Claim cl, reserve_locked(ikey, uint16_t(key.size()), po.request_id, now));
  impl->published = true;
  Region reg{impl->base, impl->offset, impl->length, impl->dedicated, impl->arena_idx, impl->arena_gen};
  std::span<const std::byte> inl;
  if (impl->plan.total <= opts_.shm_threshold_bytes) inl = std::span<const std::byte>(impl->base, impl->plan.total);
  auto r = publish_locked(cl, reg, impl->plan.total, readers, inl, now, po.hooks ? &po.hooks->inline_sink : nullptr);
  lock.unlock();
  loan = Loan();
  count_error(r);
  return r;
}

Result<std::unique_ptr<Connector>> make_shm_connector(const ShmConnectorOptions& opts) {
  auto c = std::make_unique<ShmConnector>(opts);
  SL_TRY(c->init());
  return std::unique_ptr<Connector>(std::move(c));
}

}  // namespace stagelink
namespace stagelink {
std::unique_ptr<Loan::Impl> Loan::release_impl() { return std::move(impl_); }
}
