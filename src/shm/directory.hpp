// The shared directory of one namespace: a segment every stagelink process of a user attaches to.
// It holds the key index (open addressing, bounded probe window), the table of arenas, the list of
// attached processes, and the futex words that wake waiting getters and waiting producers.
//
// Entry life cycle, all transitions by CAS on one 64-bit control word:
//   FREE -> WRITING (producer reserved) -> READY (published) -> DONE (every reader released)
//   READY -> CANCELLED (cleanup/TTL; readers already claimed may still release) -> DONE
//   DONE -> FREE (the owning producer returned the memory; or a reaper, the owner being dead)
// A generation counter in the control word makes every stale reference (metadata, a lease held
// past a reap) fail its CAS instead of touching a reused entry.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/proc.hpp"
#include "shm/segment.hpp"
#include "stagelink/result.hpp"
#include "stagelink/shm.hpp"

namespace stagelink::shm {

inline constexpr uint32_t kDirMagic = 0x52444c53;  // "SLDR"
inline constexpr uint32_t kDirVersion = 3;  // 2: entries carry an explicit request id; 3: owner_gen
// An attach slot being claimed: its pid word holds this until its start time is written (a reaper
// reads a pid only with the start that belongs to it).
inline constexpr uint32_t kSlotClaiming = 0xffffffffu;
inline constexpr size_t kMaxAttach = 256;
inline constexpr size_t kMaxArenas = 256;
// A directory name squatted by another user: the next of this many names (ns, ns~1, ns~2, ...).
inline constexpr int kDirAlternates = 8;
inline constexpr size_t kKeyMax = 232;
inline constexpr uint32_t kMaxFanout = 8;
inline constexpr uint32_t kProbe = 64;  // one bit per slot in a uint64_t probe mask
static_assert(kProbe <= 64);
inline constexpr uint32_t kDying = 1u << 31;
// How long a WRITING entry may stay without its owner's identity before a reaper frees it.
inline constexpr uint64_t kUnownedGraceNs = 1'000'000'000ull;

enum EntryState : uint8_t { kFree = 0, kWriting = 1, kReady = 2, kCancelled = 3, kDone = 4 };

struct Ctl {
  uint8_t state, readers, claimed, released;  // released: bitmask by claim index
  uint32_t gen;
  static Ctl unpack(uint64_t w) {
    return Ctl{uint8_t(w), uint8_t(w >> 8), uint8_t(w >> 16), uint8_t(w >> 24), uint32_t(w >> 32)};
  }
  uint64_t pack() const {
    return uint64_t(state) | uint64_t(readers) << 8 | uint64_t(claimed) << 16 |
           uint64_t(released) << 24 | uint64_t(gen) << 32;
  }
};

struct AttachSlot {
  std::atomic<uint32_t> pid;
  std::atomic<uint64_t> start;
};

struct alignas(64) ArenaRec {
  std::atomic<uint32_t> state;  // 0 free, 1 claimed, 2 live
  std::atomic<uint32_t> gen;
  uint32_t owner_pid;
  uint32_t dedicated;
  uint64_t owner_start;
  uint64_t size;
  uint64_t created_ns;  // realtime
  char name[96];
};

struct alignas(64) Entry {
  std::atomic<uint64_t> ctl;
  uint64_t hash;
  uint32_t owner_pid;
  uint32_t arena;
  uint64_t owner_start;
  uint32_t arena_gen;
  // key[0, key_len): the internal key "put_key@from_to", whose first put_len bytes are the put key;
  // key[key_len, key_len + rid_len): the request the put was tied to (put(..., request_id)), if any.
  uint16_t key_len, put_len, rid_len;
  // The generation owner_pid/owner_start were written for (release, after them): a reaper judges a
  // WRITING entry's owner only when it equals the entry's generation. Between claiming the entry
  // and this store they are the previous owner's (or zero), and judging them freed live puts.
  uint32_t owner_gen;
  uint64_t offset, length;
  uint64_t created_ns;  // monotonic
  struct Reader {
    std::atomic<uint32_t> pid;
    std::atomic<uint64_t> start;
  } readers[kMaxFanout];
  char key[kKeyMax];
};

struct DirHeader {
  uint32_t magic, version;
  std::atomic<uint32_t> ready;
  uint32_t n_entries;
  uint64_t total_size;
  uint64_t created_ns;
  alignas(64) std::atomic<uint32_t> attach_word;  // kDying | count
  alignas(64) std::atomic<uint32_t> publish_seq;
  std::atomic<uint32_t> publish_waiters;
  alignas(64) std::atomic<uint32_t> release_seq;
  std::atomic<uint32_t> release_waiters;
  alignas(64) AttachSlot attached[kMaxAttach];
  ArenaRec arenas[kMaxArenas];
};

// A reader's hold on an entry.
struct Claim {
  uint32_t idx = 0, gen = 0, slot = 0;
  uint32_t arena = 0, arena_gen = 0;
  uint64_t offset = 0, length = 0;
  uint32_t replaced = 0;  // reserve: unread entries of the same key this put cancelled
};

uint64_t key_hash(std::string_view key);

// The probe window of `hash` as two bit masks (bit i: slot (start + i) & mask): slots whose hash
// word equals `hash`, and empty slots. Hints only: callers check the entry itself. `simd`: use
// AVX2 when the CPU has it (false: the portable loop; tests compare the two).
struct ProbeMasks {
  uint64_t match = 0, empty = 0;
};
ProbeMasks probe_window(const std::atomic<uint64_t>* hashes, uint32_t mask, uint32_t start, uint64_t hash,
                        bool simd = true);
// Whether an entry belongs to request `rid`: its put key is exactly `rid`, or it was tied to `rid`
// at put time. Nothing else (no prefix matching: "X" never frees "X_1" unless tied).
bool rid_matches(std::string_view put_key, std::string_view tied_rid, std::string_view rid);

class Directory {
 public:
  // Attach to (creating if needed) the directory of namespace `ns` under `shm_dir`. One attachment
  // per process and namespace is shared by every connector.
  static Result<std::shared_ptr<Directory>> attach(const std::string& shm_dir, const std::string& ns,
                                                   uint32_t n_entries);
  // Open an existing directory file without attaching (administration: ls, reap).
  static Result<std::shared_ptr<Directory>> open_admin(const std::string& shm_dir,
                                                       const std::string& file_name);
  ~Directory();
  // At process exit: leave every namespace this process is still attached to (the last process out
  // removes the directory), even where something still holds it -- a zero-copy view that the
  // language runtime never frees at exit (torch tensors alive then are not). The mappings stay, so
  // a late reader of such a view reads stale memory instead of faulting.
  static void detach_all_at_exit();

  const std::string& ns() const { return ns_; }
  const std::string& shm_dir() const { return shm_dir_; }
  const std::string& file_name() const { return name_; }
  // "sl.<uid>.<ns>." for arenas of this namespace; fixed at attach (a get checks arena names
  // against it, and getuid() is a system call).
  const std::string& prefix() const { return prefix_; }
  uint32_t n_entries() const { return hdr_->n_entries; }
  Entry& entry(uint32_t i) { return entries_[i]; }
  ArenaRec& arena(uint32_t i) { return hdr_->arenas[i]; }
  DirHeader& header() { return *hdr_; }

  // Producer side.
  // -> WRITING. `now`: mono_ns() of the caller, recorded as the entry's creation time. `put_len`:
  // length of the put key at the start of `key`; `rid`: the request it is tied to ("" for none).
  // An unread (READY) entry of the same key is cancelled and replaced when `replace`, else the put
  // fails with `exists`; an entry still being written always fails with `exists`.
  Result<Claim> reserve(std::string_view key, uint16_t put_len, std::string_view rid, uint64_t hash, uint64_t now,
                        bool replace = true);
  // -> READY. False when the entry is no longer this put's WRITING entry (a reaper reclaimed it:
  // its producer was judged dead); the caller returns the put's memory and fails the put.
  [[nodiscard]] bool publish(const Claim& c, uint8_t readers);
  void abandon(const Claim& c);                                                // WRITING -> FREE
  bool is_done(uint32_t idx, uint32_t gen);
  // Every reader released entry (idx, gen), or it is gone (freed, reused): the producer's memory
  // and credit may return.
  bool is_released(uint32_t idx, uint32_t gen);
  std::string key_of(uint32_t idx);  // the key entry idx holds (for messages)
  // The put key of entry (idx, gen) while a reader may still claim it (READY with claims left);
  // nullopt once every reader took it, or it was cancelled or freed. Its owner asks (the key of
  // an entry it owns does not change under it).
  std::optional<std::string> unread_put_key(uint32_t idx, uint32_t gen);
  void free_entry(uint32_t idx, uint32_t gen);  // DONE/any of ours -> FREE
  bool cancel(uint32_t idx, uint32_t gen);      // READY -> CANCELLED (or DONE)
  Result<std::pair<uint32_t, uint32_t>> register_arena(const std::string& name, uint64_t size,
                                                       bool dedicated);
  void unregister_arena(uint32_t idx, uint32_t gen);
  uint32_t release_seq() { return hdr_->release_seq.load(std::memory_order_acquire); }
  bool wait_release(uint32_t seen, uint64_t deadline_ns);
  // Arrivals: a counter every publish (and wake_getters) moves, and a wait in the kernel until it
  // moves past `seen` or `deadline_ns` (mono) passes. Returns whether it moved.
  uint32_t publish_seq() { return hdr_->publish_seq.load(std::memory_order_acquire); }
  bool wait_publish(uint32_t seen, uint64_t deadline_ns);

  // Reader side.
  std::optional<Claim> try_claim_key(std::string_view key, uint64_t hash);
  Result<Claim> claim(uint32_t idx, uint32_t gen, std::string_view key);
  // A claim whose reader died: the slot counts as released and one more reader may claim the
  // entry (at most kMaxFanout in all), so a retry reads what the dead reader never finished.
  // False when the entry moved on or has no slot left (the caller then releases it as read).
  bool give_back(uint32_t idx, uint32_t gen, uint32_t slot);
  // give_back for every claim of entry idx (as `c` shows it) whose reader is dead; true if any.
  bool give_back_dead_claims(uint32_t idx, const Ctl& c);
  // `stop`: checked after every wake-up; when it returns true the wait ends with `cancelled`.
  Result<Claim> wait_claim_key(std::string_view key, uint64_t hash, uint64_t deadline_ns,
                               const std::atomic<uint32_t>* stop = nullptr);
  // Wake every getter sleeping in wait_claim_key (they re-check and sleep again unless stopped).
  void wake_getters();
  void release(const Claim& c);
  // Map an arena for reading (cached per process unless dedicated).
  Result<std::shared_ptr<Segment>> map_arena(uint32_t idx, uint32_t gen);

  // Cancel every entry of request_id (rid_matches). Returns the count.
  size_t cancel_request(std::string_view request_id);
  // Reclaim what dead processes hold in this directory. Returns what was removed.
  std::vector<std::string> reap();
  size_t live_entries();
  uint32_t attached_count();

 private:
  Directory() = default;
  void detach();
  void finish_reader_release(uint32_t idx);
  bool attached_ = false;
  int attach_slot_ = -1;
  ForkStamp fork_;  // of the process that attached
  std::string shm_dir_, ns_, name_, prefix_;
  std::shared_ptr<Segment> seg_;
  DirHeader* hdr_ = nullptr;
  std::atomic<uint64_t>* hashes_ = nullptr;  // hash of each non-free entry, 0 when free
  Entry* entries_ = nullptr;
  std::mutex map_mu_;
  // WRITING entries seen without their owner's identity (reap): a producer says who it is within
  // nanoseconds of claiming an entry, so one still silent a grace period later died there.
  struct Unowned { uint32_t gen; uint64_t since_ns; };
  std::mutex unowned_mu_;
  std::unordered_map<uint32_t, Unowned> unowned_;
  struct Mapped { uint32_t gen; std::shared_ptr<Segment> seg; };
  std::unordered_map<uint32_t, Mapped> mapped_;
};

size_t directory_bytes(uint32_t n_entries);

}  // namespace stagelink::shm
