#include "shm/directory.hpp"

#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <bit>
#include <cstring>
#include <map>
#include <thread>

#include "core/log.hpp"
#include "shm/futex.hpp"

namespace stagelink::shm {

namespace {
constexpr size_t align64(size_t v) { return (v + 63) / 64 * 64; }
size_t hashes_offset() { return align64(sizeof(DirHeader)); }
size_t entries_offset(uint32_t n) { return align64(hashes_offset() + sizeof(uint64_t) * n); }


// Decrement the attach count; the last one out marks the directory dying. Returns true when the
// caller must unlink the file.
bool drop_attach(DirHeader* h) {
  uint32_t w = h->attach_word.load(std::memory_order_acquire);
  for (;;) {
    if (w & kDying) return false;
    uint32_t c = w & ~kDying;
    uint32_t next = c <= 1 ? kDying : c - 1;
    if (h->attach_word.compare_exchange_weak(w, next, std::memory_order_acq_rel)) return next == kDying;
  }
}
}  // namespace

namespace {
ProbeMasks probe_scalar(const std::atomic<uint64_t>* hashes, uint32_t mask, uint32_t start, uint64_t hash) {
  ProbeMasks m;
  for (uint32_t i = 0; i < kProbe; ++i) {
    const uint64_t h = hashes[(start + i) & mask].load(std::memory_order_relaxed);
    m.match |= uint64_t(h == hash) << i;
    m.empty |= uint64_t(h == 0) << i;
  }
  return m;
}

#if defined(__x86_64__)
// 64 contiguous hash words, four per compare (~60 instructions instead of ~900). Each word is
// 8-byte aligned, so a lane never tears; the caller re-checks every candidate anyway.
__attribute__((target("avx2"))) ProbeMasks probe_avx2(const std::atomic<uint64_t>* words, uint64_t hash) {
  static_assert(kProbe == 64 && sizeof(std::atomic<uint64_t>) == 8);
  const auto* p = reinterpret_cast<const __m256i*>(words);
  const __m256i want = _mm256_set1_epi64x(int64_t(hash)), zero = _mm256_setzero_si256();
  ProbeMasks m;
  for (uint32_t b = 0; b < kProbe / 4; ++b) {
    const __m256i v = _mm256_loadu_si256(p + b);
    m.match |= uint64_t(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(v, want)))) << (4 * b);
    m.empty |= uint64_t(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(v, zero)))) << (4 * b);
  }
  return m;
}
// Under ThreadSanitizer the portable loop (atomic loads): TSan cannot see the vector loads as
// atomic, and the Shm tests then check the directory's protocol without that noise.
#if defined(__SANITIZE_THREAD__)
const bool g_has_avx2 = false;
#else
const bool g_has_avx2 = __builtin_cpu_supports("avx2");
#endif
#endif
}  // namespace

ProbeMasks probe_window(const std::atomic<uint64_t>* hashes, uint32_t mask, uint32_t start, uint64_t hash,
                        bool simd) {
  ProbeMasks m;
#if defined(__x86_64__)
  start &= mask;
  if (simd && g_has_avx2 && start + kProbe <= mask + 1) m = probe_avx2(hashes + start, hash);  // no wrap
  else m = probe_scalar(hashes, mask, start, hash);
#else
  (void)simd;
  m = probe_scalar(hashes, mask, start, hash);
#endif
  std::atomic_thread_fence(std::memory_order_acquire);
  return m;
}

uint64_t key_hash(std::string_view key) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  h ^= h >> 29;
  return h ? h : 1;
}

bool rid_matches(std::string_view put_key, std::string_view tied_rid, std::string_view rid) {
  return !rid.empty() && (put_key == rid || tied_rid == rid);
}

size_t directory_bytes(uint32_t n) { return entries_offset(n) + sizeof(Entry) * size_t(n); }

namespace {
// This process's attachments, one per namespace (attach() hands the same one to every connector),
// and their lock. Never destroyed: detach_all_at_exit() may run during the process's exit.
std::mutex& attach_mu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<std::string, std::weak_ptr<Directory>>& attachments() {
  static auto* m = new std::map<std::string, std::weak_ptr<Directory>>;
  return *m;
}
}  // namespace

Result<std::shared_ptr<Directory>> Directory::attach(const std::string& shm_dir, const std::string& ns,
                                                     uint32_t n_entries) {
  if (n_entries < kProbe || (n_entries & (n_entries - 1)) != 0 || n_entries > (1u << 22))
    return make_error(Errc::invalid_argument, "max_entries must be a power of two in [64, 4194304], got " +
                                                  std::to_string(n_entries));
  std::mutex& mu = attach_mu();
  auto& cache = attachments();
  const std::string cache_key = std::to_string(getpid()) + "|" + shm_dir + "|" + ns;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(cache_key); it != cache.end())
    if (auto d = it->second.lock()) return d;

  auto d = std::shared_ptr<Directory>(new Directory());
  d->shm_dir_ = shm_dir;
  d->ns_ = ns;
  // The directory's name is the rendezvous of every process of this user and namespace. Another
  // user may have created it first (/dev/shm is world-writable): that file is refused (never
  // read), and every process of ours moves on, in the same order, to the next of a few names.
  int alternate = 0;
  auto name_for = [&](int k) {
    d->prefix_ = user_prefix() + ns + (k ? "~" + std::to_string(k) : std::string()) + ".";
    d->name_ = d->prefix_ + "dir";
  };
  name_for(0);
  const ProcId me = self_proc();
  const uint64_t give_up = mono_ns() + 5'000'000'000ull;
  for (int attempt = 0;; ++attempt) {
    if (mono_ns() > give_up)
      return make_error(Errc::timeout, "could not attach to directory " + shm_dir + "/" + d->name_ +
                                           " within 5 s (being torn down or never initialized; "
                                           "`stagelink shm reap` removes a stale one)");
    auto created = Segment::create(shm_dir, d->name_, directory_bytes(n_entries), true);
    if (created.ok()) {
      d->seg_ = created.value();
      auto* h = reinterpret_cast<DirHeader*>(d->seg_->data());  // zero-filled by the kernel
      h->magic = kDirMagic;
      h->version = kDirVersion;
      h->n_entries = n_entries;
      h->total_size = d->seg_->size();
      h->created_ns = now_ns();
      h->attach_word.store(1, std::memory_order_relaxed);
      h->attached[0].start.store(me.start, std::memory_order_relaxed);
      h->attached[0].pid.store(me.pid, std::memory_order_relaxed);
      d->attach_slot_ = 0;
      h->ready.store(1, std::memory_order_release);
    } else if (created.error().code == Errc::exists) {
      auto opened = Segment::open(shm_dir, d->name_, true, true, sizeof(DirHeader));
      if (!opened.ok() && opened.error().code == Errc::permission_denied) {
        if (++alternate >= kDirAlternates)
          return make_error(Errc::permission_denied, opened.error().message + "; and the " +
                                                         std::to_string(kDirAlternates - 1) +
                                                         " alternate names are taken too");
        SL_LOG_WARN("%s; using an alternate name", opened.error().message.c_str());
        name_for(alternate);
        continue;
      }
      if (!opened.ok()) {
        if (opened.error().code == Errc::not_found || opened.error().code == Errc::corrupt) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));  // racing a create/unlink
          continue;
        }
        return std::move(opened).error();
      }
      auto* h = reinterpret_cast<DirHeader*>(opened.value()->data());
      while (h->ready.load(std::memory_order_acquire) == 0 && mono_ns() < give_up)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (h->ready.load(std::memory_order_acquire) == 0) continue;  // times out above
      if (h->magic != kDirMagic || h->version != kDirVersion)
        return make_error(Errc::corrupt, "directory " + shm_dir + "/" + d->name_ +
                                             " has a foreign magic or version");
      if (opened.value()->size() < directory_bytes(h->n_entries))
        return make_error(Errc::corrupt, "directory " + d->name_ + " is truncated");
      uint32_t w = h->attach_word.load(std::memory_order_acquire);
      bool joined = false;
      while (!(w & kDying)) {
        if (h->attach_word.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) { joined = true; break; }
      }
      if (!joined) {  // the last process is tearing it down: wait for the unlink, then create anew
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        continue;
      }
      d->seg_ = opened.value();
      for (size_t i = 0; i < kMaxAttach; ++i) {
        // Claim, write our start time, then our pid: a reaper that reads the pid reads the start
        // written for it (it once could pair a new pid with the previous occupant's start, judge
        // a live process dead and detach it).
        uint32_t zero = 0;
        if (h->attached[i].pid.compare_exchange_strong(zero, kSlotClaiming, std::memory_order_acq_rel)) {
          h->attached[i].start.store(me.start, std::memory_order_relaxed);
          h->attached[i].pid.store(me.pid, std::memory_order_release);
          d->attach_slot_ = int(i);
          break;
        }
      }
      if (d->attach_slot_ < 0) SL_LOG_WARN("directory %s: more than %zu processes attached; this one is untracked", d->name_.c_str(), kMaxAttach);
    } else {
      return std::move(created).error();
    }
    break;
  }
  d->hdr_ = reinterpret_cast<DirHeader*>(d->seg_->data());
  d->hashes_ = reinterpret_cast<std::atomic<uint64_t>*>(d->seg_->data() + hashes_offset());
  d->entries_ = reinterpret_cast<Entry*>(d->seg_->data() + entries_offset(d->hdr_->n_entries));
  d->attached_ = true;
  d->fork_.adopt();
  auto removed = d->reap();  // start-up reclamation of what dead processes left
  for (auto& r : removed) SL_LOG_INFO("reaped at attach: %s", r.c_str());
  cache[cache_key] = d;
  return d;
}

Result<std::shared_ptr<Directory>> Directory::open_admin(const std::string& shm_dir,
                                                         const std::string& file_name) {
  SL_ASSIGN(auto seg, Segment::open(shm_dir, file_name, true, false, sizeof(DirHeader)));
  auto* h = reinterpret_cast<DirHeader*>(seg->data());
  if (h->ready.load(std::memory_order_acquire) == 0 || h->magic != kDirMagic ||
      h->version != kDirVersion || seg->size() < directory_bytes(h->n_entries))
    return make_error(Errc::corrupt, "directory " + file_name + " is not initialized or foreign");
  auto d = std::shared_ptr<Directory>(new Directory());
  d->shm_dir_ = shm_dir;
  d->name_ = file_name;
  std::string pre = user_prefix();
  d->ns_ = file_name.substr(pre.size(), file_name.size() - pre.size() - 4);
  d->prefix_ = file_name.substr(0, file_name.size() - 3);
  d->seg_ = seg;
  d->hdr_ = h;
  d->hashes_ = reinterpret_cast<std::atomic<uint64_t>*>(seg->data() + hashes_offset());
  d->entries_ = reinterpret_cast<Entry*>(seg->data() + entries_offset(h->n_entries));
  return d;
}

Directory::~Directory() { detach(); }

void Directory::detach_all_at_exit() {
  std::lock_guard<std::mutex> lock(attach_mu());
  for (auto& [key, weak] : attachments())
    if (auto d = weak.lock()) d->detach();  // the mapping stays until the object goes
}

void Directory::detach() {
  if (!attached_) return;
  attached_ = false;
  // Inherited through fork(): the attachment is the parent's, which goes on using it. Only the
  // mapping goes (with this object).
  if (fork_.inherited()) return;
  // What processes that died attached left behind (a forked child that ended in _exit(), as
  // multiprocessing's children do; a killed one) is reclaimed first, so that the last live
  // process out removes the directory and every arena instead of leaving them to a later reaper.
  for (const auto& r : reap()) SL_LOG_INFO("reaped: %s", r.c_str());
  if (attach_slot_ >= 0) hdr_->attached[attach_slot_].pid.store(0, std::memory_order_release);
  if (drop_attach(hdr_)) {
    // Last one out: every attached process is gone, so any arena still listed is orphaned.
    for (size_t i = 0; i < kMaxArenas; ++i)
      if (hdr_->arenas[i].state.load(std::memory_order_acquire) == 2) Segment::unlink(shm_dir_, hdr_->arenas[i].name);
    Segment::unlink(shm_dir_, name_);
  }
}

Result<Claim> Directory::reserve(std::string_view key, uint16_t put_len, std::string_view rid, uint64_t hash,
                                 uint64_t now, bool replace) {
  if (key.size() + rid.size() > kKeyMax || put_len > key.size())  // would overrun the entry's key field
    return make_error(Errc::invalid_argument, "key of " + std::to_string(key.size()) + " bytes and request id of " +
                                                  std::to_string(rid.size()) + "; an entry holds " +
                                                  std::to_string(kKeyMax) + " in all");
  const uint32_t n = hdr_->n_entries, mask = n - 1;
  const ProcId me = self_proc();
  uint32_t replaced = 0;
  for (int attempt = 0; attempt < 16; ++attempt) {
    // One branch-free pass over the window's hash words (one bit per slot), then only the
    // candidates are looked at: slots holding this hash (an unread duplicate?) and empty slots.
    const uint32_t start = uint32_t(hash);
    auto [match, empty] = probe_window(hashes_, mask, start, hash);
    for (; match; match &= match - 1) {
      Entry& e = entries_[(start + uint32_t(std::countr_zero(match))) & mask];
      Ctl c = Ctl::unpack(e.ctl.load(std::memory_order_acquire));
      if ((c.state == kReady || c.state == kWriting) && e.key_len == key.size() &&
          std::memcmp(e.key, key.data(), key.size()) == 0) {
        // vLLM-Omni's semantics: a new put of an unread key replaces it. Readers that already
        // claimed it keep their views; the old slot is freed when the last of them releases.
        if (replace && c.state == kReady) {
          const uint32_t idx = (start + uint32_t(std::countr_zero(match))) & mask;
          if (cancel(idx, c.gen)) ++replaced;
          continue;
        }
        return make_error(Errc::exists,
                          "key '" + std::string(key) + "' is still in use (" +
                              std::to_string(std::popcount(c.released)) + " of " +
                              std::to_string(c.readers) + " readers done)" +
                              (c.state == kWriting ? "; another put of it is in progress"
                                                   : "; reuse it after they finish or cleanup(), or set on_existing_key: replace"));
      }
    }
    int64_t free_at = -1;
    for (; empty; empty &= empty - 1) {
      const uint32_t j = (start + uint32_t(std::countr_zero(empty))) & mask;
      if (Ctl::unpack(entries_[j].ctl.load(std::memory_order_acquire)).state == kFree) {
        free_at = j;
        break;
      }
    }
    if (free_at < 0)
      return make_error(Errc::exhausted, "directory " + name_ + " has no free entry near key '" +
                                             std::string(key) + "' (" + std::to_string(n) +
                                             " entries; raise max_entries or release readers)");
    Entry& e = entries_[free_at];
    uint64_t w = e.ctl.load(std::memory_order_acquire);
    Ctl c = Ctl::unpack(w);
    if (c.state != kFree) continue;
    Ctl next{kWriting, 0, 0, 0, c.gen + 1};
    if (!e.ctl.compare_exchange_strong(w, next.pack(), std::memory_order_acq_rel)) continue;
    e.hash = hash;
    std::atomic_ref<uint64_t>(e.owner_start).store(me.start, std::memory_order_relaxed);
    std::atomic_ref<uint32_t>(e.owner_pid).store(me.pid, std::memory_order_relaxed);
    std::atomic_ref<uint32_t>(e.owner_gen).store(next.gen, std::memory_order_release);
    e.key_len = uint16_t(key.size());
    e.put_len = put_len;
    e.rid_len = uint16_t(rid.size());
    std::memcpy(e.key, key.data(), key.size());
    if (!rid.empty()) std::memcpy(e.key + key.size(), rid.data(), rid.size());
    e.created_ns = now;
    hashes_[free_at].store(hash, std::memory_order_release);
    Claim cl;
    cl.idx = uint32_t(free_at);
    cl.gen = next.gen;
    cl.replaced = replaced;
    return cl;
  }
  return make_error(Errc::exhausted, "directory " + name_ + ": contention reserving key '" + std::string(key) + "'");
}

bool Directory::publish(const Claim& c, uint8_t readers) {
  Entry& e = entries_[c.idx];
  e.arena = c.arena;
  e.arena_gen = c.arena_gen;
  e.offset = c.offset;
  e.length = c.length;
  // The reaper looks at the pids of claimed slots only: clear those this put may use (a slot
  // whose reader's release failed, the entry being reclaimed meanwhile, may hold an old pid).
  for (uint32_t i = 0; i < readers && i < kMaxFanout; ++i) e.readers[i].pid.store(0, std::memory_order_relaxed);
  Ctl next{kReady, readers, 0, 0, c.gen};
  uint64_t writing = Ctl{kWriting, 0, 0, 0, c.gen}.pack();
  if (!e.ctl.compare_exchange_strong(writing, next.pack(), std::memory_order_acq_rel)) return false;
  futex_bump_wake(hdr_->publish_seq, hdr_->publish_waiters);
  return true;
}

void Directory::abandon(const Claim& c) { free_entry(c.idx, c.gen); }

bool Directory::is_done(uint32_t idx, uint32_t gen) {
  Ctl c = Ctl::unpack(entries_[idx].ctl.load(std::memory_order_acquire));
  return c.gen == gen && c.state == kDone;
}

bool Directory::is_released(uint32_t idx, uint32_t gen) {
  if (idx >= hdr_->n_entries) return true;
  Ctl c = Ctl::unpack(entries_[idx].ctl.load(std::memory_order_acquire));
  return c.gen != gen || c.state == kDone || c.state == kFree;
}

std::string Directory::key_of(uint32_t idx) {
  const Entry& e = entries_[idx];
  return std::string(e.key, std::min<size_t>(e.key_len, kKeyMax));
}

std::optional<std::string> Directory::unread_put_key(uint32_t idx, uint32_t gen) {
  if (idx >= hdr_->n_entries) return std::nullopt;
  const Entry& e = entries_[idx];
  const Ctl c = Ctl::unpack(e.ctl.load(std::memory_order_acquire));
  if (c.gen != gen || c.state != kReady || c.claimed >= c.readers) return std::nullopt;
  return std::string(e.key, std::min<size_t>(e.put_len, kKeyMax));
}

void Directory::free_entry(uint32_t idx, uint32_t gen) {
  Entry& e = entries_[idx];
  uint64_t w = e.ctl.load(std::memory_order_acquire);
  for (;;) {
    Ctl c = Ctl::unpack(w);
    if (c.gen != gen || c.state == kFree) return;
    hashes_[idx].store(0, std::memory_order_release);
    Ctl next{kFree, 0, 0, 0, gen};
    if (e.ctl.compare_exchange_weak(w, next.pack(), std::memory_order_acq_rel)) return;
  }
}

bool Directory::cancel(uint32_t idx, uint32_t gen) {
  Entry& e = entries_[idx];
  uint64_t w = e.ctl.load(std::memory_order_acquire);
  for (;;) {
    Ctl c = Ctl::unpack(w);
    if (c.gen != gen || c.state != kReady) return false;
    Ctl next = c;
    next.readers = c.claimed;
    next.state = std::popcount(c.released) >= c.claimed ? kDone : kCancelled;
    if (e.ctl.compare_exchange_weak(w, next.pack(), std::memory_order_acq_rel)) {
      if (next.state == kDone) {
        futex_bump_wake(hdr_->release_seq, hdr_->release_waiters);
      }
      return true;
    }
  }
}

Result<std::pair<uint32_t, uint32_t>> Directory::register_arena(const std::string& name, uint64_t size,
                                                                 bool dedicated) {
  if (name.size() >= sizeof(ArenaRec::name)) return make_error(Errc::invalid_argument, "arena name too long: " + name);
  const ProcId me = self_proc();
  for (uint32_t i = 0; i < kMaxArenas; ++i) {
    ArenaRec& a = hdr_->arenas[i];
    uint32_t zero = 0;
    if (!a.state.compare_exchange_strong(zero, 1, std::memory_order_acq_rel)) continue;
    a.owner_pid = me.pid;
    a.owner_start = me.start;
    a.size = size;
    a.dedicated = dedicated;
    a.created_ns = now_ns();
    std::memset(a.name, 0, sizeof a.name);
    std::memcpy(a.name, name.data(), name.size());
    uint32_t gen = a.gen.fetch_add(1, std::memory_order_acq_rel) + 1;
    a.state.store(2, std::memory_order_release);
    return std::make_pair(i, gen);
  }
  return make_error(Errc::exhausted, "directory " + name_ + " tracks at most 256 arenas and segments; "
                                     "close connectors or raise arena_bytes so fewer dedicated segments are needed");
}

void Directory::unregister_arena(uint32_t idx, uint32_t gen) {
  ArenaRec& a = hdr_->arenas[idx];
  if (a.gen.load(std::memory_order_acquire) != gen) return;
  uint32_t live = 2;
  a.state.compare_exchange_strong(live, 0, std::memory_order_acq_rel);
}

bool Directory::wait_release(uint32_t seen, uint64_t deadline_ns) {
  return futex_wait_counted(hdr_->release_seq, hdr_->release_waiters, seen, deadline_ns);
}

bool Directory::wait_publish(uint32_t seen, uint64_t deadline_ns) {
  while (hdr_->publish_seq.load(std::memory_order_acquire) == seen && mono_ns() < deadline_ns)
    futex_wait_counted(hdr_->publish_seq, hdr_->publish_waiters, seen, deadline_ns);
  return hdr_->publish_seq.load(std::memory_order_acquire) != seen;
}

Result<Claim> Directory::claim(uint32_t idx, uint32_t gen, std::string_view key) {
  if (idx >= hdr_->n_entries)
    return make_error(Errc::corrupt, "metadata names entry " + std::to_string(idx) + " of a directory with " +
                                         std::to_string(hdr_->n_entries));
  Entry& e = entries_[idx];
  uint64_t w = e.ctl.load(std::memory_order_acquire);
  for (;;) {
    Ctl c = Ctl::unpack(w);
    // Metadata naming a generation other than the one the entry holds this key at was not issued
    // for what it holds now: corrupt, never that payload. A free entry, or one reused for another
    // key, means the payload is gone (its producer closed or died, or it was read): not_found, and
    // an inline payload is still delivered from the metadata.
    if (c.gen != gen && c.state != kFree && e.key_len == key.size() &&
        std::memcmp(e.key, key.data(), key.size()) == 0)
      return make_error(Errc::corrupt, "metadata of key '" + std::string(key) + "' names generation " +
                                           std::to_string(gen) + " of entry " + std::to_string(idx) +
                                           ", which holds it at generation " + std::to_string(c.gen) +
                                           " (stale or forged metadata)");
    if (c.gen != gen || (c.state != kReady))
      return make_error(Errc::not_found, "entry of key '" + std::string(key) + "' is gone (consumed, cancelled or reclaimed)");
    if (e.key_len != key.size() || std::memcmp(e.key, key.data(), key.size()) != 0)
      return make_error(Errc::corrupt, "metadata points at an entry holding another key than '" + std::string(key) + "'");
    if (c.claimed >= c.readers) {
      // Every read is claimed; one whose reader died never completed: its claim is given back
      // and this reader takes it (a retry after a consumer crashed mid-read reads the payload).
      if (give_back_dead_claims(idx, c)) {
        w = e.ctl.load(std::memory_order_acquire);
        continue;
      }
      return make_error(Errc::not_found, "key '" + std::string(key) + "' was already read by all " +
                                             std::to_string(c.readers) + " readers it was put for");
    }
    Ctl next = c;
    next.claimed = c.claimed + 1;
    if (e.ctl.compare_exchange_weak(w, next.pack(), std::memory_order_acq_rel)) {
      const ProcId me = self_proc();
      e.readers[c.claimed].start.store(me.start, std::memory_order_relaxed);
      e.readers[c.claimed].pid.store(me.pid, std::memory_order_release);
      Claim cl;
      cl.idx = idx;
      cl.gen = gen;
      cl.slot = c.claimed;
      cl.arena = e.arena;
      cl.arena_gen = e.arena_gen;
      cl.offset = e.offset;
      cl.length = e.length;
      return cl;
    }
  }
}

std::optional<Claim> Directory::try_claim_key(std::string_view key, uint64_t hash) {
  const uint32_t mask = hdr_->n_entries - 1, start = uint32_t(hash);
  for (uint64_t match = probe_window(hashes_, mask, start, hash).match; match; match &= match - 1) {
    const uint32_t j = (start + uint32_t(std::countr_zero(match))) & mask;
    Ctl c = Ctl::unpack(entries_[j].ctl.load(std::memory_order_acquire));
    if (c.state != kReady) continue;
    auto r = claim(j, c.gen, key);
    if (r.ok()) return r.value();
  }
  return std::nullopt;
}

void Directory::wake_getters() { futex_bump_wake(hdr_->publish_seq, hdr_->publish_waiters); }

Result<Claim> Directory::wait_claim_key(std::string_view key, uint64_t hash, uint64_t deadline_ns,
                                        const std::atomic<uint32_t>* stop) {
  for (int spin = 0;; ++spin) {
    uint32_t seq = hdr_->publish_seq.load(std::memory_order_acquire);
    if (auto c = try_claim_key(key, hash)) return *c;
    if (stop && stop->load(std::memory_order_acquire))
      return make_error(Errc::cancelled, "get of key '" + std::string(key) + "' was abandoned");
    if (deadline_ns == 0 || mono_ns() >= deadline_ns)
      return make_error(deadline_ns == 0 ? Errc::not_found : Errc::timeout,
                        "key '" + std::string(key) + "' was not published" +
                            (deadline_ns == 0 ? std::string() : std::string(" before the deadline")));
    if (spin < 64) {  // a short spin catches a publish that is microseconds away
      for (int k = 0; k < 64 && hdr_->publish_seq.load(std::memory_order_acquire) == seq; ++k)
        __builtin_ia32_pause();
      continue;
    }
    futex_wait_counted(hdr_->publish_seq, hdr_->publish_waiters, seq, deadline_ns);
  }
}

bool Directory::give_back(uint32_t idx, uint32_t gen, uint32_t slot) {
  Entry& e = entries_[idx];
  uint64_t w = e.ctl.load(std::memory_order_acquire);
  for (;;) {
    Ctl c = Ctl::unpack(w);
    if (c.gen != gen || c.state != kReady || slot >= kMaxFanout || (c.released & (1u << slot)) ||
        c.readers >= kMaxFanout)
      return false;
    Ctl next = c;
    next.readers = uint8_t(c.readers + 1);  // one more read allowed ...
    next.released = uint8_t(c.released | (1u << slot));  // ... in place of the dead one's slot
    if (e.ctl.compare_exchange_weak(w, next.pack(), std::memory_order_acq_rel)) {
      e.readers[slot].pid.store(0, std::memory_order_relaxed);
      wake_getters();  // a getter waiting for the key may claim it now
      return true;
    }
  }
}

bool Directory::give_back_dead_claims(uint32_t idx, const Ctl& c) {
  Entry& e = entries_[idx];
  bool any = false;
  for (uint32_t s = 0; s < c.claimed && s < kMaxFanout; ++s) {
    if (c.released & (1u << s)) continue;
    const uint32_t pid = e.readers[s].pid.load(std::memory_order_acquire);
    if (pid && pid != kSlotClaiming && !proc_alive(ProcId{pid, e.readers[s].start.load(std::memory_order_acquire)}))
      any |= give_back(idx, c.gen, s);
  }
  return any;
}

void Directory::release(const Claim& cl) {
  Entry& e = entries_[cl.idx];
  uint64_t w = e.ctl.load(std::memory_order_acquire);
  for (;;) {
    Ctl c = Ctl::unpack(w);
    if (c.gen != cl.gen || (c.state != kReady && c.state != kCancelled) || (c.released & (1u << cl.slot)))
      return;  // reclaimed meanwhile (owner died, close) or already released: nothing to do
    if (cl.slot < kMaxFanout) e.readers[cl.slot].pid.store(0, std::memory_order_relaxed);
    Ctl next = c;
    next.released = uint8_t(c.released | (1u << cl.slot));
    if (std::popcount(next.released) >= next.readers) next.state = kDone;
    if (e.ctl.compare_exchange_weak(w, next.pack(), std::memory_order_acq_rel)) {
      if (next.state == kDone) {
        futex_bump_wake(hdr_->release_seq, hdr_->release_waiters);
      }
      return;
    }
  }
}

Result<std::shared_ptr<Segment>> Directory::map_arena(uint32_t idx, uint32_t gen) {
  if (idx >= kMaxArenas) return make_error(Errc::corrupt, "entry names arena " + std::to_string(idx));
  ArenaRec& a = hdr_->arenas[idx];
  if (a.state.load(std::memory_order_acquire) != 2 || a.gen.load(std::memory_order_acquire) != gen)
    return make_error(Errc::not_found, "arena " + std::to_string(idx) + " is gone (its producer closed or died)");
  if (!a.dedicated) {  // mapped before at this generation: its name was checked then
    std::lock_guard<std::mutex> lock(map_mu_);
    auto it = mapped_.find(idx);
    if (it != mapped_.end() && it->second.gen == gen) return it->second.seg;
  }
  std::string name(a.name, strnlen(a.name, sizeof a.name));
  if (name.rfind(prefix_, 0) != 0 || name.find('/') != std::string::npos)
    return make_error(Errc::corrupt, "arena name '" + name + "' is outside this namespace");
  SL_ASSIGN(auto seg, Segment::open(shm_dir_, name, false, bool(a.dedicated), a.size));
  if (!a.dedicated) {
    std::lock_guard<std::mutex> lock(map_mu_);
    mapped_[idx] = Mapped{gen, seg};
  }
  return seg;
}

size_t Directory::cancel_request(std::string_view rid) {
  size_t n = 0;
  for (uint32_t j = 0; j < hdr_->n_entries; ++j) {
    if (hashes_[j].load(std::memory_order_acquire) == 0) continue;
    Entry& e = entries_[j];
    Ctl c = Ctl::unpack(e.ctl.load(std::memory_order_acquire));
    if (c.state != kReady) continue;
    const size_t klen = std::min<size_t>(e.key_len, kKeyMax);
    const std::string_view put_key(e.key, std::min<size_t>(e.put_len, klen));
    const std::string_view tied(e.key + klen, std::min<size_t>(e.rid_len, kKeyMax - klen));
    if (!rid_matches(put_key, tied, rid)) continue;
    if (cancel(j, c.gen)) ++n;
  }
  return n;
}

std::vector<std::string> Directory::reap() {
  std::vector<std::string> out;
  std::map<std::pair<uint32_t, uint64_t>, bool> alive;
  auto is_alive = [&](uint32_t pid, uint64_t start) {
    auto k = std::make_pair(pid, start);
    auto it = alive.find(k);
    if (it != alive.end()) return it->second;
    bool a = proc_alive(ProcId{pid, start});
    alive[k] = a;
    return a;
  };
  for (size_t i = 0; i < kMaxAttach; ++i) {
    uint32_t pid = hdr_->attached[i].pid.load(std::memory_order_acquire);
    if (!pid || pid == kSlotClaiming || is_alive(pid, hdr_->attached[i].start.load(std::memory_order_acquire))) continue;
    if (hdr_->attached[i].pid.compare_exchange_strong(pid, 0, std::memory_order_acq_rel)) {
      out.push_back("attachment of dead process " + std::to_string(pid) + " to " + name_);
      if (drop_attach(hdr_)) Segment::unlink(shm_dir_, name_);
    }
  }
  for (uint32_t j = 0; j < hdr_->n_entries; ++j) {
    Entry& e = entries_[j];
    uint64_t w = e.ctl.load(std::memory_order_acquire);
    Ctl c = Ctl::unpack(w);
    if (c.state == kFree) continue;
    // A put being written is judged by its owner only once the owner said who it is (a WRITING
    // entry still holding the previous owner's identity is a live put whose producer is between
    // claiming it and that store). Published states were written after it.
    if (c.state == kWriting && std::atomic_ref<uint32_t>(e.owner_gen).load(std::memory_order_acquire) != c.gen) {
      // Still silent a grace period after this reaper first saw it: its producer died between
      // claiming the entry and writing its identity. Free it (a producer that comes back fails
      // its publish instead of writing over the free entry).
      const uint64_t t = mono_ns();
      std::lock_guard<std::mutex> g(unowned_mu_);
      auto [it, fresh] = unowned_.try_emplace(j, Unowned{c.gen, t});
      if (fresh || it->second.gen != c.gen) {
        it->second = Unowned{c.gen, t};
        continue;
      }
      if (t - it->second.since_ns < kUnownedGraceNs) continue;
      unowned_.erase(it);
      const uint64_t h = hashes_[j].exchange(0, std::memory_order_acq_rel);
      Ctl next{kFree, 0, 0, 0, c.gen + 1};
      if (e.ctl.compare_exchange_strong(w, next.pack(), std::memory_order_acq_rel)) {
        out.push_back("entry " + std::to_string(j) + " whose producer died while claiming it");
      } else {  // it moved on after all (published): its lookups need the hash back
        uint64_t zero = 0;
        hashes_[j].compare_exchange_strong(zero, h, std::memory_order_acq_rel);
      }
      continue;
    }
    const uint32_t owner = std::atomic_ref<uint32_t>(e.owner_pid).load(std::memory_order_relaxed);
    if (!is_alive(owner, std::atomic_ref<uint64_t>(e.owner_start).load(std::memory_order_relaxed))) {
      hashes_[j].store(0, std::memory_order_release);
      Ctl next{kFree, 0, 0, 0, c.gen + 1};
      if (e.ctl.compare_exchange_strong(w, next.pack(), std::memory_order_acq_rel))
        out.push_back("entry '" + std::string(e.key, std::min<size_t>(e.key_len, kKeyMax)) +
                      "' of dead producer " + std::to_string(owner));
      continue;
    }
    if (c.state != kReady && c.state != kCancelled) continue;
    for (uint32_t s = 0; s < c.claimed && s < kMaxFanout; ++s) {
      if (c.released & (1u << s)) continue;
      uint32_t pid = e.readers[s].pid.load(std::memory_order_acquire);
      if (pid && !is_alive(pid, e.readers[s].start.load(std::memory_order_acquire))) {
        if (give_back(j, c.gen, s)) {  // its read never completed: another reader may take it
          out.push_back("read of '" + std::string(e.key, std::min<size_t>(e.key_len, kKeyMax)) +
                        "' by dead reader " + std::to_string(pid) + ": given back for another reader");
          continue;
        }
        Claim cl;
        cl.idx = j;
        cl.gen = c.gen;
        cl.slot = s;
        release(cl);
        out.push_back("read of '" + std::string(e.key, std::min<size_t>(e.key_len, kKeyMax)) +
                      "' by dead reader " + std::to_string(pid));
      }
    }
  }
  for (uint32_t i = 0; i < kMaxArenas; ++i) {
    ArenaRec& a = hdr_->arenas[i];
    if (a.state.load(std::memory_order_acquire) != 2 || is_alive(a.owner_pid, a.owner_start)) continue;
    uint32_t live = 2;
    if (a.state.compare_exchange_strong(live, 0, std::memory_order_acq_rel)) {
      std::string name(a.name, strnlen(a.name, sizeof a.name));
      Segment::unlink(shm_dir_, name);
      out.push_back("segment " + name + " of dead process " + std::to_string(a.owner_pid));
    }
  }
  return out;
}

size_t Directory::live_entries() {
  size_t n = 0;
  for (uint32_t j = 0; j < hdr_->n_entries; ++j)
    if (Ctl::unpack(entries_[j].ctl.load(std::memory_order_acquire)).state != kFree) ++n;
  return n;
}

uint32_t Directory::attached_count() {
  uint32_t w = hdr_->attach_word.load(std::memory_order_acquire);
  return (w & kDying) ? 0 : w;
}

}  // namespace stagelink::shm
