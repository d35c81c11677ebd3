// StoreConnector: payloads through Redis (one server or a Redis Cluster), the store as the
// rendezvous (the seed's MooncakeStoreConnector design): a receiver needs only the key.
//
// Keys of one put share a hash tag, so that in a cluster they live in one slot:
//   sl:{KEY@FROM_TO}:c:GEN:I   chunk I of the frame (GEN: this put's random generation)
//   sl:{KEY@FROM_TO}:m         meta: magic, generation, size, chunks, chunk size, XXH3 of the frame,
//                              request id
//   sl:{KEY@FROM_TO}:r         readers still to come
//   sl:{KEY@FROM_TO}:s         signal list: the generation, pushed after the last chunk and the meta
//   sl:req:{REQUEST}           the puts of a request (for cleanup)
// Everything carries the TTL (ttl_seconds). A get claims a reader atomically (a Lua script on the
// meta and the counter), reads the chunks (pipelined, over several connections when large), checks
// them against the meta (a chunk missing: the key was replaced meanwhile, read again, or deleted
// under the put, corrupt; a length or checksum wrong: corrupt), and the last reader deletes the put. A get that finds nothing blocks in
// BLPOP on the signal list until the put's push or its deadline: no polling.
#include "connectors/store_connector.hpp"

#include <sys/socket.h>
#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
// XXH3 on the widest vector unit the CPU has (AVX2, AVX-512), chosen at run time by libxxhash:
// 16 MiB hashes in 0.55 ms instead of the SSE2 build's 1.5 ms, once per put and once per get.
#include <xxh_x86dispatch.h>
#endif

#include <atomic>
#include <map>
#include <mutex>
#include <cstring>
#include <random>
#include <unistd.h>
#include <functional>
#include <optional>

#include "connectors/capabilities.hpp"
#include "connectors/internal_key.hpp"
#include "connectors/names.hpp"
#include "connectors/store_options.hpp"
#include "core/options.hpp"
#include "core/log.hpp"
#include "core/proc.hpp"
#include "stagelink/frame.hpp"
#include "store/redis.hpp"

namespace stagelink {
namespace {

using store::Cmd;
using store::Redis;
using store::Reply;

constexpr char kMagic[4] = {'S', 'L', 'S', '2'};
struct Meta {
  uint64_t gen = 0, size = 0, chunks = 0, chunk_bytes = 0, hash = 0, readers = 1;
  std::string rid;
};
// magic, the generation as 16 hex digits (the claim script names chunk 0 from it), then binary.
constexpr size_t kMetaFixed = 4 + 16 + 5 * 8;

std::string hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// A streaming XXH3 state (freed with the pointer); null without memory.
using HashState = std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)>;
HashState hash_state() {
  HashState h(XXH3_createState(), XXH3_freeState);
  if (h) XXH3_64bits_reset(h.get());
  return h;
}

std::string encode_meta(const Meta& m) {
  std::string s(kMetaFixed + m.rid.size(), '\0');
  std::memcpy(s.data(), kMagic, 4);
  std::memcpy(s.data() + 4, hex(m.gen).data(), 16);
  const uint64_t f[5] = {m.size, m.chunks, m.chunk_bytes, m.hash, m.readers};
  std::memcpy(s.data() + 20, f, sizeof f);
  std::memcpy(s.data() + kMetaFixed, m.rid.data(), m.rid.size());
  return s;
}
Result<Meta> decode_meta(std::string_view s) {
  Meta m;
  if (s.size() < kMetaFixed || std::memcmp(s.data(), kMagic, 4) != 0)
    return make_error(Errc::corrupt, "store meta of " + std::to_string(s.size()) + " bytes is not stagelink's");
  char* end = nullptr;
  const std::string g(s.substr(4, 16));
  m.gen = std::strtoull(g.c_str(), &end, 16);
  uint64_t f[5];
  std::memcpy(f, s.data() + 20, sizeof f);
  m.size = f[0];
  m.chunks = f[1];
  m.chunk_bytes = f[2];
  m.hash = f[3];
  m.readers = f[4];
  m.rid = std::string(s.substr(kMetaFixed));
  if (!end || *end || m.chunk_bytes == 0 || m.size > (uint64_t(1) << 40) ||
      m.chunks != (m.size + m.chunk_bytes - 1) / m.chunk_bytes || m.readers == 0)
    return make_error(Errc::corrupt, "store meta: " + std::to_string(m.chunks) + " chunks of " +
                                         std::to_string(m.chunk_bytes) + " bytes for " + std::to_string(m.size));
  return m;
}

}  // namespace

Status check_store_meta(std::string_view bytes) {
  auto m = decode_meta(bytes);
  if (!m.ok()) return std::move(m).error();
  return {};
}

namespace {

// One round trip for a get: claim a reader of the put (DECR of its counter; never below zero),
// and return its meta, how many readers remain, and chunk 0. The last reader of a put read by one
// reader takes the put away here (meta, counter, signal, chunk 0); the caller the other chunks.
// KEYS: meta, counter, signal; ARGV: the chunk name prefix, '1' to take the put out of its request's
// index too (one server: any key is reachable; a cluster's index lives in another slot: the caller
// does it), the internal key, and the largest chunk 0 returned here (larger ones are read by the
// caller straight into their place).
//
// A read of a payload that does not come whole in this reply (more than one chunk, or a chunk
// 0 larger than ARGV[4]) is held under a lease instead: the reader's id (ARGV[5]) in the zset
// KEYS[4], scored with its expiry (ARGV[6] ms plus the payload at 100 MB/s). Its chunks are read,
// not taken; kFinish ends the lease and counts the read done once every byte arrived, and the
// last read done takes the put away. A reader that dies in the middle never finishes: once its
// lease lapses, a claim that finds every read taken takes that read over (its reply's 4th
// element: 1 = leased). A read counts as done only when it completed. While reads are leased and
// none has lapsed, the reply is the milliseconds until the first lapses (an integer): a getter
// waits no longer than that before it claims again.
constexpr const char* kClaim =
    "local m = redis.call('GET', KEYS[1]) "
    "if not m then return nil end "
    "local function u64(i) local v = 0 if #m < i + 7 then return 0 end "
    "for k = 7, 0, -1 do v = v * 256 + string.byte(m, i + k) end return v end "
    "local t = redis.call('TIME') "
    "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "
    "local r = redis.call('DECR', KEYS[2]) "
    "if r < 0 then "
    "  redis.call('INCR', KEYS[2]) "
    "  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, 1) "
    "  if #dead == 0 then "
    "    local first = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES') "
    "    if #first == 2 then return math.max(1, tonumber(first[2]) - now) end "
    "    return nil "
    "  end "
    "  redis.call('ZREM', KEYS[4], dead[1]) "
    "  r = 0 "
    "end "
    "local c0 = ARGV[1] .. string.sub(m, 5, 20) .. ':0' "
    "local d = false "
    "if redis.call('STRLEN', c0) <= tonumber(ARGV[4]) then d = redis.call('GET', c0) end "
    "if not (d and u64(29) == 1) then "
    "  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[6]) + math.floor(u64(21) / 100000), ARGV[5]) "
    "  local ttl = redis.call('PTTL', KEYS[1]) "
    "  if ttl > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end "
    "  return {m, r, d, 1} "
    "end "
    "if r == 0 then redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4]) end "
    "if d and r == 0 and string.byte(m, 53) == 1 and string.sub(m, 54, 60) == '\\0\\0\\0\\0\\0\\0\\0' then "
    "redis.call('UNLINK', c0) end "
    "if r == 0 and ARGV[2] == '1' then redis.call('SREM', 'sl:req:{' .. string.sub(m, 61) .. '}', ARGV[3]) end "
    "return {m, r, d}";

// The end of a leased read (KEYS: meta, counter, signal, leases, done count; ARGV: the reader's
// id, the put's generation as 16 hex digits, '1' to take it out of its request's index, the
// internal key, the put's readers, its TTL in ms): nothing if the lease is no longer this
// reader's (it lapsed and another reader took the read over) or the key holds a newer put; else
// the read counts done, and the last one takes the put away. 1: it went; the caller then drops
// its chunks.
constexpr const char* kFinish =
    "if redis.call('ZREM', KEYS[4], ARGV[1]) == 0 then return 0 end "
    "local m = redis.call('GET', KEYS[1]) "
    "if not m or string.sub(m, 5, 20) ~= ARGV[2] then return 0 end "
    "local done = redis.call('INCR', KEYS[5]) "
    "redis.call('PEXPIRE', KEYS[5], ARGV[6]) "
    "if done < tonumber(ARGV[5]) then return 0 end "
    "redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]) "
    "if ARGV[3] == '1' then redis.call('SREM', 'sl:req:{' .. string.sub(m, 61) .. '}', ARGV[4]) end "
    "return 1";


// A frame as the spans it is made of: the header, zero padding, and each tensor's own memory.
std::vector<std::span<const std::byte>> frame_segments(const FramePlan& plan, std::span<const Tensor> tensors) {
  static const std::byte zeros[4096] = {};
  std::vector<std::span<const std::byte>> out;
  auto pad = [&](size_t n) {
    for (; n; n -= std::min(n, sizeof zeros)) out.emplace_back(zeros, std::min(n, sizeof zeros));
  };
  out.emplace_back(plan.head.data(), plan.head.size());
  size_t pos = plan.head.size();
  for (size_t i = 0; i < plan.offsets.size(); ++i) {
    pad(plan.offsets[i] - pos);
    if (plan.lengths[i]) out.emplace_back(tensors[i].data.data(), plan.lengths[i]);
    pos = plan.offsets[i] + plan.lengths[i];
  }
  pad(plan.total - pos);
  std::erase_if(out, [](auto s) { return s.empty(); });
  return out;
}

// Values up to this size travel inside the pipelines (the claim returns chunk 0 of this size or
// less); larger ones are written from and read into their place on the socket.
constexpr size_t kInlineChunk = 64u << 10;

// Frame buffers kept for reuse once their last view is dropped (up to `cap` bytes in all): a
// large payload's pages are faulted in once, not per get. Buffers outlive the cache safely.
class BufferCache : public std::enable_shared_from_this<BufferCache> {
 public:
  explicit BufferCache(size_t cap) : cap_(cap) {}
  ~BufferCache() {
    for (auto& [n, p] : free_) ::operator delete[](p);
  }
  std::shared_ptr<std::byte> take(size_t n) {
    std::byte* p = nullptr;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = free_.lower_bound(n);
      if (it != free_.end() && it->first <= 2 * n + (1u << 20)) {  // not much larger than asked
        n = it->first;
        p = it->second;
        cached_ -= n;
        free_.erase(it);
      }
    }
    if (!p) p = static_cast<std::byte*>(::operator new[](n, std::nothrow));
    if (!p) return nullptr;
    std::weak_ptr<BufferCache> home = weak_from_this();
    return std::shared_ptr<std::byte>(p, [home, n](std::byte* q) {
      if (auto c = home.lock()) c->give(q, n);
      else ::operator delete[](q);
    });
  }

 private:
  void give(std::byte* p, size_t n) {
    std::lock_guard<std::mutex> l(mu_);
    while (cached_ + n > cap_ && !free_.empty()) {  // the smallest go first
      cached_ -= free_.begin()->first;
      ::operator delete[](free_.begin()->second);
      free_.erase(free_.begin());
    }
    if (cached_ + n > cap_) {
      ::operator delete[](p);
      return;
    }
    free_.emplace(n, p);
    cached_ += n;
  }
  std::mutex mu_;
  std::multimap<size_t, std::byte*> free_;
  size_t cached_ = 0, cap_;
};

const metrics::Family kStoreWaits{"stagelink_store_waiting_gets_total", metrics::Kind::counter, "",
                                  "gets that waited on the store for their key (each once)", {"connector"}};
const metrics::Family kStoreCleanupErrors{"stagelink_store_cleanup_errors_total", metrics::Kind::counter, "",
                                          "cleanup() calls the store failed", {"connector"}};
const metrics::Family kStoreRoundTrips{"stagelink_store_round_trips_total", metrics::Kind::counter, "",
                                       "round trips to the store's servers (a pipelined batch, or one connection's "
                                       "part of a spread transfer)",
                                       {"connector"}};
const metrics::Family kStoreLeasedReads{"stagelink_store_leased_reads_total", metrics::Kind::counter, "",
                                        "reads taken under a lease (a put's last read of a large payload: held, "
                                        "not taken, until it completed)",
                                        {"connector"}};
const metrics::Family kStoreLeaseWaits{"stagelink_store_lease_waits_total", metrics::Kind::counter, "",
                                       "claims that found a put's last read leased by another reader (they wait "
                                       "for it to finish or lapse)",
                                       {"connector"}};

class StoreConnector final : public Connector, public WaitingGets {
 public:
  StoreConnector(std::string name, StoreOptions o, std::unique_ptr<Redis> r)
      : name_(std::move(name)), o_(std::move(o)), redis_(std::move(r)),
        cache_(std::make_shared<BufferCache>(o_.cache_bytes)) {
    std::random_device rd;
    rng_.seed((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid()) ^ mono_ns());
    // Limits read once: the largest value the server takes, and its memory.
    const std::string bulk = redis_->config_get("proto-max-bulk-len");
    max_bulk_ = bulk.empty() ? (512u << 20) : std::strtoull(bulk.c_str(), nullptr, 10);
    const std::string mm = redis_->config_get("maxmemory");
    maxmemory_ = mm.empty() ? 0 : std::strtoull(mm.c_str(), nullptr, 10);
  }
  ~StoreConnector() override { close(); }

  Status check_limits() const {
    if (o_.chunk_bytes > max_bulk_)
      return make_error(Errc::invalid_argument, "StoreConnector chunk_bytes " + std::to_string(o_.chunk_bytes) +
                                                    " exceeds the server's proto-max-bulk-len " + std::to_string(max_bulk_));
    return {};
  }

  const std::string& name() const override { return name_; }

  Result<PutResult> do_put(const std::string& from, const std::string& to, const std::string& key, const Payload& p,
                        const PutOptions& po) override {
    SL_TRY(open());
    SL_TRY(validate_name("from_stage", from, 64));
    SL_TRY(validate_name("to_stage", to, 64));
    SL_TRY(validate_name("key", key, 160));
    const std::string rid = po.request_id.empty() ? key : std::string(po.request_id);
    SL_TRY(validate_name("request_id", rid, 160));
    SL_ASSIGN(FramePlan plan, plan_frame(p));
    if (maxmemory_ && plan.total > maxmemory_)
      return fail(make_error(Errc::exhausted, "a payload of " + std::to_string(plan.total) +
                                                  " bytes exceeds the store's maxmemory (" + std::to_string(maxmemory_) +
                                                  "): refused, nothing written"));
    // A small frame is written once into a buffer; a large one is never assembled: its segments
    // (header, padding, the tensors' own memory) go to the socket as they are.
    std::vector<std::span<const std::byte>> segs = frame_segments(plan, p.tensors);
    std::shared_ptr<std::byte> frame;
    std::span<const std::byte> bytes;
    if (plan.total <= kInlineChunk) {
      frame = cache_->take(std::max<size_t>(plan.total, 1));
      if (!frame) return fail(make_error(Errc::exhausted, "no memory for a frame of " + std::to_string(plan.total) + " bytes"));
      write_frame(plan, p.tensors, frame.get());
      bytes = {frame.get(), plan.total};
    }
    Meta m;
    {
      std::lock_guard<std::mutex> l(rng_mu_);
      m.gen = rng_() | 1;
    }
    m.size = plan.total;
    // Chunks of equal size, none above chunk_bytes (a frame just over 1 MiB: two halves, not
    // 1 MiB and a sliver that costs a value of its own).
    m.chunks = (m.size + o_.chunk_bytes - 1) / o_.chunk_bytes;
    m.chunk_bytes = m.chunks ? (m.size + m.chunks - 1) / m.chunks : o_.chunk_bytes;
    // The checksum: a large frame's is taken chunk by chunk just before each goes out (still in
    // cache when the kernel copies it), and the meta that carries it is formatted after the last;
    // otherwise here, whole.
    HashState hs_owner = hash_state();
    XXH3_state_t* hs = hs_owner.get();
    if (!hs) return fail(make_error(Errc::exhausted, "no memory for a checksum state"));
    std::string meta;  // formatted below; the checksum rewritten in place once known
    auto hash_whole = [&] {
      XXH3_64bits_reset(hs);
      for (auto sg : segs) XXH3_64bits_update(hs, sg.data(), sg.size());
      m.hash = XXH3_64bits_digest(hs);
    };
    auto settle_meta = [&] {  // same length: the command's view of it stays valid
      const std::string enc = encode_meta(m);
      std::memcpy(meta.data(), enc.data(), enc.size());
    };
    if (plan.total <= kInlineChunk) hash_whole();
    m.rid = rid;
    const std::string ik = make_internal_key(key, from, to), base = "sl:{" + ik + "}";
    const std::string ttl = std::to_string(uint64_t(o_.ttl_s * 1000));
    const Deadline dl = deadline_after(o_.put_timeout_s + double(m.size) / 50e6);
    m.readers = po.readers ? po.readers : o_.readers;
    // The chunks; then the meta, the reader count and the signal; then the request's index. One
    // connection runs them in order, so a single-chunk put is one round trip (a cluster's index
    // lives in another slot: a second); chunks spread over several connections complete first.
    std::vector<Cmd> chunks;
    std::vector<Redis::SetItem> items;
    if (m.size <= kInlineChunk) {  // small: in the one pipeline below
      for (uint64_t i = 0; i < m.chunks; ++i) {  // each chunk its own slice of the frame
        const size_t at = size_t(i * m.chunk_bytes);
        chunks.emplace_back().arg("SET").arg(chunk_name(base, m.gen, i))
            .arg(bytes.subspan(at, std::min<size_t>(m.chunk_bytes, m.size - at))).arg("PX").arg(ttl);
      }
    } else {  // large: written from the frame to the sockets
      items.resize(m.chunks);
      size_t seg = 0, seg_off = 0;  // cut the segments into chunks
      for (uint64_t i = 0; i < m.chunks; ++i) {
        items[i].key = chunk_name(base, m.gen, i);
        size_t want = std::min<size_t>(m.chunk_bytes, m.size - size_t(i * m.chunk_bytes));
        while (want) {
          const size_t k = std::min(want, segs[seg].size() - seg_off);
          items[i].value.push_back(segs[seg].subspan(seg_off, k));
          want -= k;
          seg_off += k;
          if (seg_off == segs[seg].size()) {
            ++seg;
            seg_off = 0;
          }
        }
      }
    }
    const size_t first_fin = chunks.size();
    std::vector<Cmd>& cmds = chunks;
    cmds.emplace_back().arg("GET").arg(base + ":m");  // the replaced put's meta, if any
    meta = encode_meta(m);
    cmds.emplace_back().arg("SET").arg(base + ":m").arg(std::string_view(meta)).arg("PX").arg(ttl);
    cmds.emplace_back().arg("SET").arg(base + ":r").arg(std::to_string(m.readers)).arg("PX").arg(ttl);
    cmds.emplace_back().arg("DEL").arg(base + ":s").arg(base + ":l");  // and a lease on a replaced put
    cmds.emplace_back().arg("RPUSH").arg(base + ":s").arg(hex(m.gen));
    cmds.emplace_back().arg("PEXPIRE").arg(base + ":s").arg(ttl);
    const std::string req = "sl:req:{" + rid + "}";
    std::vector<Cmd> idx;
    std::vector<Cmd>& idx_to = o_.redis.cluster ? idx : cmds;
    idx_to.emplace_back().arg("SADD").arg(req).arg(ik);
    idx_to.emplace_back().arg("PEXPIRE").arg(req).arg(ttl);
    // Large values first; on one connection the rest follows on the same write (one round trip).
    std::vector<Reply> replies;
    if (!items.empty()) {
      auto sending = [&](size_t i) {
        for (auto part : items[i].value) XXH3_64bits_update(hs, part.data(), part.size());
        if (i + 1 == items.size()) {
          m.hash = XXH3_64bits_digest(hs);
          settle_meta();
        }
      };
      bool sent_each = false;
      Status st = redis_->set_values(base, items, ttl, o_.redis.connections, dl, cmds, &replies, sending, &sent_each);
      if (!st.ok()) {
        drop_chunks(base, m);  // nothing half-written stays
        return fail(std::move(st).error());
      }
      if (!sent_each) {  // over several connections: the meta goes below, hashed whole
        hash_whole();
        settle_meta();
      }
    }
    if (replies.empty()) {
      auto r = redis_->run(base, cmds, dl);
      if (!r.ok()) {
        drop_chunks(base, m);
        return fail(std::move(r).error());
      }
      replies = std::move(r).value();
    }
    Status st = all_ok(replies, "storing the payload");
    if (!st.ok()) {
      drop_chunks(base, m);
      return fail(std::move(st).error());
    }
    if (const Reply& old = replies[first_fin]; !store::is_nil(old))
      if (auto om = decode_meta(store::str(old)); om.ok() && om->gen != m.gen) drop_chunks(base, *om);  // replaced
    if (!idx.empty())
      if (auto ri = redis_->run(req, idx, dl); !ri.ok()) return fail(std::move(ri).error());
    PutResult out;
    out.size = m.size;  // no metadata: the store is the rendezvous (the seed's contract)
    return out;
  }

  Result<GetResult> do_get(const std::string& from, const std::string& to, const std::string& key, const Value*,
                        Deadline deadline, const GetOptions& go) override {
    SL_TRY(open());
    SL_TRY(validate_name("from_stage", from, 64));
    SL_TRY(validate_name("to_stage", to, 64));
    SL_TRY(validate_name("key", key, 160));
    const std::string ik = make_internal_key(key, from, to), base = "sl:{" + ik + "}";
    const Deadline cmd_dl = std::max(deadline, deadline_after(o_.redis.timeout_s));
    bool popped = false;  // this get took a signal off the list (then hands it on if readers remain)
    // [BLPOP, claim]: the claim rides behind the wait (see below).
    std::vector<Cmd> wait_then_claim(2);
    Cmd& claim = wait_then_claim[1];
    const std::string reader_id = hex(next_reader_id());
    claim.arg("EVAL").arg(kClaim).arg("4").arg(base + ":m").arg(base + ":r").arg(base + ":s").arg(base + ":l")
        .arg(base + ":c:").arg(o_.redis.cluster ? "0" : "1").arg(ik).arg(std::to_string(kInlineChunk))
        .arg(reader_id).arg(std::to_string(lease_ms()));
    std::optional<Reply> woken_claim;  // the claim that ran the moment the wait returned
    bool waited = false;               // go.keep_waiting is asked before every wait but the first
    for (;;) {
      // Claim a reader of the put there is, if any (with its first chunk).
      Result<std::vector<Reply>> r = std::vector<Reply>{};
      if (woken_claim) {
        r->push_back(std::move(*woken_claim));
        woken_claim.reset();
      } else {
        r = redis_->run(base, std::span<const Cmd>(&claim, 1), cmd_dl);
      }
      if (!r.ok()) return fail(std::move(r).error());
      Reply& c = (*r)[0];
      if (store::is_error(c)) return fail(make_error(Errc::io, "redis: claiming '" + ik + "': " + std::string(store::str(c))));
      const long long lease_left_ms = store::integer(c);  // its last read is held by another reader's lease
      if (store::elements(c) >= 2) {
        SL_ASSIGN(Meta m, decode_meta(store::str(store::element(c, 0))));
        const long long left = store::integer(store::element(c, 1));
        const bool leased = store::elements(c) >= 4 && store::integer(store::element(c, 3)) == 1;
        if (leased) leased_reads_.fetch_add(1, std::memory_order_relaxed);
        auto got = read_payload(base, m, std::move(c), left, cmd_dl, go, leased ? &reader_id : nullptr, ik);
        if (left <= 0 && o_.redis.cluster) {  // the index of the put's request, in its own slot
          const std::string req = "sl:req:{" + m.rid + "}";
          Cmd srem;
          srem.arg("SREM").arg(req).arg(ik);
          (void)redis_->run(req, std::span<const Cmd>(&srem, 1), cmd_dl);
        }
        if (!got.ok() && got.error().code == Errc::not_found) {  // a chunk gone: replaced (read the new
          if (const uint64_t now = current_gen(base); now && now != m.gen) continue;  // one), or deleted:
          drop_put(base, ik, m);  // say so, not wait out the deadline for a put that is there
          return fail(make_error(Errc::corrupt, "'" + ik + "': a chunk of its put is gone from the store (deleted "
                                                    "by another client, or evicted): the put cannot be read"));
        }
        if (!got.ok()) return fail(std::move(got).error());
        if (left > 0 && popped) wake_next(base, m);  // more readers: the next waiter may go
        return got;
      }
      // Nothing yet: wait on the signal list until the put pushes (no polling).
      if (deadline == kNoWait) return make_error(Errc::not_found, "no '" + ik + "' in the store");
      if (Clock::now() >= deadline) {
        return make_error(Errc::timeout, "no '" + ik + "' in the store before the deadline");
      }
      if (waited && go.keep_waiting && !go.keep_waiting())
        return make_error(Errc::cancelled, "the get of '" + ik + "' was interrupted while it waited");
      if (!waited) waits_.fetch_add(1);  // "waits": gets that waited, each once however many stretches
      waited = true;
      Deadline until = wait_slice_end(deadline, go.keep_waiting);  // the BLPOP waits this long at most
      if (lease_left_ms > 0) {  // claim again when that lease lapses (its reader may have died)
        lease_waits_.fetch_add(1, std::memory_order_relaxed);
        until = std::min(until, deadline_after(double(lease_left_ms + 5) / 1000.0));
      }
      const double left_s = std::chrono::duration<double>(until - Clock::now()).count();
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.3f", std::max(0.001, left_s));
      // The claim follows the BLPOP in one pipeline: the server runs it the moment the pop
      // returns, so a woken get has its meta and first chunk without another round trip.
      Cmd& b = wait_then_claim[0];
      b = Cmd();
      b.arg("BLPOP").arg(base + ":s").arg(std::string(secs));
      Waiter me;
      {
        std::lock_guard<std::mutex> l(wait_mu_);
        if (closed_.load()) return make_error(Errc::cancelled, name_ + " closed while '" + ik + "' was awaited");
        waiters_.emplace(key, &me);
      }
      auto w = redis_->blocking(base, wait_then_claim, until, &me.fd);
      {
        std::lock_guard<std::mutex> l(wait_mu_);
        for (auto it = waiters_.lower_bound(key); it != waiters_.end() && it->first == key; ++it)
          if (it->second == &me) {
            waiters_.erase(it);
            break;
          }
      }
      if (me.abandoned.load()) return make_error(Errc::cancelled, "the get of '" + ik + "' was abandoned");
      if (!w.ok()) return fail(std::move(w).error());
      const Reply& popped_reply = (*w)[0];
      popped = popped || store::elements(popped_reply) == 2;
      if (store::is_error(popped_reply))
        return fail(make_error(Errc::io, "redis: waiting for '" + ik + "': " + std::string(store::str(popped_reply))));
      // Popped (or the wait ended): the claim that followed says what there is. A stale signal
      // finds nothing and waits again; a claim the cluster redirected is run again, routed.
      if (w->size() == 2 && !store::is_error((*w)[1])) woken_claim = std::move((*w)[1]);
    }
  }

  size_t do_cleanup(const std::string& rid) override {
    if (!redis_) return 0;
    const std::string req = "sl:req:{" + rid + "}";
    const Deadline dl = deadline_after(o_.redis.timeout_s);
    std::vector<Cmd> q(1);
    q[0].arg("SMEMBERS").arg(req);
    auto r = redis_->run(req, q, dl);
    if (!r.ok()) {
      cleanup_errors_.fetch_add(1);
      SL_LOG_WARN("%s cleanup(%s): %s", name_.c_str(), rid.c_str(), r.error().message.c_str());
      return 0;
    }
    size_t n = 0;
    for (size_t i = 0; i < store::elements((*r)[0]); ++i) {
      const std::string ik(store::str(store::element((*r)[0], i)));
      const std::string base = "sl:{" + ik + "}";
      std::vector<Cmd> g(1);
      g[0].arg("GET").arg(base + ":m");
      auto m = redis_->run(base, g, dl);
      if (!m.ok() || store::is_nil((*m)[0])) continue;
      auto meta = decode_meta(store::str((*m)[0]));
      if (!meta.ok() || meta->rid != rid) continue;  // replaced by a put of another request: not ours
      drop_put(base, ik, *meta);
      ++n;
    }
    std::vector<Cmd> d(1);
    d[0].arg("UNLINK").arg(req);
    (void)redis_->run(req, d, dl);
    return n;
  }

  Value health() override {
    Value::Map m;
    m.emplace_back("status", closed_.load() ? "closed" : "healthy");
    m.emplace_back("connector", name_);
    m.emplace_back("backend", "redis");
    options::add_ignored(m, o_.ignored);
    if (redis_) {
      Value info = redis_->info();
      if (const Value* ok = info.find("reachable"); ok && ok->is<bool>() && !ok->as<bool>()) m[0].second = "unreachable";
      m.emplace_back("store", std::move(info));
    }
    add_counts(m);
    m.emplace_back("waits", uint64_t(waits_.load()));
    m.emplace_back("cleanup_errors", uint64_t(cleanup_errors_.load()));
    m.emplace_back("ttl_seconds", o_.ttl_s);
    m.emplace_back("chunk_bytes", uint64_t(o_.chunk_bytes));
    m.emplace_back("connections", uint64_t(o_.redis.connections));
    return Value(std::move(m));
  }

  // Every get of `key` blocked in this connector returns `cancelled` at once: its waiting
  // connection is shut down (and dialled again by the next call).
  void* find_capability(CapabilityId id) override {
    return id == CapabilityId::waiting_gets ? static_cast<WaitingGets*>(this) : nullptr;
  }
  size_t abandon_get(const std::string& key) override {
    std::lock_guard<std::mutex> l(wait_mu_);
    size_t n = 0;
    for (auto it = waiters_.lower_bound(key); it != waiters_.end() && it->first == key; ++it, ++n) wake(*it->second);
    return n;
  }

  // Wakes blocked gets (cancelled) and closes idle connections; calls under way finish (or fail)
  // and their connections close as they come back. The client itself goes with the connector.
  void close() override {
    metrics_reg_.reset();
    if (closed_.exchange(true)) return;
    {
      std::lock_guard<std::mutex> l(wait_mu_);
      for (auto& [k, w] : waiters_) wake(*w);
    }
    if (redis_) redis_->close_idle();
  }

 private:
  Status open() const {
    if (closed_.load() || !redis_) return make_error(Errc::closed, name_ + " is closed");
    return {};
  }
  struct Waiter {
    std::atomic<int> fd{-1};
    std::atomic<bool> abandoned{false};
  };
  static void wake(Waiter& w) {  // the protocol of Redis::blocking's fd_slot
    w.abandoned.store(true);
    const int fd = w.fd.exchange(-2);
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
    w.fd.store(-3);
  }
  template <class E>
  E fail(E e) {  // a failed put or get (the Connector base counts it)
    return e;
  }
  static std::string chunk_name(const std::string& base, uint64_t gen, uint64_t i) {
    return base + ":c:" + hex(gen) + ":" + std::to_string(i);
  }
  static Status all_ok(const std::vector<Reply>& rs, const char* what) {
    for (const Reply& r : rs)
      if (store::is_error(r)) {
        const std::string e(store::str(r));
        return make_error(e.rfind("OOM", 0) == 0 ? Errc::exhausted : Errc::io, std::string("redis: ") + what + ": " + e);
      }
    return {};
  }

  // The chunks, checked against the meta, as one frame. A single chunk that came with the claim is
  // the frame itself (the reply's buffer, no copy); otherwise every chunk not in the claim is read
  // from the socket straight into its place in one buffer from the cache (read, not taken: every
  // such read is leased). not_found: a chunk is gone (the key was replaced or cleaned up meanwhile).
  // `lease`: this reader holds its read under that id (kClaim): its chunks are read, not taken,
  // and kFinish counts the read done (the last one taking the put away) once they all arrived
  // intact.
  Result<GetResult> read_payload(const std::string& base, const Meta& m, Reply claim, long long left, Deadline dl,
                                 const GetOptions& go, const std::string* lease, const std::string& ik) {
    const std::string_view first = store::str(store::element(claim, 2));  // chunk 0, when small enough
    if (m.chunks == 1 && first.data()) {
      if (first.size() != m.size)
        return make_error(Errc::corrupt, "chunk 0 in the store holds " + std::to_string(first.size()) + " bytes, " +
                                             std::to_string(m.size) + " expected (truncated or overwritten)");
      auto holder = std::make_shared<Reply>(std::move(claim));
      const std::string_view s0 = store::str(store::element(*holder, 2));
      count_done(base, m, dl);
      return finish({reinterpret_cast<const std::byte*>(s0.data()), s0.size()}, holder, m, go);  // whole: never leased
    }
    std::shared_ptr<std::byte> buf = cache_->take(std::max<size_t>(size_t(m.size), 1));
    if (!buf) return make_error(Errc::exhausted, "no memory for a payload of " + std::to_string(m.size) + " bytes");
    std::vector<Redis::GetItem> items;
    for (uint64_t i = 0; i < m.chunks; ++i) {
      const size_t off = size_t(i * m.chunk_bytes), n = size_t(std::min<uint64_t>(m.chunk_bytes, m.size - off));
      if (i == 0 && first.data()) {  // came with the claim (and the claim took it away if this is the last reader)
        if (first.size() != n)
          return make_error(Errc::corrupt, "chunk 0 in the store holds " + std::to_string(first.size()) + " bytes, " +
                                               std::to_string(n) + " expected (truncated or overwritten)");
        std::memcpy(buf.get(), first.data(), n);
        continue;
      }
      items.push_back({chunk_name(base, m.gen, i), {buf.get() + off, n}});
    }
    const Deadline big = later(dl, std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(double(m.size) / 50e6)));
    // The checksum as the chunks land, while each is still in cache (read on one connection, in
    // order); where that did not cover the frame, finish() hashes it whole.
    HashState st_owner = hash_state();
    XXH3_state_t* st = st_owner.get();
    if (!st) return make_error(Errc::exhausted, "no memory for a checksum state");
    size_t hashed = 0;
    if (first.data() && m.chunks > 1) {
      XXH3_64bits_update(st, buf.get(), first.size());
      hashed = first.size();
    }
    auto arrived = [&](size_t j) {
      if (items[j].dst.data() != buf.get() + hashed) return;  // out of order: hashed whole later
      XXH3_64bits_update(st, items[j].dst.data(), items[j].dst.size());
      hashed += items[j].dst.size();
    };
    SL_TRY(redis_->get_values(base, items, !lease && m.readers == 1 && left <= 0, o_.redis.connections, big, arrived));
    std::optional<uint64_t> sum;
    if (hashed == m.size) sum = XXH3_64bits_digest(st);
    auto got = finish({buf.get(), size_t(m.size)}, std::shared_ptr<const void>(buf, buf.get()), m, go, sum);
    if (!got.ok()) return got;  // a lease of ours lapses: another reader may try
    // The buffer is this process's and this get's alone (back to the cache when dropped): a
    // caller that would copy it out (private_ok) may take it as it is, one copy of the payload less.
    got->owned = go.zero_copy && go.hooks && go.hooks->private_ok;
    if (!lease) {
      count_done(base, m, dl);
      return got;
    }
    // Every byte is here: the read counts done, and the last one takes the put away.
    Cmd f;
    f.arg("EVAL").arg(kFinish).arg("5").arg(base + ":m").arg(base + ":r").arg(base + ":s").arg(base + ":l")
        .arg(base + ":d:" + hex(m.gen)).arg(*lease).arg(hex(m.gen)).arg(o_.redis.cluster ? "0" : "1").arg(ik)
        .arg(std::to_string(m.readers)).arg(std::to_string(uint64_t(o_.ttl_s * 1000)));
    auto done = redis_->run(base, std::span<const Cmd>(&f, 1), dl);
    if (done.ok() && !store::is_error((*done)[0]) && store::integer((*done)[0]) == 1) drop_chunks(base, m);
    return got;
  }

  // The frame's checksum, then the payload (views that hold `keep`, or a copy).
  static Result<GetResult> finish(std::span<const std::byte> frame, std::shared_ptr<const void> keep, const Meta& m,
                                  const GetOptions& go, std::optional<uint64_t> sum = std::nullopt) {
    if ((sum ? *sum : XXH3_64bits(frame.data(), frame.size())) != m.hash)
      return make_error(Errc::corrupt, "the payload in the store does not match its checksum (corrupted)");
    GetResult g;
    g.size = size_t(m.size);
    if (go.zero_copy) {
      SL_TRY(decode_frame_into(frame, std::move(keep), g.payload, !(go.hooks && go.hooks->raw_tree)));
    } else {
      SL_TRY(decode_frame_copy_into(frame, g.payload));
    }
    return g;
  }

  // Several readers: each counts itself done after reading, and the one that completes the count
  // takes the chunks (a reader that claimed earlier may still be reading when the last claims).
  void count_done(const std::string& base, const Meta& m, Deadline dl) {
    if (m.readers <= 1) return;
    std::vector<Cmd> done(2);
    done[0].arg("INCR").arg(base + ":d:" + hex(m.gen));
    done[1].arg("PEXPIRE").arg(base + ":d:" + hex(m.gen)).arg(std::to_string(uint64_t(o_.ttl_s * 1000)));
    auto d = redis_->run(base, done, dl);
    if (d.ok() && uint64_t(store::integer((*d)[0])) >= m.readers) {
      drop_chunks(base, m);
      Cmd u;
      u.arg("UNLINK").arg(base + ":d:" + hex(m.gen));
      (void)redis_->run(base, std::span<const Cmd>(&u, 1), dl);
    }
  }

  void drop_chunks(const std::string& base, const Meta& m) {
    if (!m.chunks) return;
    Cmd c;
    c.arg("UNLINK");
    std::vector<std::string> names(m.chunks);
    for (uint64_t i = 0; i < m.chunks; ++i) {
      names[i] = chunk_name(base, m.gen, i);
      c.arg(names[i]);
    }
    (void)redis_->run(base, std::span<const Cmd>(&c, 1), deadline_after(o_.redis.timeout_s));
  }
  uint64_t current_gen(const std::string& base) {  // what the meta names now; 0: none, unreadable
    Cmd c;
    c.arg("GET").arg(base + ":m");
    auto r = redis_->run(base, std::span<const Cmd>(&c, 1), deadline_after(o_.redis.timeout_s));
    if (!r.ok() || store::is_error((*r)[0]) || store::is_nil((*r)[0])) return 0;
    auto now = decode_meta(store::str((*r)[0]));
    return now.ok() ? now->gen : 0;
  }
  // Delete a put (only if the meta still names this generation: a newer put stays).
  void drop_put(const std::string& base, const std::string& ik, const Meta& m) {
    if (current_gen(base) == m.gen) {
      std::vector<Cmd> d(1);
      d[0].arg("UNLINK").arg(base + ":m").arg(base + ":r").arg(base + ":s").arg(base + ":l");
      (void)redis_->run(base, d, deadline_after(o_.redis.timeout_s));
      const std::string req = "sl:req:{" + m.rid + "}";
      std::vector<Cmd> s(1);
      s[0].arg("SREM").arg(req).arg(ik);
      (void)redis_->run(req, s, deadline_after(o_.redis.timeout_s));
    }
    drop_chunks(base, m);
  }
  // A leased read's base duration: the longer of 2 s and twice the command timeout (kClaim adds
  // the payload's size at 100 MB/s).
  uint64_t lease_ms() const { return uint64_t(std::max(2000.0, 2000.0 * o_.redis.timeout_s)); }
  static uint64_t next_reader_id() {
    static std::atomic<uint64_t> n{0};
    static const uint64_t salt = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    return salt ^ (uint64_t(::getpid()) << 40) ^ n.fetch_add(1);
  }

  // A reader took the signal and readers remain: put the signal back for the next waiter.
  void wake_next(const std::string& base, const Meta& m) {
    std::vector<Cmd> c(1);
    c[0].arg("RPUSH").arg(base + ":s").arg(hex(m.gen));
    (void)redis_->run(base, c, deadline_after(o_.redis.timeout_s));
  }

  std::string name_;
  StoreOptions o_;
  std::unique_ptr<Redis> redis_;
  uint64_t max_bulk_ = 512u << 20, maxmemory_ = 0;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;
  std::shared_ptr<BufferCache> cache_;
  std::atomic<bool> closed_{false};
  std::mutex wait_mu_;
  std::multimap<std::string, Waiter*> waiters_;  // gets blocked in BLPOP, by key
  // Beyond what the Connector base counts.
  std::atomic<uint64_t> waits_{0}, cleanup_errors_{0}, leased_reads_{0}, lease_waits_{0};
  struct Metrics final : metrics::Source {
    explicit Metrics(StoreConnector& c) : c(c) {}
    void collect(metrics::Sink& out) const override {
      const std::string l = c.metrics_label();
      out.value(kStoreWaits, {l}, double(c.waits_.load()));
      out.value(kStoreCleanupErrors, {l}, double(c.cleanup_errors_.load()));
      out.value(kStoreLeasedReads, {l}, double(c.leased_reads_.load()));
      out.value(kStoreLeaseWaits, {l}, double(c.lease_waits_.load()));
      if (c.redis_) out.value(kStoreRoundTrips, {l}, double(c.redis_->round_trips()));
    }
    StoreConnector& c;
  } metrics_{*this};
  metrics::Registration metrics_reg_{&metrics_};  // reset first in close()
};

}  // namespace

Result<std::unique_ptr<Connector>> make_store_connector(const std::string& name, const Value& extra) {
  SL_ASSIGN(StoreOptions o, store_options(extra));
  SL_ASSIGN(auto r, Redis::connect(o.redis));
  auto c = std::make_unique<StoreConnector>(name, std::move(o), std::move(r));
  SL_TRY(c->check_limits());
  return std::unique_ptr<Connector>(std::move(c));
}

}  // namespace stagelink
