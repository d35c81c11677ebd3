// The UCX engine's implementation shared by engine.cpp (the engine, its pool and progress thread,
// sends and landings) and engine_requests.cpp (connecting endpoints, requests, errors, info).
// Internal.
#pragma once
#include "ucx/engine.hpp"

#include <poll.h>
#include <sys/mman.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <xxhash.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <vector>
#include <mutex>
#include <thread>

#include "core/log.hpp"
#include "core/proc.hpp"
#include "stagelink/allocator.hpp"

namespace stagelink::ucx {
namespace detail {

inline Error ucs_error(const std::string& what, ucs_status_t s) {
  const Errc c = s == UCS_ERR_TIMED_OUT                                           ? Errc::timeout
                 : s == UCS_ERR_UNREACHABLE || s == UCS_ERR_CONNECTION_RESET ||
                           s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_REJECTED ? Errc::peer_dead
                 : s == UCS_ERR_NO_MEMORY || s == UCS_ERR_NO_RESOURCE             ? Errc::exhausted
                 : s == UCS_ERR_UNSUPPORTED || s == UCS_ERR_NO_DEVICE             ? Errc::unsupported
                 : s == UCS_ERR_CANCELED                                          ? Errc::cancelled
                                                                                  : Errc::io;
  return make_error(c, what + ": " + ucs_status_string(s));
}

// One operation's completion, shared between the waiting thread and UCX's callback.
struct Op {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  ucs_status_t status = UCS_OK;
};

// How long an idle progress thread keeps progressing after activity (STAGELINK_UCX_SPIN_US).
inline uint64_t spin_us() {
  static const uint64_t v = [] {
    const char* e = std::getenv("STAGELINK_UCX_SPIN_US");
    return e ? uint64_t(std::strtoull(e, nullptr, 10)) : uint64_t(20);
  }();
  return v;
}

// A worker address as it travels between engines (side-channel messages, pull requests, replies).
// ucp_ep_create trusts every byte of UCX's packed address and is given no length: a damaged or
// foreign one is an assertion that aborts the process, or a read past its end. So the address is
// wrapped, and only a wrapper that checks out reaches UCX: "SLW1", the UCX major and minor version
// that packed it (2 bytes, 2 zero), its length (4 bytes, little-endian; 4 zero), a 64-bit XXH3 of
// those 16 bytes and the address, then the address, 8-byte aligned as UCX's own buffer was. This catches accidents (a truncated or stale address, another program on the
// port, another UCX major); the side channel is for a trusted network, as UCX's own wire-up is.
constexpr std::byte kAddrMagic[4] = {std::byte('S'), std::byte('L'), std::byte('W'), std::byte('1')};
constexpr size_t kAddrHeader = 24, kAddrLen = 8, kAddrHash = 16;  // offsets of length, hash
constexpr size_t kAddrMax = 1u << 20;

// XXH3 (libxxhash, as the store's frame checksums) of the address, seeded with the header's.
inline uint64_t address_hash(std::span<const std::byte> header, std::span<const std::byte> raw) {
  return XXH3_64bits_withSeed(raw.data(), raw.size(), XXH3_64bits(header.data(), header.size()));
}

inline std::pair<unsigned, unsigned> ucx_version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return {major, minor};
}

inline std::vector<std::byte> wrap_address(std::span<const std::byte> raw) {
  std::vector<std::byte> w(kAddrHeader + raw.size());
  std::memcpy(w.data(), kAddrMagic, 4);
  const auto [major, minor] = ucx_version();
  w[4] = std::byte(uint8_t(major));
  w[5] = std::byte(uint8_t(minor));
  for (int i = 0; i < 4; ++i) w[kAddrLen + i] = std::byte(uint8_t(raw.size() >> (8 * i)));
  std::memcpy(w.data() + kAddrHeader, raw.data(), raw.size());
  const uint64_t h = address_hash(std::span<const std::byte>(w.data(), kAddrHash), raw);
  for (int i = 0; i < 8; ++i) w[kAddrHash + i] = std::byte(uint8_t(h >> (8 * i)));
  return w;
}

// The UCX address inside a wrapper, or why there is none (corrupt; unsupported for another UCX major).
inline Result<std::span<const std::byte>> unwrap_address(std::span<const std::byte> w) {
  if (w.size() <= kAddrHeader || std::memcmp(w.data(), kAddrMagic, 4) != 0)
    return make_error(Errc::corrupt, "a peer's UCX worker address is not one a stagelink engine sent (" +
                                         std::to_string(w.size()) + " bytes)");
  uint32_t len = 0;
  uint64_t h = 0;
  for (int i = 0; i < 4; ++i) len |= uint32_t(uint8_t(w[kAddrLen + i])) << (8 * i);
  for (int i = 0; i < 8; ++i) h |= uint64_t(uint8_t(w[kAddrHash + i])) << (8 * i);
  const auto raw = w.subspan(kAddrHeader);
  if (len != raw.size() || len > kAddrMax || address_hash(w.first(kAddrHash), raw) != h)
    return make_error(Errc::corrupt, "a peer's UCX worker address is damaged (its length or checksum is wrong)");
  if (unsigned(uint8_t(w[4])) != ucx_version().first)
    return make_error(Errc::unsupported, "a peer runs UCX " + std::to_string(unsigned(uint8_t(w[4]))) + "." +
                                             std::to_string(unsigned(uint8_t(w[5]))) + ", this process UCX " +
                                             std::to_string(ucx_version().first) + "." +
                                             std::to_string(ucx_version().second) + ": not the same major version");
  return raw;
}

}  // namespace detail
using namespace detail;

struct Engine::Impl {
  EngineOptions opts;
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_mem_h memh = nullptr;
  void* map_base = nullptr;  // the pool's mapping (memh registers an aligned part of it)
  size_t map_len = 0;
  std::byte* base = nullptr;
  size_t size = 0;
  std::vector<std::byte> addr;
  int efd = -1, stopfd = -1;
  std::thread progress;
  std::atomic<bool> stopping{false}, closed{false};

  mutable std::mutex pool_mu;
  std::condition_variable pool_cv;
  std::unique_ptr<BufferAllocator> alloc;

  std::mutex ep_mu;
  struct Ep {
    ucp_ep_h ep = nullptr;
    std::atomic<bool> failed{false};
  };
  std::map<std::vector<std::byte>, std::shared_ptr<Ep>> eps;
  std::atomic<uint64_t> writes{0}, write_bytes{0}, write_errors{0}, eps_discarded{0}, parts_rndv{0}, parts_eager{0};

  // Messages expected by this (receiving) side, by token. A payload comes in one or more parts
  // (one per lane), each tagged with a ChunkHdr; a part with offset kErrPart carries the sender's
  // error instead ([errc byte][text]).
  static constexpr unsigned kAmId = 7, kReqId = 8;
  struct ChunkHdr {
    uint64_t token, offset, total;
  };
  static constexpr uint64_t kErrPart = ~uint64_t(0);
  struct Pending {
    std::byte* dst = nullptr;
    size_t len = 0;
    std::shared_ptr<void> keep;  // the destination's owner: held while anything may write there
    std::shared_ptr<Op> op = std::make_shared<Op>();
    size_t landed = 0;           // under op->mu
    std::optional<Error> remote;  // the sender's error (under op->mu)
    std::atomic<bool> awaited{false};  // counted in Impl::awaiting until done or forgotten (large ones)
  };
  // Work under way that keeps the progress thread progressing between events (busy()): payloads
  // of kBusyMinBytes and more expected and not yet complete, and sends of that size not yet
  // complete. Smaller ones arrive or leave in one fragment: spinning for them only kept a core
  // from the threads that must run for them to happen (on 2 cores, a 4 KiB get's p99 was the
  // scheduler's 4 ms tick, against 48 us for a bare TCP round trip by sockperf).
  static constexpr size_t kBusyMinBytes = 64u << 10;
  std::atomic<int> awaiting{0}, sending{0};
  void settle(Pending& p) {
    if (p.awaited.exchange(false)) awaiting.fetch_sub(1);
  }
  std::mutex pend_mu;
  std::map<uint64_t, std::shared_ptr<Pending>> pending;

  static void complete(const std::shared_ptr<Op>& op, ucs_status_t s) {
    {
      std::lock_guard<std::mutex> l(op->mu);
      op->done = true;
      op->status = s;
    }
    op->cv.notify_all();
  }
  // `n` more bytes of `p` are in place (or a part failed): complete when all are. The caller's
  // reference goes before the waiter is woken, so that the waiter's forget() is what frees the
  // destination (it is free by the time get() returns).
  void land(std::shared_ptr<Pending>&& p, size_t n, ucs_status_t s) {
    std::shared_ptr<Op> op = p->op;
    {
      std::lock_guard<std::mutex> l(op->mu);
      if (!op->done) {
        if (s != UCS_OK) {
          op->done = true;
          op->status = s;
        } else if ((p->landed += n) >= p->len) {
          op->done = true;
        }
        if (op->done) settle(*p);
      }
      p.reset();
      if (!op->done) return;
    }
    op->cv.notify_all();
  }
  struct RecvHold {
    std::shared_ptr<Pending> p;
    Impl* self;
    size_t n = 0;
    void* request = nullptr;
  };
  std::set<RecvHold*> receiving;  // rendezvous receives under way (under pend_mu); close cancels them
  static void on_recv_done(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* h = static_cast<RecvHold*>(user_data);
    h->self->land(std::move(h->p), h->n, status);
    {
      std::lock_guard<std::mutex> l(h->self->pend_mu);
      h->self->receiving.erase(h);
    }
    delete h;  // releases the destination's keep (if the caller gave up meanwhile, it is freed now)
    ucp_request_free(request);
  }
  // Runs on the progress thread.
  static ucs_status_t on_am(void* arg, const void* header, size_t header_len, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
    if (header_len != sizeof(ChunkHdr)) return rndv ? UCS_ERR_CANCELED : UCS_OK;  // not ours: dropped
    ChunkHdr h;
    std::memcpy(&h, header, sizeof h);
    std::shared_ptr<Pending> p;
    {
      std::lock_guard<std::mutex> l(self->pend_mu);
      auto it = self->pending.find(h.token);
      if (it != self->pending.end()) p = it->second;
    }
    if (!p) return rndv ? UCS_ERR_CANCELED : UCS_OK;  // nobody waits any more: the sender is told
    if (h.offset == kErrPart) {
      if (rndv || length == 0) return rndv ? UCS_ERR_CANCELED : UCS_OK;
      const auto* b = static_cast<const unsigned char*>(data);
      const Errc c = b[0] <= unsigned(Errc::permission_denied) ? Errc(b[0]) : Errc::io;
      {
        std::lock_guard<std::mutex> l(p->op->mu);
        if (!p->remote) p->remote = make_error(c, std::string(reinterpret_cast<const char*>(b + 1), length - 1));
      }
      self->land(std::move(p), 0, UCS_ERR_REJECTED);
      return UCS_OK;
    }
    if (h.total != p->len || h.offset > p->len || length > p->len - h.offset) {  // never written past the region
      self->land(std::move(p), 0, UCS_ERR_MESSAGE_TRUNCATED);
      return rndv ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
    }
    (rndv ? self->parts_rndv : self->parts_eager).fetch_add(1, std::memory_order_relaxed);
    if (!rndv) {
      std::memcpy(p->dst + h.offset, data, length);
      self->land(std::move(p), length, UCS_OK);
      return UCS_OK;
    }
    auto* hold = new RecvHold{p, self, length};
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &Impl::on_recv_done;
    rp.user_data = hold;
    {
      std::lock_guard<std::mutex> l(self->pend_mu);  // before the call: its callback may run inside it
      self->receiving.insert(hold);
    }
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker, data, p->dst + h.offset, length, &rp);
    if (!UCS_PTR_IS_PTR(r)) {
      {
        std::lock_guard<std::mutex> l(self->pend_mu);
        self->receiving.erase(hold);
      }
      delete hold;
      self->land(std::move(p), length, UCS_PTR_STATUS(r));
    } else {
      std::lock_guard<std::mutex> l(self->pend_mu);
      if (self->receiving.count(hold)) hold->request = r;
    }
    return UCS_INPROGRESS;
  }

  // Requests from peers (pulls): handed to the connector's handler on this thread.
  std::function<void(std::span<const std::byte>)> req_handler;  // set before any request can come
  static ucs_status_t on_req(void* arg, const void*, size_t, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_ERR_CANCELED;  // requests are small
    if (length == 0) return UCS_OK;  // a ping of connect()
    if (self->req_handler) self->req_handler(std::span<const std::byte>(static_cast<const std::byte*>(data), length));
    return UCS_OK;
  }

  // A group of posted operations (a payload's parts and the flushes after them) completing
  // together. Requests are freed by the progress thread once the batch is finished (so a
  // cancel at the deadline never touches a freed request); `done` runs once.
  struct Batch {
    std::mutex mu;
    int left = 1;  // operations not complete, plus one while posting
    ucs_status_t status = UCS_OK;
    bool finished = false, cancelled = false;
    Deadline deadline;
    std::vector<void*> reqs;
    std::vector<ChunkHdr> hdrs;   // stay put until the sends complete
    std::vector<std::byte> body;  // an error's text
    std::vector<std::shared_ptr<Ep>> eps;
    std::function<void(Status)> done;
    Impl* self = nullptr;
    const char* what = "";
    size_t bytes = 0;
    bool busy() const { return bytes >= kBusyMinBytes; }  // counted in Impl::sending
  };
  std::mutex batch_mu;
  std::vector<std::shared_ptr<Batch>> batches;

  static void batch_cb(void*, ucs_status_t s, void* ud) {
    auto* b = static_cast<Batch*>(ud);
    b->self->op_finished(b, s);
  }
  void op_finished(Batch* b, ucs_status_t s) {
    bool fin;
    {
      std::lock_guard<std::mutex> l(b->mu);
      if (s != UCS_OK && b->status == UCS_OK) b->status = s;
      fin = --b->left == 0;
      if (fin) b->finished = true;
    }
    if (!fin) return;
    if (b->busy()) sending.fetch_sub(1);
    Status st;
    bool failed = b->status != UCS_OK;
    for (auto& e : b->eps) failed = failed || e->failed.load();
    if (failed) {
      write_errors.fetch_add(1);
      for (auto& e : b->eps) e->failed.store(true);  // never reused
      st = b->cancelled && b->status == UCS_ERR_CANCELED
               ? Status(make_error(Errc::timeout, std::string(b->what) + ": not complete before the deadline"))
           : b->status != UCS_OK ? Status(ucs_error(b->what, b->status))
                                 : Status(make_error(Errc::peer_dead, std::string("the endpoint failed while ") + b->what));
    } else if (b->bytes) {
      writes.fetch_add(1);
      write_bytes.fetch_add(b->bytes);
    }
    if (b->done) b->done(std::move(st));
    ucp_worker_signal(worker);  // the progress thread frees the requests
  }
  void track(Batch* b, ucs_status_ptr_t r) {
    if (UCS_PTR_IS_PTR(r)) {
      std::lock_guard<std::mutex> l(b->mu);
      b->reqs.push_back(r);
    } else {
      op_finished(b, UCS_PTR_STATUS(r));
    }
  }
  // Frees finished batches' requests and cancels the operations of those past their deadline.
  // Progress thread only (callbacks run inside ucp_worker_progress or ucp_request_cancel there).
  void sweep_batches(bool cancel_all) {
    std::vector<std::shared_ptr<Batch>> fin, late;
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> l(batch_mu);
      for (auto it = batches.begin(); it != batches.end();) {
        std::lock_guard<std::mutex> bl((*it)->mu);
        if ((*it)->finished) {
          fin.push_back(std::move(*it));
          it = batches.erase(it);
          continue;
        }
        if (!(*it)->cancelled && (cancel_all || (*it)->deadline < now)) {
          (*it)->cancelled = true;
          late.push_back(*it);
        }
        ++it;
      }
    }
    for (auto& b : fin)
      for (void* r : b->reqs) ucp_request_free(r);
    for (auto& b : late) {
      std::vector<void*> reqs;
      {
        std::lock_guard<std::mutex> l(b->mu);
        reqs = b->reqs;
      }
      for (void* r : reqs) ucp_request_cancel(worker, r);
    }
  }
  bool batches_pending() {
    std::lock_guard<std::mutex> l(batch_mu);
    return !batches.empty();
  }
  std::shared_ptr<Batch> new_batch(Deadline deadline, const char* what, std::function<void(Status)> done,
                                   size_t bytes = 0) {
    auto b = std::make_shared<Batch>();
    b->self = this;
    b->deadline = deadline;
    b->what = what;
    b->done = std::move(done);
    b->bytes = bytes;
    if (b->busy()) sending.fetch_add(1);
    std::lock_guard<std::mutex> l(batch_mu);
    batches.push_back(b);
    return b;
  }
  ucp_request_param_t batch_param(Batch* b) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = batch_cb;
    rp.user_data = b;
    return rp;
  }

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* e = static_cast<Ep*>(arg);
    e->failed.store(true);
    SL_LOG_INFO("ucx endpoint failed: %s (discarded; the next transfer makes a new one)", ucs_status_string(status));
  }

  Status init() {
    // UCX's TCP transport moves puts in 8 KiB segments by default: one event per segment halves
    // what a link carries. Larger segments and more events per progress call (measured here:
    // 0.7 -> 1.3-2.2 GB/s at 16-64 MiB across two namespaces). Transport settings are read from
    // the environment only: set there unless the user already has (theirs win).
    ::setenv("UCX_TCP_TX_SEG_SIZE", "64K", 0);
    ::setenv("UCX_TCP_RX_SEG_SIZE", "512K", 0);
    ::setenv("UCX_TCP_MAX_POLL", "64", 0);
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) return ucs_error("ucp_config_read", s);
    const char* tls = opts.protocol == "tcp"    ? "tcp,self"
                      : opts.protocol == "rdma" ? "rc,ud,dc,self"
                      : opts.protocol == "shm"  ? "sm,self"
                                                : "all";
    if (std::getenv("UCX_TLS") == nullptr) ucp_config_modify(cfg, "TLS", tls);
    if (!opts.device.empty()) ucp_config_modify(cfg, "NET_DEVICES", opts.device.c_str());
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    p.mt_workers_shared = 1;
    s = ucp_init(&p, cfg, &ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK)
      return ucs_error("UCX init for protocol '" + opts.protocol + "'" +
                           (opts.device.empty() ? "" : " on device '" + opts.device + "'"),
                       s);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_MULTI;  // connector threads post, the progress thread progresses
    s = ucp_worker_create(ctx, &wp, &worker);
    if (s != UCS_OK) return ucs_error("ucp_worker_create", s);
    ucp_address_t* a = nullptr;
    size_t alen = 0;
    ucp_am_handler_param_t ah{};
    ah.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ah.id = kAmId;
    ah.cb = &Impl::on_am;
    ah.arg = this;
    ah.flags = UCP_AM_FLAG_WHOLE_MSG;
    s = ucp_worker_set_am_recv_handler(worker, &ah);
    if (s != UCS_OK) return ucs_error("ucp_worker_set_am_recv_handler", s);
    ah.id = kReqId;
    ah.cb = &Impl::on_req;
    s = ucp_worker_set_am_recv_handler(worker, &ah);
    if (s != UCS_OK) return ucs_error("ucp_worker_set_am_recv_handler", s);
    s = ucp_worker_get_address(worker, &a, &alen);
    if (s != UCS_OK) return ucs_error("ucp_worker_get_address", s);
    addr = wrap_address(std::span<const std::byte>(reinterpret_cast<std::byte*>(a), alen));
    ucp_worker_release_address(worker, a);
    // The pool: allocated here (2 MiB-aligned, asking for transparent huge pages: a 512 MiB
    // payload is 256 page faults instead of 131072, and the kernel's socket copies miss the TLB
    // less) and registered once.
    constexpr size_t kHuge = 2u << 20;
    map_len = (opts.pool_bytes + kHuge - 1) / kHuge * kHuge + kHuge;
    void* m = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return make_error(Errc::exhausted, "mmap of a " + std::to_string(map_len) + "-byte pool failed");
    map_base = m;
    auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(m) + kHuge - 1) & ~uintptr_t(kHuge - 1));
    ::madvise(aligned, opts.pool_bytes, MADV_HUGEPAGE);  // advice: ignored where THP is off
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = aligned;
    mp.length = opts.pool_bytes;
    s = ucp_mem_map(ctx, &mp, &memh);
    if (s != UCS_OK) return ucs_error("registering a pool of " + std::to_string(opts.pool_bytes) + " bytes", s);
    ucp_mem_attr_t ma{};
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    s = ucp_mem_query(memh, &ma);
    if (s != UCS_OK) return ucs_error("ucp_mem_query", s);
    base = static_cast<std::byte*>(ma.address);
    size = ma.length;
    alloc = std::make_unique<BufferAllocator>(size, 64);
    s = ucp_worker_get_efd(worker, &efd);
    if (s != UCS_OK) return ucs_error("ucp_worker_get_efd", s);
    stopfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stopfd < 0) return make_error(Errc::io, "eventfd");
    progress = std::thread([this] { run(); });
    return {};
  }

  // Progress whenever the worker's fd says so; sleep otherwise. While this engine has work under
  // way (a payload expected, a send not complete) it keeps progressing between events for up to
  // 5 ms (a wake-up per fragment halves the rate, and a wake-up costs tens of microseconds on a
  // loaded host); idle, only for a short tail (STAGELINK_UCX_SPIN_US, 20 us), then it arms the fd
  // and sleeps: an idle engine uses no CPU.
  bool busy() const { return awaiting.load(std::memory_order_relaxed) > 0 || sending.load(std::memory_order_relaxed) > 0; }
  void run() {
    pthread_setname_np(pthread_self(), "sl-ucx-progress");  // as top -H and perf show it
    pollfd fds[2] = {{efd, POLLIN, 0}, {stopfd, POLLIN, 0}};
    static const uint64_t busy_ns = [] {
      const char* e = std::getenv("STAGELINK_UCX_BUSY_SPIN_US");
      return (e ? uint64_t(std::strtoull(e, nullptr, 10)) : uint64_t(5000)) * 1000;
    }();
    const uint64_t tail_ns = spin_us() * 1000;
    while (!stopping.load()) {
      uint64_t idle_since = 0;
      for (;;) {
        if (ucp_worker_progress(worker) != 0) {
          idle_since = 0;
          continue;
        }
        if (stopping.load()) break;
        const uint64_t now = mono_ns();
        if (!idle_since) idle_since = now;
        else if (now - idle_since > tail_ns && (now - idle_since > busy_ns || !busy())) break;
        // Between events, the core goes to any thread that wants it (the one waiting for this
        // payload, the peer process on a small host): spinning must never starve them.
        sched_yield();
      }
      sweep_batches(false);
      const ucs_status_t s = ucp_worker_arm(worker);
      if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
      ::poll(fds, 2, batches_pending() ? 50 : 1000);  // deadlines of operations under way are checked
      if (fds[1].revents & POLLIN) break;
    }
  }

  void shutdown() {
    if (closed.exchange(true)) return;
    stopping.store(true);
    if (stopfd >= 0) {
      const uint64_t one = 1;
      if (::write(stopfd, &one, sizeof one) < 0) {
      }
    }
    if (progress.joinable()) progress.join();
    // Sends still under way: cancelled and completed (their `done` runs) before the worker goes.
    for (int round = 0; worker && round < 1000 && batches_pending(); ++round) {
      sweep_batches(true);
      ucp_worker_progress(worker);
      if (round > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    // Receives still under way (a sender gone silent): cancelled and completed before the worker
    // goes, which UCX requires.
    for (int round = 0; worker && round < 1000; ++round) {
      std::vector<void*> reqs;
      {
        std::lock_guard<std::mutex> l(pend_mu);
        if (receiving.empty()) break;
        for (RecvHold* h : receiving)
          if (h->request) reqs.push_back(h->request);
      }
      if (round == 0)
        for (void* r : reqs) ucp_request_cancel(worker, r);
      ucp_worker_progress(worker);
      if (round > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    bool stuck;
    {
      std::lock_guard<std::mutex> l(pend_mu);
      stuck = !receiving.empty();
    }
    if (stuck) {
      // UCX 1.13 cannot cancel a rendezvous receive whose sender went silent (a link down), and
      // destroying its worker then aborts the process. Leave the worker, and the pool it may still
      // write to, to the process's exit: a bounded leak in that failure only, never a crash.
      SL_LOG_WARN("ucx: a receive from a peer that went silent is still under way; the worker and its "
                  "%zu-byte pool are left to process exit", size);
      worker = nullptr;
      memh = nullptr;
      ctx = nullptr;
    }
    {
      std::lock_guard<std::mutex> l(ep_mu);
      if (!stuck)
        for (auto& [k, e] : eps) close_ep(e->ep);
      eps.clear();
    }
    if (memh) ucp_mem_unmap(ctx, memh);
    if (map_base && !stuck) ::munmap(map_base, map_len);  // a stuck worker may still write there
    map_base = nullptr;
    memh = nullptr;
    if (worker) ucp_worker_destroy(worker);
    worker = nullptr;
    if (ctx) ucp_cleanup(ctx);
    ctx = nullptr;
    if (stopfd >= 0) ::close(stopfd);
    stopfd = -1;
    pool_cv.notify_all();
  }

  // Close an endpoint without waiting on the peer (it may be gone), progressing until done.
  void close_ep(ucp_ep_h ep) {
    if (!ep) return;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
    if (UCS_PTR_IS_PTR(r)) {
      const uint64_t dl = mono_ns() + 1'000'000'000ull;
      while (ucp_request_check_status(r) == UCS_INPROGRESS && mono_ns() < dl) ucp_worker_progress(worker);
      ucp_request_free(r);
    }
  }

  bool ep_failed(std::span<const std::byte> peer) {
    std::vector<std::byte> key(peer.begin(), peer.end());
    key.push_back(std::byte(0));
    std::lock_guard<std::mutex> l(ep_mu);
    auto it = eps.find(key);
    return it == eps.end() || it->second->failed.load();
  }
  // The endpoint to `peer` for `lane` (each lane its own connection).
  Result<std::shared_ptr<Ep>> endpoint(std::span<const std::byte> peer, unsigned lane = 0) {
    std::vector<std::byte> key(peer.begin(), peer.end());
    key.push_back(std::byte(lane));
    std::lock_guard<std::mutex> l(ep_mu);
    auto it = eps.find(key);
    if (it != eps.end()) {
      if (!it->second->failed.load()) return it->second;
      // Broken: discarded, never reused.
      close_ep(it->second->ep);
      eps.erase(it);
      eps_discarded.fetch_add(1);
    }
    SL_ASSIGN(const auto raw, unwrap_address(peer));  // checked before UCX reads a byte of it
    auto e = std::make_shared<Ep>();
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(raw.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::on_ep_error;
    ep.err_handler.arg = e.get();
    const ucs_status_t s = ucp_ep_create(worker, &ep, &e->ep);
    if (s != UCS_OK) return ucs_error("connecting to a peer", s);
    eps.emplace(std::move(key), e);
    return e;
  }
};

}  // namespace stagelink::ucx
