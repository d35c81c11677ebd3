// SharedMemoryConnector (shm_connector.hpp; the class is shm_impl.hpp): puts, gets, the arena, reclaiming.
#include "connectors/shm_connector.hpp"

#include <utility>

#include "connectors/shm_impl.hpp"
#include "cuda/arena.hpp"

namespace stagelink {

Status ShmConnector::init() {
  SL_ASSIGN(dir_, Directory::attach(opts_.shm_dir, opts_.ns, opts_.max_entries));
  if (opts_.preallocate_arena) {  // the whole arena reserved now: a full /dev/shm fails here
    std::lock_guard<std::mutex> lock(mu_);
    SL_TRY(ensure_arena_locked());
  }
  return {};
}

Result<GetResult> ShmConnector::do_get(const std::string& from, const std::string& to, const std::string& key, const Value* metadata, Deadline deadline, const GetOptions& go) {
  return get_impl(from, to, key, metadata, deadline, go);
}

namespace {
using metrics::Family;
using metrics::Kind;
const Family kShmInline{"stagelink_shm_inline_puts_total", Kind::counter, "",
                        "puts small enough to travel in their metadata (shm_threshold_bytes)", {"connector"}};
const Family kShmDedicated{"stagelink_shm_dedicated_segments_total", Kind::counter, "",
                           "puts too large for the arena, given a segment of their own", {"connector"}};
const Family kShmReplaced{"stagelink_shm_replaced_total", Kind::counter, "",
                          "unread puts replaced by a put of the same key", {"connector"}};
const Family kShmOutstanding{"stagelink_shm_outstanding_entries", Kind::gauge, "",
                             "puts of this process not yet released by every reader", {"connector"}};
const Family kShmArena{"stagelink_shm_arena_bytes", Kind::gauge, "bytes", "arena capacity", {"connector"}};
const Family kShmArenaUsed{"stagelink_shm_arena_used_bytes", Kind::gauge, "bytes",
                           "arena bytes held by unreleased puts and loans", {"connector"}};
const Family kShmWaiters{"stagelink_shm_waiting_gets", Kind::gauge, "", "gets blocked waiting for their key",
                         {"connector"}};
}  // namespace

void ShmConnector::Metrics::collect(metrics::Sink& out) const {
  const std::string l = c.metrics_label();
  out.value(kShmInline, {l}, double(c.inline_puts_.load(std::memory_order_relaxed)));
  out.value(kShmDedicated, {l}, double(c.dedicated_puts_.load(std::memory_order_relaxed)));
  out.value(kShmReplaced, {l}, double(c.replaced_.load(std::memory_order_relaxed)));
  {
    std::lock_guard<std::mutex> lock(c.mu_);
    if (c.open_locked() && c.dir_) c.reclaim_all_locked();  // what readers released since (as health())
    out.value(kShmOutstanding, {l}, double(c.out_.size()));
    out.value(kShmArena, {l}, double(c.arena_alloc_ ? c.arena_alloc_->capacity() : 0));
    out.value(kShmArenaUsed, {l}, double(c.arena_alloc_ ? c.arena_alloc_->used() : 0));
  }
  std::lock_guard<std::mutex> lock(c.wait_mu_);
  out.value(kShmWaiters, {l}, double(c.waiters_.size()));
}

size_t ShmConnector::do_cleanup(const std::string& request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_locked()) return 0;
  // Every unread entry of the request on this host: ours, other producers' (abort).
  const size_t n = dir_->cancel_request(request_id);
  reclaim_all_locked();
  return n;
}

size_t ShmConnector::abandon_get(const std::string& key) {
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

size_t ShmConnector::reap_consumed() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_locked()) return 0;
  const size_t before = out_.size();
  reclaim_all_locked();
  return before - out_.size();
}

Result<bool> ShmConnector::put_released(const Value& md) {
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

bool ShmConnector::wait_release_epoch(uint64_t seen, Deadline deadline) {
  const std::shared_ptr<Directory> dir = live_dir();
  if (!dir) return true;  // close() freed every put
  auto rem = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
  if (rem <= 0) return dir->release_seq() != uint32_t(seen);
  return dir->wait_release(uint32_t(seen), mono_ns() + uint64_t(rem)) || dir->release_seq() != uint32_t(seen);
}

bool ShmConnector::wait_arrival(uint64_t seen, Deadline deadline) {
  const std::shared_ptr<Directory> dir = live_dir();
  if (!dir) return false;
  auto rem = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
  return dir->wait_publish(uint32_t(seen), mono_ns() + uint64_t(std::max<int64_t>(rem, 0)));
}

Result<std::vector<std::string>> ShmConnector::pending_keys() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> keys;
  if (!open_locked()) return keys;
  for (const auto& o : out_)
    if (auto k = dir_->unread_put_key(o.idx, o.gen)) keys.push_back(std::move(*k));
  return keys;
}

void* ShmConnector::find_capability(CapabilityId id) {
  switch (id) {
    case CapabilityId::lending: return static_cast<Lending*>(this);
    case CapabilityId::waiting_gets: return static_cast<WaitingGets*>(this);
    case CapabilityId::arrivals: return static_cast<ArrivalSignals*>(this);
    case CapabilityId::releases: return static_cast<ReleaseTracking*>(this);
    case CapabilityId::binding: return static_cast<BindingFields*>(this);
    default: return nullptr;
  }
}

Value ShmConnector::health() {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_locked() && dir_) reclaim_all_locked();
  Value::Map m;
  m.emplace_back("status", closed_ ? "closed" : "healthy");
  options::add_ignored(m, opts_.ignored);
  m.emplace_back("connector", name_);
  add_counts(m);
  m.emplace_back("inline_puts", uint64_t(inline_puts_.load()));
  m.emplace_back("dedicated_segments", uint64_t(dedicated_puts_.load()));
  m.emplace_back("dedicated_reused", uint64_t(spare_reused_.load()));
  m.emplace_back("spare_held_bytes", uint64_t(spare_.seg ? spare_.seg->size() : 0));
  m.emplace_back("replaced", uint64_t(replaced_.load()));
  m.emplace_back("outstanding", uint64_t(out_.size()));
  m.emplace_back("arena_bytes", uint64_t(arena_alloc_ ? arena_alloc_->capacity() : 0));
  m.emplace_back("arena_used", uint64_t(arena_alloc_ ? arena_alloc_->used() : 0));
  m.emplace_back("arena_reserved", uint64_t(arena_reserved_));
  m.emplace_back("arena_largest_free", uint64_t(arena_alloc_ ? arena_alloc_->largest_free() : 0));
  m.emplace_back("arena_name", arena_ ? arena_->name() : std::string());
  m.emplace_back("namespace", opts_.ns);
  m.emplace_back("shm_threshold_bytes", uint64_t(opts_.shm_threshold_bytes));
  // CUDA tensors left on their GPU (this process's arenas, all connectors) and mapped from others.
  m.emplace_back("cuda_ipc", opts_.cuda_ipc);
  if (opts_.cuda_ipc) {
    m.emplace_back("cuda_arenas", cuda::DeviceArenas::instance().health());
    m.emplace_back("cuda_imports", cuda::DeviceImports::instance().health());
  }
  if (dir_) {
    m.emplace_back("directory_entries", uint64_t(dir_->n_entries()));
    m.emplace_back("directory_live_entries", uint64_t(dir_->live_entries()));
  }
  return Value(std::move(m));
}

void ShmConnector::close() {
  metrics_reg_.reset();  // first, and not under mu_ (a collection takes the tree's lock, then mu_)
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
    // A reader may still work on a device slot of an entry it claimed: its slot is never reused
    // (kept until the process exits) rather than overwritten under that reader.
    if (o.hold && !dir_->is_done(o.idx, o.gen)) cuda::keep_until_exit(std::move(o.hold));
    dir_->free_entry(o.idx, o.gen);
    if (o.dedicated) {
      dir_->unregister_arena(o.arena_idx, o.arena_gen);
      Segment::unlink(opts_.shm_dir, o.dedicated->name());
    }
  }
  out_.clear();
  drop_spare_locked();
  if (arena_) {
    dir_->unregister_arena(arena_idx_, arena_gen_);
    Segment::unlink(opts_.shm_dir, arena_->name());
    arena_.reset();
    arena_alloc_.reset();
  }
  dir_.reset();
}

void ShmConnector::free_region_locked(const std::shared_ptr<Segment>& dedicated, uint32_t arena_idx, uint32_t arena_gen, size_t offset, size_t length) {
  if (dedicated) {
    // Every reader released it (or died): no view of it is left, as for a range of the arena.
    if (dedicated->size() <= opts_.spare_bytes) {
      drop_spare_locked();
      spare_ = Spare{dedicated, arena_idx, arena_gen};
      return;
    }
    dir_->unregister_arena(arena_idx, arena_gen);
    Segment::unlink(opts_.shm_dir, dedicated->name());
  } else if (arena_alloc_) {
    auto st = arena_alloc_->free(offset, length);
    if (!st.ok()) SL_LOG_ERROR("arena free: %s", st.error().to_string().c_str());
  }
}

void ShmConnector::drop_spare_locked() {
  if (!spare_.seg) return;
  dir_->unregister_arena(spare_.idx, spare_.gen);
  Segment::unlink(opts_.shm_dir, spare_.seg->name());
  spare_ = Spare{};
}

bool ShmConnector::open_locked() {
  if (closed_) return false;
  if (fork_.inherited()) [[unlikely]]
    forget_parent_locked(true);
  return !closed_;
}

void ShmConnector::forget_parent_locked(bool reattach) {
  fork_.adopt();
  out_.clear();
  spare_ = Spare{};  // the parent's: unmapped here, never unlinked
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

Status ShmConnector::validate_edge(const std::string& from, const std::string& to, const std::string& key, std::string_view rid) {
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

Status ShmConnector::ensure_arena_locked() {
  if (arena_ || opts_.arena_bytes == 0) return {};
  std::string name;
  // Never pre-faulted: a page is mapped where a put first writes it (faulting in all of it
  // costs ~0.5 ms per MiB here, wasted where an edge's payloads use the first slots only).
  // Reserved whole now when asked (preallocate_arena), else as puts reach into it
  // (reserved_locked): either way before a byte is written, so a full /dev/shm is an error,
  // never a SIGBUS.
  std::pair<uint32_t, uint32_t> reg;
  SL_ASSIGN(auto seg, create_fresh('a', name, opts_.arena_bytes, false, reg, [&](const std::string& n) {
    return opts_.preallocate_arena ? Segment::create(opts_.shm_dir, n, opts_.arena_bytes, false)
                                   : Segment::create_sparse(opts_.shm_dir, n, opts_.arena_bytes);
  }));
  arena_ = seg;
  arena_reserved_ = opts_.preallocate_arena ? opts_.arena_bytes : 0;
  arena_idx_ = reg.first;
  arena_gen_ = reg.second;
  arena_alloc_ = std::make_unique<BufferAllocator>(opts_.arena_bytes, 64);
  return {};
}

Result<ShmConnector::Region> ShmConnector::reserved_locked(size_t off, size_t size) {
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

void ShmConnector::reclaim_locked(bool all, uint64_t now) {
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

Result<Claim> ShmConnector::reserve_locked(std::string_view ikey, uint16_t put_len, std::string_view rid, uint64_t now) {
  const uint64_t h = shm::key_hash(ikey);
  auto cl = dir_->reserve(ikey, put_len, rid, h, now, opts_.replace_existing);
  if (!cl.ok() && cl.error().code == Errc::exhausted) {
    reclaim_all_locked();
    cl = dir_->reserve(ikey, put_len, rid, h, now, opts_.replace_existing);
  }
  if (cl.ok() && cl->replaced) bump_locked(replaced_, cl->replaced);
  return cl;
}

Result<ShmConnector::Region> ShmConnector::allocate_locked(std::unique_lock<std::mutex>& lock, size_t size, uint64_t now) {
  reclaim_locked(false, now);
  if (now - last_reap_ns_ > 1'000'000'000ull) {  // periodic: dead readers, TTL
    last_reap_ns_ = now;
    reclaim_all_locked();
    for (auto& r : dir_->reap()) SL_LOG_INFO("reaped: %s", r.c_str());
  }
  if (size > opts_.arena_bytes) {
    // The spare when it fits without making readers map much more than the frame (they map and
    // populate a segment of its own whole); else a new one, and the spare goes.
    if (spare_.seg && spare_.seg->size() >= size && spare_.seg->size() - size <= size / 4) {
      Spare s = std::exchange(spare_, Spare{});
      spare_reused_.fetch_add(1, std::memory_order_relaxed);
      dedicated_puts_.fetch_add(1, std::memory_order_relaxed);  // a put given a segment of its own, as the metric says
      return Region{s.seg->data(), 0, size, s.seg, s.idx, s.gen};
    }
    drop_spare_locked();
    std::string name;
    std::pair<uint32_t, uint32_t> reg;
    SL_ASSIGN(auto seg, create_fresh('x', name, size, true, reg, [&](const std::string& n) {
      return Segment::create(opts_.shm_dir, n, size, false);
    }));
    dedicated_puts_.fetch_add(1, std::memory_order_relaxed);
    return Region{seg->data(), 0, size, seg, reg.first, reg.second};
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

Result<PutResult> ShmConnector::publish_locked(Claim& cl, const Region& reg, size_t total, uint32_t readers, std::span<const std::byte> inline_bytes, uint64_t now, const std::function<void(std::span<const std::byte>)>* sink, const std::shared_ptr<const void>* hold) {
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
                             reg.arena_gen, now, hold ? *hold : nullptr});
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
  return pr;
}

Result<PutResult> ShmConnector::put_impl(const std::string& from, const std::string& to, const std::string& key, const Payload& payload, const FramePlan* given_plan, const PutOptions& po) {
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
  write_frame(plan, payload.tensors, reg->base, /*split=*/true);
  std::span<const std::byte> inl;
  const bool held = po.hooks && po.hooks->hold;  // device slots: readers must claim the entry
  if (plan.total <= opts_.shm_threshold_bytes && !held) inl = std::span<const std::byte>(reg->base, plan.total);
  return publish_locked(cl, reg.value(), plan.total, readers, inl, now, po.hooks ? &po.hooks->inline_sink : nullptr,
                        held ? &po.hooks->hold : nullptr);
}

Result<GetResult> ShmConnector::get_impl(const std::string& from, const std::string& to, const std::string& key, const Value* metadata, Deadline deadline, const GetOptions& go) {
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

void ShmConnector::find_own_fields(const Value& md, const std::string& key, const Value*& entry, const Value*& genv, const Value*& inl) {
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

void ShmConnector::wake_waiters() {
  std::shared_ptr<Directory> dir;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dir = dir_;
  }
  if (dir) dir->wake_getters();
}

Result<std::unique_ptr<Connector>> make_shm_connector(const ShmConnectorOptions& opts) {
  auto c = std::make_unique<ShmConnector>(opts);
  SL_TRY(c->init());
  return std::unique_ptr<Connector>(std::move(c));
}

}  // namespace stagelink
