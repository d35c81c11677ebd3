// The relay over stagelink's connectors: credits per edge, completion by release, cleanup, close.
// See include/stagelink/relay.hpp.
#include "stagelink/relay.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "connectors/capabilities.hpp"
#include "core/options.hpp"
#include "core/proc.hpp"
#include "stagelink/trace.hpp"

namespace stagelink {
namespace {

std::atomic<uint64_t> g_relay_ids{0};

// One put in flight: it holds a credit of `edge` until released.
struct PutRec {
  std::string edge, rid;
  Value md;
  std::atomic<bool> released{false};
  std::atomic<bool> cancelled{false};
};

// The same-process backend: payloads by reference, in one table per process (colocated stages
// each have their own relay and read each other's puts).
struct LocalItem {
  Payload payload;
  std::shared_ptr<const void> object;  // RelayPutOptions::object: dropped outside the table's lock
  size_t size = 0;
  uint32_t readers_left = 1;
  uint64_t relay = 0;
  std::shared_ptr<PutRec> rec;
};
struct LocalTable {
  std::mutex mu;
  std::condition_variable cv;  // a release happened, or a relay closed
  uint64_t epoch = 0;
  uint64_t next_id = 1;
  std::unordered_map<uint64_t, LocalItem> items;
};
LocalTable& local_table() {
  static LocalTable* t = new LocalTable;  // never destroyed: relays may close during exit
  return *t;
}

}  // namespace

using options::Key;
using options::Type;
// The relay's config (docs/relay.md, docs/pipeline.md's `relay:`): a closed schema, every unknown
// key refused (only stagelink and SGLang-Omni's relay arguments write it).
constexpr Key kRelayKeys[] = {
    {"backend", Type::choice, "shm", "shm, ucx (the transfer engine), local (same process) or connector", 0, 0,
     "shm|ucx|local|connector"},
    {"connector", Type::string, "", "with backend connector: the connector class"},
    {"extra", Type::map, "", "the connector's extra (shm's namespace, ucx's host and zmq_port, ...)"},
    {"slot_size_mb", Type::number, "16", "the pool's slot size; larger payloads get memory of their own", 0.001,
     1 << 20},
    {"credits", Type::integer, "8", "unread puts per edge before a put waits", 1, 65536},
    {"rank", Type::integer, "0", "this relay's rank (SGLang-Omni's)", 0, 1 << 20},
    {"world_size", Type::integer, "0", "ranks in all (SGLang-Omni's)", 0, 1 << 20},
    {"device", Type::string, "cpu", "where relay buffers live (cpu)"},
    {"timeout_s", Type::number, "30", "how long a put waits for a credit and a get for its transfer", 0, 1e9},
    {"engine_id", Type::string, "", "SGLang-Omni's engine id, carried in the metadata"},
};
constexpr options::Schema kRelaySchema{"relay config", "", kRelayKeys, true};

constexpr RelayBackend kRelayBackends[] = {
    {"shm", "SharedMemoryConnector", true, "shared memory within a host: a pool of slot_size_mb x credits"},
    {"ucx", "TransferEngineConnector", false, "the transfer engine (UCX over TCP or RDMA) between hosts"},
    {"local", "", true, "within one process: objects passed by reference"},
    {"connector", "", false, "any registered connector, named in `connector`"},
};

std::span<const RelayBackend> relay_backends() { return kRelayBackends; }
const options::Schema& relay_schema() { return kRelaySchema; }

std::string RelayConfig::connector_name() const {
  if (backend == "connector") return connector;
  for (const RelayBackend& b : kRelayBackends)
    if (b.name == backend) return std::string(b.connector);
  return connector;
}

bool RelayConfig::host_local() const {
  if (backend != "connector")
    for (const RelayBackend& b : kRelayBackends)
      if (b.name == backend) return b.host_local;
  const auto d = find_connector(connector_name());
  return d && d->has(ConnectorTrait::host_local);
}

Result<RelayConfig> RelayConfig::from_value(const Value& v) {
  RelayConfig c;
  SL_ASSIGN(const options::Reader r, options::Reader::open(kRelaySchema, v));
  SL_TRY(r.read("backend", c.backend));
  SL_TRY(r.read("connector", c.connector));
  SL_TRY(r.read("device", c.device));
  SL_TRY(r.read("engine_id", c.engine_id));
  SL_TRY(r.read("slot_size_mb", c.slot_size_mb));
  SL_TRY(r.read_int("credits", c.credits));
  SL_TRY(r.read_int("rank", c.rank));
  SL_TRY(r.read_int("world_size", c.world_size));
  SL_TRY(r.read("timeout_s", c.timeout_s));
  if (const Value* e = v.find("extra"); e && !e->is_nil()) {
    if (!e->is<Value::Map>()) return make_error(Errc::invalid_argument, "relay config: 'extra' must be a map");
    c.extra = *e;
  }
  if (c.backend == "ucx") {  // the transfer engine (UCX), extra: its keys (host, zmq_port, protocol, ...)
    c.connector = c.connector_name();
    c.backend = "connector";
  }
  if (c.backend == "connector" && c.connector.empty())
    return make_error(Errc::invalid_argument, "relay config: backend 'connector' needs 'connector' (a class name)");
  if (c.device != "cpu")
    return make_error(Errc::unsupported, "relay config: device '" + c.device + "': only cpu relay buffers are built");
  return c;
}

struct RelayOp::State {
  bool is_put = false;
  std::shared_ptr<RelayCore> core;
  std::shared_ptr<PutRec> rec;
  Value metadata;
  Payload payload;
  std::shared_ptr<const void> object;  // a local get's RelayPutOptions::object
  size_t size = 0;
  bool owned = false;
};

namespace {
using metrics::Family;
using metrics::Kind;
const Family kRelayPuts{"stagelink_relay_puts_total", Kind::counter, "", "put_async calls that published", {"backend"}};
const Family kRelayGets{"stagelink_relay_gets_total", Kind::counter, "", "get_async calls that read a put", {"backend"}};
const Family kRelayBytesOut{"stagelink_relay_put_bytes_total", Kind::counter, "bytes", "bytes the relay's puts published",
                            {"backend"}};
const Family kRelayBytesIn{"stagelink_relay_get_bytes_total", Kind::counter, "bytes", "bytes the relay's gets read",
                           {"backend"}};
const Family kCreditWaits{"stagelink_relay_credit_waits_total", Kind::counter, "",
                          "puts that waited for a credit (their edge's credits all held by unread puts)", {"backend"}};
const Family kCreditTimeouts{"stagelink_relay_credit_timeouts_total", Kind::counter, "",
                             "puts that found no credit before their deadline", {"backend"}};
const Family kCreditWait{"stagelink_relay_credit_wait_seconds", Kind::histogram, "seconds",
                         "how long a put that waited for a credit waited", {"backend"}};
const Family kCreditsInUse{"stagelink_relay_credits_in_use", Kind::gauge, "",
                           "credits held by unread puts, per edge (a full edge holds `credits`)", {"backend", "edge"}};
const Family kCredits{"stagelink_relay_credits", Kind::gauge, "", "credits per edge (the relay's config)", {"backend"}};
}  // namespace

class RelayCore : public std::enable_shared_from_this<RelayCore> {
 public:
  explicit RelayCore(RelayConfig c) : cfg(std::move(c)), id(g_relay_ids.fetch_add(1) + 1) {
    prefix = std::to_string(getpid()) + "." + std::to_string(id) + ".";
  }

  Status init() {
    if (cfg.backend == "local") return {};
    Value::Map extra;
    if (cfg.extra.is<Value::Map>()) extra = cfg.extra.as<Value::Map>();
    const std::string name = cfg.connector_name();
    const auto desc = find_connector(name);
    if (cfg.backend == "shm") {
      auto has = [&](const char* k) {
        return std::any_of(extra.begin(), extra.end(), [&](auto& kv) { return kv.first == k; });
      };
      // The pool: one slot per credit, reused; larger payloads get a segment of their own.
      if (!has("arena_bytes"))
        extra.emplace_back("arena_bytes", uint64_t(std::max(1.0, cfg.slot_size_mb * cfg.credits) * (1 << 20)));
      if (!has("put_timeout_s")) extra.emplace_back("put_timeout_s", cfg.timeout_s);
    } else if (desc && desc->has(ConnectorTrait::side_channel)) {
      auto has = [&](const char* k) {
        return std::any_of(extra.begin(), extra.end(), [&](auto& kv) { return kv.first == k; });
      };
      // Every relay serves its own side channel: a free port unless one is asked for (stage
      // processes of one host would otherwise collide on the seed's default 50051).
      if (!has("zmq_port")) extra.emplace_back("zmq_port", uint64_t(0));
      if (!has("timeout_s")) extra.emplace_back("timeout_s", cfg.timeout_s);
    }
    SL_ASSIGN(conn, create_connector(name, Value(std::move(extra))));
    releases = conn->capability<ReleaseTracking>();
    lending = conn->capability<Lending>();
    link = conn->capability<SenderLink>();
    if (auto* f = conn->capability<BindingFields>()) device_slots = f->device_slots();
    lookup_only = desc && desc->has(ConnectorTrait::lookup_gets);
    return {};
  }

  bool is_local() const { return cfg.backend == "local"; }
  size_t device_slots = 0;  // the connector's BindingFields::device_slots(), read once at init
  bool lookup_only = false;  // a shared-memory connector: a get by metadata is one lookup
  // The connector's capabilities the relay uses (null where it has none: a connector that cannot
  // report releases counts a put released once sent, one that lends nothing gets a copy).
  ReleaseTracking* releases = nullptr;
  Lending* lending = nullptr;
  SenderLink* link = nullptr;

  // Forget released puts of `edge` (their credits return). Under mu.
  void reap_locked(std::deque<std::shared_ptr<PutRec>>& q) {
    for (auto it = q.begin(); it != q.end();) {
      if (released(**it)) it = q.erase(it);
      else ++it;
    }
  }

  bool released(PutRec& r) {
    if (r.released.load(std::memory_order_acquire)) return true;
    if (is_local() || !conn) return false;
    auto rr = releases ? releases->put_released(r.md) : Result<bool>(true);
    if (rr.ok() && !rr.value()) return false;
    r.released.store(true, std::memory_order_release);
    return true;
  }

  uint64_t epoch() {
    if (is_local()) {
      std::lock_guard<std::mutex> l(local_table().mu);
      return local_table().epoch;
    }
    return releases ? releases->release_epoch() : 0;
  }

  // Sleep until a release may have happened, `deadline`, or close(). The shared-memory wait is cut
  // into kWaitCheckEvery slices only to notice close() of this relay (releases wake it at once).
  void wait_epoch(uint64_t seen, Deadline deadline) {
    if (is_local()) {
      auto& t = local_table();
      std::unique_lock<std::mutex> l(t.mu);
      t.cv.wait_until(l, deadline, [&] { return t.epoch != seen || closed.load(); });
      return;
    }
    if (releases) releases->wait_release_epoch(seen, std::min(deadline, later(Clock::now(), kWaitCheckEvery)));
  }

  Result<std::shared_ptr<PutRec>> take_credit(const std::string& edge, std::string_view rid, Deadline deadline,
                                               const std::function<bool()>& keep_waiting,
                                               std::string_view traceparent) {
    auto rec = std::make_shared<PutRec>();
    rec->edge = edge;
    rec->rid = std::string(rid);
    bool waited = false;
    const uint64_t t0 = metrics::ticks();
    const uint64_t w0 = traceparent.empty() ? 0 : trace::now_ns();
    auto traced = [&](const char* outcome) {
      if (!w0 || !waited) return;
      Value::Map a;
      a.emplace_back("edge", edge);
      a.emplace_back("backend", cfg.backend);
      a.emplace_back("outcome", outcome);
      trace::record_under(traceparent, "relay.credit_wait", "relay", w0, rid, Value(std::move(a)));
    };
    for (;;) {
      const uint64_t seen = epoch();  // before the check: a release after it ends the wait
      {
        std::lock_guard<std::mutex> l(mu);
        if (closed) return make_error(Errc::closed, "relay closed");
        auto& q = inflight[edge];
        reap_locked(q);
        if (q.size() < cfg.credits) {
          q.push_back(rec);
          if (waited) {
            credit_waits.add();
            credit_wait.since(t0);
            traced("credit");
          }
          return rec;
        }
        if (Clock::now() >= deadline) {
          credit_timeouts.add();
          waited = true;
          traced("timeout");
          std::string holders;
          for (size_t i = 0; i < q.size() && i < 4; ++i) holders += (i ? ", " : "") + q[i]->rid;
          return make_error(Errc::exhausted, "relay: no credit for edge '" + edge + "' after " +
                                                 std::to_string(cfg.timeout_s) + " s: all " +
                                                 std::to_string(cfg.credits) +
                                                 " are held by unread puts (requests: " + holders +
                                                 (q.size() > 4 ? ", ..." : "") + "); is the receiver reading?");
        }
      }
      if (waited && keep_waiting && !keep_waiting())
        return make_error(Errc::cancelled, "relay: the put on edge '" + edge + "' was interrupted while it waited for a credit");
      waited = true;
      wait_epoch(seen, wait_slice_end(deadline, keep_waiting));
    }
  }

  // SGLang-Omni's put metadata fields, which its stage code reads: the sender's engine_id, and
  // transfer_info.size, the bytes a receiver's destination buffer needs (relay_io sizes its
  // uint8 buffer by it before get_async(metadata, dest_tensor)).
  void add_sglang_fields(Value::Map& md, size_t data_bytes, std::string_view rid) const {
    md.emplace_back("engine_id", cfg.engine_id);
    Value::Map ti;
    ti.emplace_back("size", uint64_t(data_bytes));
    ti.emplace_back("req_id", std::string(rid));
    md.emplace_back("transfer_info", Value(std::move(ti)));
  }

  void drop_credit(const std::shared_ptr<PutRec>& rec) {
    std::lock_guard<std::mutex> l(mu);
    auto& q = inflight[rec->edge];
    q.erase(std::remove(q.begin(), q.end(), rec), q.end());
  }

  // `publish`, when given, writes and publishes the put of `publish_bytes` data bytes under its key
  // instead of conn->put(p) (the segments' loan; shared memory only).
  using Publish = std::function<Result<PutResult>(const std::string& key, const PutOptions& po)>;
  Result<RelayOp> put(const Payload& p, const RelayPutOptions& o, const Publish& publish = {}, size_t publish_bytes = 0) {
    if (o.readers == 0) return make_error(Errc::invalid_argument, "relay put: readers must be at least 1");
    if (o.dst_rank && (*o.dst_rank < 0 || (cfg.world_size > 0 && *o.dst_rank >= cfg.world_size)))
      return make_error(Errc::invalid_argument, "relay put: dst_rank " + std::to_string(*o.dst_rank) +
                                                    (*o.dst_rank < 0 ? " is negative"
                                                                     : " outside world_size " + std::to_string(cfg.world_size)));
    std::string edge = !o.edge.empty() ? std::string(o.edge)
                       : o.dst_rank    ? "rank" + std::to_string(*o.dst_rank)
                                       : std::string("any");
    // A local item outlives the call: a packed tree and ext (views of the caller's memory) are
    // kept as Values, read before a credit is taken.
    Value local_tree, local_ext;
    if (o.object && !is_local())
      return make_error(Errc::invalid_argument, "relay put: an object by reference needs the local backend");
    if (is_local() && !o.object) {
      if (!p.packed_tree.empty()) {
        SL_ASSIGN(local_tree, value_from_msgpack(p.packed_tree));
      } else {
        local_tree = p.tree;
      }
      if (!p.packed_ext.empty()) {
        SL_ASSIGN(local_ext, value_from_msgpack(p.packed_ext));
      } else {
        local_ext = p.ext;
      }
    }
    SL_ASSIGN(auto rec, take_credit(edge, o.request_id, deadline_after(cfg.timeout_s), o.keep_waiting,
                                            o.traceparent));
    auto st = std::make_shared<RelayOp::State>();
    if (is_local()) {
      auto& t = local_table();
      std::lock_guard<std::mutex> l(t.mu);
      const uint64_t key = t.next_id++;
      LocalItem it;
      it.payload.tree = std::move(local_tree);
      it.payload.ext = std::move(local_ext);
      it.payload.tensors = p.tensors;
      it.object = o.object;
      const size_t bytes = o.object ? o.object_bytes : p.tensor_bytes();
      it.size = bytes;
      it.readers_left = o.readers;
      it.relay = id;
      it.rec = rec;
      t.items.emplace(key, std::move(it));
      Value::Map md;
      md.emplace_back("local", key);
      md.emplace_back("pid", uint64_t(getpid()));
      md.emplace_back("size", uint64_t(bytes));
      add_sglang_fields(md, bytes, o.request_id);
      rec->md = Value(std::move(md));
    } else {
      const std::string key = prefix + std::to_string(seq.fetch_add(1, std::memory_order_relaxed));
      PutOptions po{o.readers, o.request_id};
      po.traceparent = o.traceparent;
      PutHooks hooks;
      if (o.hold) {
        if (!device_slots) {
          drop_credit(rec);
          return make_error(Errc::invalid_argument, "relay put: device slots need a connector that keeps them");
        }
        hooks.hold = o.hold;
        po.hooks = &hooks;
      }
      auto r = publish ? publish(key, po) : conn->put("relay", "r", key, p, po);
      if (!r.ok()) {
        drop_credit(rec);
        return std::move(r).error();
      }
      Value::Map md = r->metadata.is<Value::Map>() ? std::move(r->metadata.as<Value::Map>()) : Value::Map{};
      md.emplace_back("relay_key", key);
      add_sglang_fields(md, publish ? publish_bytes : o.data_bytes ? *o.data_bytes : p.tensor_bytes(), o.request_id);
      if (o.hold) md.emplace_back("cuda_ipc", true);
      rec->md = Value(std::move(md));
      bytes_out.add(r->size);
    }
    puts.add();
    st->core = shared_from_this();
    st->rec = rec;
    st->metadata = rec->md;
    st->is_put = true;
    return RelayOp(std::move(st));
  }

  Result<RelayOp> put_segments(std::span<const RelaySegment> segs, size_t total, const RelayPutOptions& o) {
    std::vector<RelaySegment> sorted(segs.begin(), segs.end());
    std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.offset < b.offset; });
    size_t end = 0;
    for (const auto& sg : sorted) {
      if (sg.offset < end || sg.offset > total || sg.data.size() > total - sg.offset)
        return make_error(Errc::invalid_argument, "relay put_segments: the segment at offset " + std::to_string(sg.offset) +
                                                      " (" + std::to_string(sg.data.size()) + " bytes) " +
                                                      (sg.offset < end ? "overlaps the one before it"
                                                                       : "ends past total_size " + std::to_string(total)));
      end = sg.offset + sg.data.size();
    }
    auto fill = [&](std::span<std::byte> dst) {  // the segments at their offsets, zeros between
      size_t at = 0;
      for (const auto& sg : sorted) {
        std::memset(dst.data() + at, 0, sg.offset - at);
        if (!sg.data.empty()) std::memcpy(dst.data() + sg.offset, sg.data.data(), sg.data.size());
        at = sg.offset + sg.data.size();
      }
      std::memset(dst.data() + at, 0, total - at);
    };
    Payload p;
    p.tree = Value(TensorRef{0});
    // Where the backend cannot lend its memory: one buffer the payload owns, put as any payload.
    auto owned = [&] {
      Payload q;
      q.tree = p.tree;
      auto buf = std::make_shared<std::vector<std::byte>>(total);
      fill(*buf);
      q.tensors.push_back(Tensor::view_of(std::span<const std::byte>(*buf)));
      q.tensors.back().keepalive = buf;
      return q;
    };
    if (is_local() || !conn || total == 0) return put(owned(), o);
    const TensorSpec spec{DType::u8, {int64_t(total)}, total, "cpu"};
    return put(
        p, o,
        [&](const std::string& key, const PutOptions& po) -> Result<PutResult> {
          if (!lending) return conn->put("relay", "r", key, owned(), po);  // the transfer engine lends nothing
          auto loan = lending->loan(p.tree, std::span<const TensorSpec>(&spec, 1));
          if (!loan.ok()) return std::move(loan).error();
          fill(loan->region(0));
          return lending->put_loan("relay", "r", key, std::move(loan).value(), po);
        },
        total);
  }

  Result<RelayOp> get(const Value& md, const RelayGetOptions& o) {
    if (closed) return make_error(Errc::closed, "relay closed");
    auto st = std::make_shared<RelayOp::State>();
    st->metadata = md;
    const Value* lk = md.find("local");
    if (lk) {
      uint64_t key = 0, pid = 0;
      const Value* pv = md.find("pid");
      if (!lk->get_u64(key) || !pv || !pv->get_u64(pid))
        return make_error(Errc::corrupt, "relay metadata: 'local'/'pid' must be integers");
      if (pid != uint64_t(getpid()))
        return make_error(Errc::invalid_argument, "relay metadata of the local backend comes from process " +
                                                      std::to_string(pid) + "; it is same-process only");
      auto& t = local_table();
      LocalItem last;  // the last reader's: dropped after the lock (its object's deleter)
      std::lock_guard<std::mutex> l(t.mu);
      auto it = t.items.find(key);
      if (it == t.items.end()) return make_error(Errc::not_found, "local relay item " + std::to_string(key) +
                                                                       " is gone (read by every reader, or cleaned up)");
      st->payload = it->second.payload;
      st->object = it->second.object;
      st->size = it->second.size;
      if (--it->second.readers_left == 0) {
        it->second.rec->released.store(true, std::memory_order_release);
        last = std::move(it->second);
        t.items.erase(it);
        ++t.epoch;
        t.cv.notify_all();
      }
    } else {
      const Value* kv = md.find("relay_key");
      if (!kv || !kv->is<std::string>())
        return make_error(Errc::corrupt, "relay metadata lacks 'relay_key' (not from a stagelink relay put?)");
      if (!conn) return make_error(Errc::invalid_argument, "relay metadata of a shared-memory put given to a local relay");
      // Metadata names a put made before it was sent: over shared memory a get is one lookup and
      // never waits (metadata it cannot use would otherwise make it wait for the key, holding up
      // a receive loop for the whole timeout). A network get waits for its transfer.
      const double tmo = o.timeout_s >= 0 ? o.timeout_s : lookup_only ? 0.0 : cfg.timeout_s;
      GetOptions go;
      go.zero_copy = o.zero_copy || !o.dest.empty();
      GetHooks hooks;
      hooks.private_ok = o.private_ok && go.zero_copy && o.dest.empty();
      go.hooks = &hooks;
      go.keep_waiting = o.keep_waiting;
      go.traceparent = o.traceparent;
      go.request_id = o.request_id;
      SL_ASSIGN(GetResult g, conn->get("relay", "r", kv->as<std::string>(), &md, deadline_after(tmo), go));
      st->payload = std::move(g.payload);
      st->size = g.size;
      st->owned = g.owned;
      bytes_in.add(g.size);
    }
    if (!o.dest.empty()) {
      if (st->payload.tensors.size() != 1)
        return make_error(Errc::invalid_argument, "relay get: a destination buffer takes a payload of one tensor; this one has " +
                                                      std::to_string(st->payload.tensors.size()));
      const auto src = st->payload.tensors[0].data;
      if (src.size() > o.dest.size())
        return make_error(Errc::invalid_argument, "relay get: the payload's " + std::to_string(src.size()) +
                                                      " bytes do not fit the destination's " + std::to_string(o.dest.size()));
      std::memcpy(o.dest.data(), src.data(), src.size());
      st->payload = Payload{};  // the slot goes back now
      st->size = src.size();
    }
    gets.add();
    return RelayOp(std::move(st));
  }

  // This relay's own unread puts of the request, withdrawn one by one. Never another relay's or
  // another process's puts of that request: a receiver that cleans a request up after reading it
  // (SGLang-Omni's read_payload does) would otherwise cancel what its producer put for the
  // request's other receivers.
  size_t cleanup(const std::string& rid) {
    std::vector<std::shared_ptr<PutRec>> mine;
    {
      std::lock_guard<std::mutex> l(mu);
      for (auto& [edge, q] : inflight)
        for (auto& r : q)
          if (r->rid == rid) mine.push_back(r);
    }
    size_t n = 0;
    for (auto& r : mine) n += withdraw(r) ? 1 : 0;
    // Puts every reader already released hold their memory until this producer's next put; a
    // request cleaned up (an abort) returns it now.
    if (releases) releases->reap_consumed();
    return n;
  }

  // One unread put withdrawn: cancelled, its data released (the key of a relay put is its own,
  // so cleanup by it frees exactly that put), its credit back.
  bool withdraw(const std::shared_ptr<PutRec>& r) {
    if (released(*r)) return false;
    if (is_local()) {
      auto& t = local_table();
      LocalItem gone;  // dropped after the lock (its object's deleter)
      std::lock_guard<std::mutex> l(t.mu);
      for (auto it = t.items.begin(); it != t.items.end(); ++it)
        if (it->second.rec == r) {
          r->cancelled.store(true);
          r->released.store(true, std::memory_order_release);
          gone = std::move(it->second);
          t.items.erase(it);
          ++t.epoch;
          t.cv.notify_all();
          return true;
        }
      return false;
    }
    std::lock_guard<std::mutex> l(mu);
    const Value* k = r->md.find("relay_key");
    if (!conn || !k || !k->is<std::string>()) return false;
    r->cancelled.store(true);
    conn->cleanup(k->as<std::string>());
    for (auto& [edge, q] : inflight) reap_locked(q);
    return true;
  }

  Value health() {
    Value::Map m;
    m.emplace_back("backend", cfg.backend);
    m.emplace_back("status", closed ? "closed" : "healthy");
    m.emplace_back("puts", puts.value());
    m.emplace_back("gets", gets.value());
    m.emplace_back("bytes_out", bytes_out.value());
    m.emplace_back("bytes_in", bytes_in.value());
    m.emplace_back("credits", uint64_t(cfg.credits));
    m.emplace_back("credit_waits", credit_waits.value());
    m.emplace_back("credit_timeouts", credit_timeouts.value());
    Value::Map in_use;
    {
      std::lock_guard<std::mutex> l(mu);
      for (auto& [edge, q] : inflight) {
        reap_locked(q);
        in_use.emplace_back(edge, uint64_t(q.size()));
      }
    }
    m.emplace_back("credits_in_use", Value(std::move(in_use)));
    if (conn) m.emplace_back("connector", conn->health());
    return Value(std::move(m));
  }

  void close() {
    metrics_reg_.reset();  // first, not under mu (a collection takes the tree's lock, then mu)
    {
      std::lock_guard<std::mutex> l(mu);
      if (closed.exchange(true)) return;
      for (auto& [edge, q] : inflight)
        for (auto& r : q)
          if (!released(*r)) {
            r->cancelled.store(true);
            r->released.store(true, std::memory_order_release);
          }
      inflight.clear();
    }
    if (conn) conn->close();
    auto& t = local_table();
    std::vector<LocalItem> gone;  // dropped after the lock (their objects' deleters)
    std::lock_guard<std::mutex> l(t.mu);
    for (auto it = t.items.begin(); it != t.items.end();) {
      if (it->second.relay == id) {
        gone.push_back(std::move(it->second));
        it = t.items.erase(it);
      } else {
        ++it;
      }
    }
    ++t.epoch;
    t.cv.notify_all();
  }

  RelayConfig cfg;
  const uint64_t id;
  std::string prefix;
  std::unique_ptr<Connector> conn;
  std::mutex mu;
  std::atomic<bool> closed{false};
  std::unordered_map<std::string, std::deque<std::shared_ptr<PutRec>>> inflight;
  std::atomic<uint64_t> seq{0};
  metrics::Counter puts, gets, bytes_out, bytes_in, credit_waits, credit_timeouts;
  metrics::Timing credit_wait;
  // The relay's samples in the metrics tree (collected under the tree's lock, then mu: the
  // registration goes at the start of close(), never under mu).
  struct Metrics final : metrics::Source {
    explicit Metrics(RelayCore& c) : c(c) {}
    void collect(metrics::Sink& out) const override {
      const std::string& b = c.cfg.backend;
      out.value(kRelayPuts, {b}, double(c.puts.value()));
      out.value(kRelayGets, {b}, double(c.gets.value()));
      out.value(kRelayBytesOut, {b}, double(c.bytes_out.value()));
      out.value(kRelayBytesIn, {b}, double(c.bytes_in.value()));
      out.value(kCreditWaits, {b}, double(c.credit_waits.value()));
      out.value(kCreditTimeouts, {b}, double(c.credit_timeouts.value()));
      out.timing(kCreditWait, {b}, c.credit_wait);
      out.value(kCredits, {b}, double(c.cfg.credits));
      std::lock_guard<std::mutex> l(c.mu);
      for (auto& [edge, q] : c.inflight) {
        size_t held = 0;
        for (auto& r : q) held += !r->released.load(std::memory_order_acquire);
        out.value(kCreditsInUse, {b, edge}, double(held));
      }
    }
    RelayCore& c;
  } metrics_{*this};
  metrics::Registration metrics_reg_{&metrics_};
};

RelayOp::RelayOp() = default;
RelayOp::RelayOp(std::shared_ptr<State> s) : s_(std::move(s)) {}
RelayOp::RelayOp(RelayOp&&) noexcept = default;
RelayOp& RelayOp::operator=(RelayOp&&) noexcept = default;
RelayOp::~RelayOp() = default;

const Value& RelayOp::metadata() const {
  static const Value kNil;
  return s_ ? s_->metadata : kNil;
}

bool RelayOp::done() {
  if (!s_ || !s_->is_put) return true;
  return s_->core->released(*s_->rec);
}

Status RelayOp::wait(double timeout_s) {
  if (!s_ || !s_->is_put) return {};
  const Deadline deadline = timeout_s < 0 ? Deadline::max() : deadline_after(timeout_s);
  for (;;) {
    const uint64_t seen = s_->core->epoch();
    if (s_->core->released(*s_->rec)) {
      if (s_->rec->cancelled.load())
        return s_->core->closed ? make_error(Errc::closed, "relay closed before the put was read")
                                : make_error(Errc::cancelled, "relay put cancelled (cleanup) before it was read");
      return {};
    }
    if (s_->core->closed) return make_error(Errc::closed, "relay closed before the put was read");
    if (Clock::now() >= deadline)
      return make_error(Errc::timeout, "relay put to '" + s_->rec->edge + "' not read after " + std::to_string(timeout_s) + " s");
    s_->core->wait_epoch(seen, deadline);
  }
}

bool RelayOp::withdraw() { return s_ && s_->is_put && s_->core->withdraw(s_->rec); }

Payload& RelayOp::payload() {
  static thread_local Payload empty;
  return s_ ? s_->payload : empty;
}

size_t RelayOp::size() const { return s_ ? s_->size : 0; }
bool RelayOp::owned() const { return s_ && s_->owned; }
const std::shared_ptr<const void>& RelayOp::object() const {
  static const std::shared_ptr<const void> kNone;
  return s_ ? s_->object : kNone;
}

Result<std::unique_ptr<Relay>> Relay::create(const RelayConfig& cfg) {
  if (cfg.credits == 0) return make_error(Errc::invalid_argument, "relay config: credits must be at least 1");
  auto core = std::make_shared<RelayCore>(cfg);
  SL_TRY(core->init());
  return std::unique_ptr<Relay>(new Relay(std::move(core)));
}
Relay::Relay(std::shared_ptr<RelayCore> core) : core_(std::move(core)) {}
Relay::~Relay() { close(); }
const RelayConfig& Relay::config() const { return core_->cfg; }
Result<RelayOp> Relay::put_async(const Payload& p, const RelayPutOptions& o) { return core_->put(p, o); }
Result<RelayOp> Relay::get_async(const Value& md, const RelayGetOptions& o) { return core_->get(md, o); }
Result<RelayOp> Relay::put_segments(std::span<const RelaySegment> segments, size_t total, const RelayPutOptions& o) {
  return core_->put_segments(segments, total, o);
}
size_t Relay::device_slots() const { return core_->closed ? 0 : core_->device_slots; }
Value Relay::sender_info() {
  if (core_->closed || !core_->link) return Value();
  return core_->link->sender_info();
}
Status Relay::connect(const Value& sender_info, double timeout_s) {
  if (core_->closed) return make_error(Errc::closed, "relay closed");
  if (!core_->link) return {};  // the same-process backend, shared memory: nothing to connect
  return core_->link->connect(sender_info, deadline_after(timeout_s < 0 ? core_->cfg.timeout_s : timeout_s));
}
size_t Relay::cleanup(const std::string& rid) { return core_->cleanup(rid); }
Value Relay::health() { return core_->health(); }
void Relay::close() { core_->close(); }

}  // namespace stagelink
