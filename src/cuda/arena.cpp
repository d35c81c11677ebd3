// See arena.hpp.
#include "cuda/arena.hpp"


#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/log.hpp"
#include "core/proc.hpp"
#include "stagelink/metrics.hpp"

namespace stagelink::cuda {
namespace {

// Primary contexts by ordinal, retained once and never released (torch shares them).
Result<CUcontext> primary(int ordinal) {
  static std::mutex mu;
  static std::map<int, CUcontext> ctx;
  SL_ASSIGN(const Driver* D, driver());
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = ctx.find(ordinal); it != ctx.end()) return it->second;
  if (ordinal < 0 || ordinal >= D->device_count)
    return make_error(Errc::invalid_argument, "no CUDA device " + std::to_string(ordinal) + " here");
  CUdevice dev = 0;
  SL_TRY(check(D->cuDeviceGet(&dev, ordinal), "cuDeviceGet"));
  CUcontext c = nullptr;
  SL_TRY(check(D->cuDevicePrimaryCtxRetain(&c, dev), "cuDevicePrimaryCtxRetain"));
  ctx.emplace(ordinal, c);
  return c;
}

}  // namespace

void keep_until_exit(std::shared_ptr<const void> hold) {
  static auto* kept = new std::vector<std::shared_ptr<const void>>();  // never destroyed: exit-time order
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(hold));
}

Status use_device(int ordinal) {
  SL_ASSIGN(const Driver* D, driver());
  SL_ASSIGN(CUcontext c, primary(ordinal));
  CUcontext cur = nullptr;
  if (D->cuCtxGetCurrent(&cur) == kSuccess && cur == c) return {};
  return check(D->cuCtxSetCurrent(c), "cuCtxSetCurrent");
}

// ---- producer ----

struct DeviceArenas::State {
  struct ArenaMem {
    CUdeviceptr base = 0;
    size_t bytes = 0;
    CUipcMemHandle handle{};
  };
  struct EventMem {
    CUevent ev = nullptr;
    CUipcEventHandle handle{};
  };
  struct Dev {
    explicit Dev(size_t arena_bytes) : book(arena_bytes) {}
    SlotBook book;
    CUuuid uuid{};
    std::map<uint64_t, ArenaMem> arenas;
    std::vector<EventMem> events;  // by event id
    uint64_t puts = 0, bytes = 0;
  };
  std::mutex mu;
  std::map<int, std::unique_ptr<Dev>> devs;
  uint64_t next_arena = 1;
};

DeviceArenas& DeviceArenas::instance() {
  static auto* a = new DeviceArenas();  // process lifetime: holds may be dropped during exit
  return *a;
}
DeviceArenas::State& DeviceArenas::st() {
  static auto* s = new State();
  return *s;
}

namespace {
// Frees its slot when the put's entry is reclaimed. Bookkeeping only: the memory stays allocated.
// Made in place only (make_shared with the constructor's arguments): a temporary's destructor
// would give the slot back at once, and under the lock stage() holds (a self-deadlock).
struct SlotHold {
  SlotHold(DeviceArenas::State* s, int o, SlotBook::Slot sl) : st(s), ordinal(o), slot(sl) {}
  SlotHold(const SlotHold&) = delete;
  SlotHold& operator=(const SlotHold&) = delete;
  ~SlotHold();
  DeviceArenas::State* st;
  int ordinal;
  SlotBook::Slot slot;
};
}  // namespace

Result<std::shared_ptr<const void>> DeviceArenas::stage(int ordinal, CUdeviceptr src, size_t nbytes, CUstream stream,
                                                        size_t arena_bytes, DeviceRef& ref) {
  SL_ASSIGN(const Driver* D, driver());
  SL_TRY(use_device(ordinal));
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  auto& dp = s.devs[ordinal];
  if (!dp) {
    auto d = std::make_unique<State::Dev>(arena_bytes);
    CUdevice dev = 0;
    SL_TRY(check(D->cuDeviceGet(&dev, ordinal), "cuDeviceGet"));
    SL_TRY(check(D->cuDeviceGetUuid(&d->uuid, dev), "cuDeviceGetUuid"));
    dp = std::move(d);
  }
  State::Dev& d = *dp;
  d.book.set_arena_bytes(arena_bytes);  // arenas added from now on (one device's arenas serve every connector)
  auto slot = d.book.take(nbytes);
  if (!slot) {
    const size_t size = d.book.arena_size_for(nbytes);
    State::ArenaMem a;
    a.bytes = size;
    CUresult r = D->cuMemAlloc(&a.base, size);
    if (r == 2) {  // out of memory: give back the idle arenas past the first, then try once more
      for (uint64_t id : d.book.drop_idle_arenas()) {
        D->cuMemFree(d.arenas[id].base);
        d.arenas.erase(id);
      }
      r = D->cuMemAlloc(&a.base, size);
    }
    SL_TRY(check(r, "device arena of " + std::to_string(size) + " bytes (cuMemAlloc)"));
    if (auto st2 = check(D->cuIpcGetMemHandle(&a.handle, a.base), "cuIpcGetMemHandle"); !st2.ok()) {
      D->cuMemFree(a.base);
      return std::move(st2).error();
    }
    const uint64_t id = s.next_arena++;
    d.arenas.emplace(id, a);
    d.book.add_arena(id, size);
    slot = d.book.take(nbytes);
    if (!slot) return make_error(Errc::exhausted, "a fresh device arena had no room");  // cannot happen
  }
  auto give_back = [&](Error e) {
    (void)d.book.give_back(*slot);
    return e;
  };
  while (d.events.size() <= slot->event_id) {
    State::EventMem e;
    if (auto c = check(D->cuEventCreate(&e.ev, kEventInterprocess | kEventDisableTiming), "cuEventCreate"); !c.ok())
      return give_back(std::move(c).error());
    if (auto c = check(D->cuIpcGetEventHandle(&e.handle, e.ev), "cuIpcGetEventHandle"); !c.ok()) {
      D->cuEventDestroy(e.ev);
      return give_back(std::move(c).error());
    }
    d.events.push_back(e);
  }
  const State::ArenaMem& a = d.arenas.at(slot->arena_id);
  const State::EventMem& e = d.events[slot->event_id];
  if (nbytes)
    if (auto c = check(D->cuMemcpyDtoDAsync(a.base + slot->offset, src, nbytes, stream), "cuMemcpyDtoDAsync"); !c.ok())
      return give_back(std::move(c).error());
  if (auto c = check(D->cuEventRecord(e.ev, stream), "cuEventRecord"); !c.ok()) return give_back(std::move(c).error());
  const ProcId me = self_proc();
  ref.pid = me.pid;
  ref.start_time = me.start;
  ref.arena_id = slot->arena_id;
  ref.arena_bytes = a.bytes;
  ref.offset = slot->offset;
  ref.nbytes = nbytes;
  ref.event_id = slot->event_id;
  ref.gpu = d.uuid;
  ref.mem = a.handle;
  ref.event = e.handle;
  ++d.puts;
  d.bytes += nbytes;
  return std::shared_ptr<const void>(std::make_shared<SlotHold>(&s, ordinal, *slot));
}

SlotHold::~SlotHold() {
  std::lock_guard<std::mutex> lock(st->mu);
  auto it = st->devs.find(ordinal);
  if (it == st->devs.end()) return;
  if (auto r = it->second->book.give_back(slot); !r.ok())
    SL_LOG_ERROR("device slot: %s", r.error().to_string().c_str());
}

Result<std::pair<CUdeviceptr, CUevent>> DeviceArenas::local(const DeviceRef& ref) {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [ord, d] : s.devs) {
    auto it = d->arenas.find(ref.arena_id);
    if (it == d->arenas.end()) continue;
    if (ref.arena_bytes != it->second.bytes || ref.event_id >= d->events.size() || std::memcmp(ref.gpu.bytes, d->uuid.bytes, 16) != 0)
      return make_error(Errc::corrupt, "device tensor record does not match this process's arena");
    return std::pair{it->second.base + ref.offset, d->events[ref.event_id].ev};
  }
  return make_error(Errc::not_found, "device arena " + std::to_string(ref.arena_id) + " of this process is gone");
}

namespace {
using metrics::Family;
using metrics::Kind;
const Family kCudaArenaBytes{"stagelink_cuda_arena_bytes", Kind::gauge, "bytes",
                             "device memory this process's arenas hold for CUDA tensors left on their GPU",
                             {"device"}};
const Family kCudaArenaUsed{"stagelink_cuda_arena_used_bytes", Kind::gauge, "bytes",
                            "of it, held by slots whose readers have not all released them", {"device"}};
const Family kCudaSlots{"stagelink_cuda_slots_in_flight", Kind::gauge, "",
                        "device slots written and not yet released by every reader", {"device"}};
const Family kCudaPuts{"stagelink_cuda_puts_total", Kind::counter, "",
                       "CUDA tensors staged into a device slot (left on their GPU)", {"device"}};
const Family kCudaPutBytes{"stagelink_cuda_put_bytes_total", Kind::counter, "bytes",
                           "bytes of those tensors", {"device"}};

// The arenas' health(), as metrics (one source of truth). Registered at load: collecting before
// any CUDA use finds no device and emits nothing.
struct ArenaMetrics : metrics::Source {
  metrics::Registration reg{this};
  void collect(metrics::Sink& out) const override {
    const Value h = DeviceArenas::instance().health();
    if (!h.is<Value::List>()) return;
    for (const Value& d : h.as<Value::List>()) {
      const Value* dev = d.find("device");
      if (!dev || !dev->is<std::string>()) continue;
      const std::string name = dev->as<std::string>();
      auto num = [&](const char* k) {
        const Value* v = d.find(k);
        uint64_t n = 0;
        return v && v->get_u64(n) ? double(n) : 0.0;
      };
      out.value(kCudaArenaBytes, {name}, num("bytes"));
      out.value(kCudaArenaUsed, {name}, num("used"));
      out.value(kCudaSlots, {name}, num("slots_in_flight"));
      out.value(kCudaPuts, {name}, num("puts"));
      out.value(kCudaPutBytes, {name}, num("put_bytes"));
    }
  }
};
ArenaMetrics* const g_arena_metrics = new ArenaMetrics;  // process lifetime, as the arenas
}  // namespace

Value DeviceArenas::health() {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  Value::List out;
  for (auto& [ord, d] : s.devs) {
    Value::Map m;
    m.emplace_back("device", "cuda:" + std::to_string(ord));
    m.emplace_back("gpu", uuid_string(d->uuid));
    m.emplace_back("arenas", uint64_t(d->book.arenas()));
    m.emplace_back("bytes", uint64_t(d->book.capacity()));
    m.emplace_back("used", uint64_t(d->book.used()));
    m.emplace_back("largest_free", uint64_t(d->book.largest_free()));
    m.emplace_back("slots_in_flight", uint64_t(d->book.slots_in_flight()));
    m.emplace_back("events", uint64_t(d->events.size()));
    m.emplace_back("puts", d->puts);
    m.emplace_back("put_bytes", d->bytes);
    out.emplace_back(Value(std::move(m)));
  }
  return Value(std::move(out));
}

// ---- reader ----

struct DeviceImports::State {
  using Who = std::tuple<uint32_t, uint64_t, uint64_t>;  // pid, start time, id
  struct Opened {
    CUdeviceptr base = 0;
    size_t bytes = 0;
    int ordinal = 0;
  };
  std::mutex mu;
  std::map<Who, Opened> arenas;
  std::map<Who, std::pair<CUevent, int>> events;
  // Releases waiting for the reader's work: an event recorded after it, and what to drop.
  struct Pending {
    CUevent ev;
    int ordinal;
    std::shared_ptr<const void> keep;
  };
  std::mutex qmu;
  std::condition_variable qcv, idle;
  std::deque<Pending> queue;
  std::vector<std::pair<CUevent, int>> spare;  // blocking-sync events to reuse
  bool thread_started = false, busy = false;
  uint64_t released = 0, synced_inline = 0;

  static bool dead(const Who& w) { return !proc_alive(ProcId{std::get<0>(w), std::get<1>(w)}); }
  void close_dead_locked(const Driver& D) {
    std::erase_if(arenas, [&](const auto& a) {
      if (!dead(a.first)) return false;
      if (use_device(a.second.ordinal).ok()) D.cuIpcCloseMemHandle(a.second.base);
      return true;
    });
    std::erase_if(events, [&](const auto& e) {
      if (!dead(e.first)) return false;
      if (use_device(e.second.second).ok()) D.cuEventDestroy(e.second.first);
      return true;
    });
  }

  void run() {
    for (;;) {
      Pending p;
      {
        std::unique_lock<std::mutex> lock(qmu);
        qcv.wait(lock, [&] { return !queue.empty(); });
        p = std::move(queue.front());
        queue.pop_front();
        busy = true;
      }
      auto d = driver();
      if (d.ok() && use_device(p.ordinal).ok()) {
        if (CUresult r = (*d)->cuEventSynchronize(p.ev); r != kSuccess)
          SL_LOG_ERROR("%s", check(r, "waiting for a reader's work on a device slot").error().to_string().c_str());
      }
      p.keep.reset();  // the entry's claim: its producer may now reuse the slot
      std::lock_guard<std::mutex> lock(qmu);
      spare.emplace_back(p.ev, p.ordinal);
      ++released;
      busy = false;
      if (queue.empty()) idle.notify_all();
    }
  }
};

DeviceImports& DeviceImports::instance() {
  static auto* a = new DeviceImports();
  return *a;
}
DeviceImports::State& DeviceImports::st() {
  static auto* s = new State();
  return *s;
}

Result<DeviceImports::Mapped> DeviceImports::open(const DeviceRef& r, int ordinal) {
  SL_ASSIGN(const Driver* D, driver());
  if (const ProcId me = self_proc(); r.pid == me.pid && r.start_time == me.start) {  // our own put: no IPC
    SL_ASSIGN(auto pe, DeviceArenas::instance().local(r));
    return Mapped{pe.first, pe.second};
  }
  SL_TRY(use_device(ordinal));
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  const State::Who arena{r.pid, r.start_time, r.arena_id}, event{r.pid, r.start_time, r.event_id};
  auto it = s.arenas.find(arena);
  if (it == s.arenas.end()) {
    if (State::dead(arena))
      return make_error(Errc::peer_dead, "the process " + std::to_string(r.pid) + " that put this CUDA tensor has exited");
    s.close_dead_locked(*D);
    State::Opened o;
    o.ordinal = ordinal;
    SL_TRY(check(D->cuIpcOpenMemHandle(&o.base, r.mem, kIpcLazyEnablePeerAccess),
                 "opening process " + std::to_string(r.pid) + "'s device arena (cuIpcOpenMemHandle)"));
    // The mapping's size bounds every slot read from it (a record is checked against its own
    // arena_bytes on decode; here arena_bytes against the memory).
    CUdeviceptr b = 0;
    size_t n = 0;
    if (D->cuMemGetAddressRange(&b, &n, o.base) == kSuccess && (b != o.base || n < r.arena_bytes)) {
      D->cuIpcCloseMemHandle(o.base);
      return make_error(Errc::corrupt, "device arena smaller than the record says (" + std::to_string(n) + " < " +
                                           std::to_string(r.arena_bytes) + " bytes)");
    }
    o.bytes = n ? n : r.arena_bytes;
    it = s.arenas.emplace(arena, o).first;
  }
  auto ev = s.events.find(event);
  if (ev == s.events.end()) {
    CUevent e = nullptr;
    SL_TRY(check(D->cuIpcOpenEventHandle(&e, r.event), "cuIpcOpenEventHandle"));
    ev = s.events.emplace(event, std::pair{e, ordinal}).first;
  }
  return Mapped{it->second.base + r.offset, ev->second.first};
}

Status DeviceImports::wait_ready(const Mapped& m, CUstream stream) {
  SL_ASSIGN(const Driver* D, driver());
  const CUresult q = D->cuEventQuery(m.event);
  if (q == kSuccess) return {};  // the copy is done: nothing to order
  if (q != kNotReady) return check(q, "cuEventQuery");
  return check(D->cuStreamWaitEvent(stream, m.event, 0), "cuStreamWaitEvent");
}

void DeviceImports::release_after(int ordinal, CUstream stream, std::shared_ptr<const void> keep) {
  State& s = st();
  auto d = driver();
  if (!d.ok() || !use_device(ordinal).ok()) return;  // nothing was queued on a device we cannot reach
  const Driver& D = **d;
  CUevent ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.qmu);
    for (size_t i = 0; i < s.spare.size(); ++i)
      if (s.spare[i].second == ordinal) {
        ev = s.spare[i].first;
        s.spare.erase(s.spare.begin() + long(i));
        break;
      }
  }
  if (!ev && D.cuEventCreate(&ev, kEventBlockingSync | kEventDisableTiming) != kSuccess) ev = nullptr;
  if (!ev || D.cuEventRecord(ev, stream) != kSuccess) {  // cannot defer: wait here instead
    D.cuStreamSynchronize(stream);
    std::lock_guard<std::mutex> lock(s.qmu);
    if (ev) s.spare.emplace_back(ev, ordinal);
    ++s.synced_inline;
    return;  // `keep` dropped on return
  }
  std::lock_guard<std::mutex> lock(s.qmu);
  s.queue.push_back({ev, ordinal, std::move(keep)});
  if (!s.thread_started) {
    s.thread_started = true;
    std::thread([&s] { s.run(); }).detach();  // process lifetime, asleep when nothing is queued
  }
  s.qcv.notify_one();
}

bool DeviceImports::drain(double timeout_s) {
  State& s = st();
  std::unique_lock<std::mutex> lock(s.qmu);
  return s.idle.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return s.queue.empty() && !s.busy; });
}

Value DeviceImports::health() {
  State& s = st();
  Value::Map m;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    m.emplace_back("mapped_arenas", uint64_t(s.arenas.size()));
    m.emplace_back("opened_events", uint64_t(s.events.size()));
  }
  std::lock_guard<std::mutex> lock(s.qmu);
  m.emplace_back("releases_pending", uint64_t(s.queue.size() + (s.busy ? 1 : 0)));
  m.emplace_back("released", s.released);
  m.emplace_back("released_after_sync", s.synced_inline);
  return Value(std::move(m));
}

}  // namespace stagelink::cuda
