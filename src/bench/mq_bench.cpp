// stagelink bench mq: MessageQueue against ZeroMQ PUB/SUB over ipc://, same harness, same run.
//
// Harness (not part of what is measured): readers are forked processes; acknowledgements go
// through a counter in an anonymous shared mapping, so the writer paces messages without a
// second channel of the transport under test. One-way latency = the reader's CLOCK_MONOTONIC at
// receipt minus the writer's, written into the message just before it is sent.
#include "bench/mq_bench.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sched.h>
#include <thread>
#include <zmq.hpp>

#include "core/proc.hpp"
#include "stagelink/mq.hpp"

namespace stagelink::bench {

namespace {

struct Shared {
  std::atomic<uint64_t> acks;
  std::atomic<uint32_t> ready;
};

Shared* make_shared_block() {
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : new (p) Shared{};
}

bool wait_for(std::atomic<uint64_t>& a, uint64_t want, double timeout_s) {
  const uint64_t dl = mono_ns() + uint64_t(timeout_s * 1e9);
  for (uint32_t i = 0; a.load(std::memory_order_acquire) < want; ++i) {
    if ((i & 255) == 255) {
      if (mono_ns() > dl) return false;
      sched_yield();  // 2 cores: let the readers run
    }
  }
  return true;
}

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) / 1e9;
}

// What one reader reports back through its pipe: latency samples (us), then CPU fraction.
struct ReaderReport {
  std::vector<double> lat_us;
  double cpu_frac = 0;
};

void send_report(int fd, const ReaderReport& r) {
  uint64_t n = r.lat_us.size();
  if (write(fd, &n, 8) != 8) return;
  const char* p = reinterpret_cast<const char*>(r.lat_us.data());
  size_t left = n * sizeof(double);
  while (left) {
    ssize_t w = write(fd, p, left);
    if (w <= 0) return;
    p += w;
    left -= size_t(w);
  }
  if (write(fd, &r.cpu_frac, 8) != 8) return;
}

bool read_report(int fd, ReaderReport& r) {
  uint64_t n = 0;
  if (read(fd, &n, 8) != 8 || n > (1u << 24)) return false;
  r.lat_us.resize(n);
  char* p = reinterpret_cast<char*>(r.lat_us.data());
  size_t left = n * sizeof(double);
  while (left) {
    ssize_t g = read(fd, p, left);
    if (g <= 0) return false;
    p += g;
    left -= size_t(g);
  }
  return read(fd, &r.cpu_frac, 8) == 8;
}

enum class Phase { latency, throughput, bandwidth, idle };

struct Plan {
  Phase phase;
  uint32_t readers;
  size_t msg_bytes;
  uint64_t count;      // messages
  uint64_t warmup;     // latency samples to drop
  double idle_gap_s;   // idle phase: seconds between messages
};

// ---- the two transports behind one interface ----
struct Transport {
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Writer side (parent): set up before fork, then send.
  virtual bool send(const std::byte* p, size_t n) = 0;
  // Reader side (child): attach; recv calls fn on the message bytes.
  virtual bool attach(uint32_t rank) = 0;
  virtual bool recv(const std::function<void(std::span<const std::byte>)>& fn) = 0;
  virtual bool ready(double timeout_s) = 0;
};

struct SlTransport final : Transport {
  std::unique_ptr<MessageQueue> w, r;
  MessageQueueHandle h;
  explicit SlTransport(const Plan& pl) {
    MessageQueueOptions o;
    o.n_reader = o.n_local_reader = pl.readers;
    o.max_chunk_bytes = std::max<size_t>(4096, pl.msg_bytes <= (2u << 20) ? pl.msg_bytes + 4096 : 4096);
    o.max_chunks = pl.msg_bytes <= 4096 ? 64 : 8;
    o.overflow_bytes = pl.msg_bytes > (2u << 20) ? 4 * pl.msg_bytes + (1u << 20) : 0;
    o.warn_interval_s = 0;
    auto q = MessageQueue::create(o);
    if (q.ok()) {
      w = std::move(q).value();
      h = w->export_handle();
    }
  }
  const char* name() const override { return "stagelink"; }
  bool send(const std::byte* p, size_t n) override {
    return w->enqueue_bytes(std::span<const std::byte>(p, n), 30.0).ok();
  }
  bool attach(uint32_t rank) override {
    w.release();  // the parent's writer object: never touched (or freed) in the child
    auto q = MessageQueue::create_from_handle(h, rank);
    if (!q.ok()) return false;
    r = std::move(q).value();
    return true;
  }
  bool recv(const std::function<void(std::span<const std::byte>)>& fn) override {
    return r->dequeue_with(30.0, [&](std::span<const std::byte> frame) {
      auto p = decode_frame(frame);  // views, no copy
      if (p.ok() && !p->tensors.empty()) fn(p->tensors[0].data);
    }).ok();
  }
  bool ready(double timeout_s) override { return w && w->wait_until_ready(timeout_s).ok(); }
};

struct ZmqTransport final : Transport {
  std::string addr;
  zmq::context_t* ctx = nullptr;
  zmq::socket_t* sock = nullptr;
  uint32_t readers;
  Shared* sh;
  ZmqTransport(const Plan& pl, Shared* s) : readers(pl.readers), sh(s) {
    addr = "ipc:///tmp/stagelink-bench-" + std::to_string(getpid()) + ".ipc";
  }
  ~ZmqTransport() override {
    delete sock;
    delete ctx;
    ::unlink(addr.substr(6).c_str());
  }
  const char* name() const override { return "zeromq"; }
  bool setup_writer() {
    ctx = new zmq::context_t(1);
    sock = new zmq::socket_t(*ctx, zmq::socket_type::pub);
    sock->set(zmq::sockopt::sndhwm, 0);  // never drop: compare delivered messages only
    sock->set(zmq::sockopt::linger, 1000);
    sock->bind(addr);
    return true;
  }
  bool send(const std::byte* p, size_t n) override {
    return bool(sock->send(zmq::const_buffer(p, n), zmq::send_flags::none));
  }
  bool attach(uint32_t) override {
    // The child must not touch the parent's context: leak those pointers, make our own.
    sock = nullptr;
    ctx = new zmq::context_t(1);
    sock = new zmq::socket_t(*ctx, zmq::socket_type::sub);
    sock->set(zmq::sockopt::rcvhwm, 0);
    sock->set(zmq::sockopt::rcvtimeo, 30000);
    sock->set(zmq::sockopt::subscribe, "");
    sock->connect(addr);
    return true;
  }
  bool recv(const std::function<void(std::span<const std::byte>)>& fn) override {
    zmq::message_t m;
    if (!sock->recv(m, zmq::recv_flags::none)) return false;
    fn(std::span<const std::byte>(static_cast<const std::byte*>(m.data()), m.size()));
    return true;
  }
  bool ready(double timeout_s) override {
    // Slow joiner: subscriptions propagate asynchronously; probe until every reader got one.
    const uint64_t dl = mono_ns() + uint64_t(timeout_s * 1e9);
    std::byte probe[16] = {};
    while (sh->ready.load() < readers) {
      if (mono_ns() > dl) return false;
      send(probe, sizeof probe);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return true;
  }
};

// Runs one phase for one transport; returns the readers' reports and the writer's elapsed time.
bool run_phase(const Plan& pl, bool zmq_peer, std::vector<ReaderReport>& reports, double& elapsed_s) {
  Shared* sh = make_shared_block();
  if (!sh) return false;
  std::unique_ptr<Transport> t;
  if (zmq_peer) {
    auto z = std::make_unique<ZmqTransport>(pl, sh);
    z->setup_writer();
    t = std::move(z);
  } else {
    auto s = std::make_unique<SlTransport>(pl);
    if (!s->w) return false;
    t = std::move(s);
  }
  std::vector<pid_t> kids;
  std::vector<int> fds;
  for (uint32_t r = 0; r < pl.readers; ++r) {
    int p[2];
    if (pipe(p) != 0) return false;
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      if (!t->attach(r)) _exit(2);
      ReaderReport rep;
      rep.lat_us.reserve(pl.phase == Phase::latency || pl.phase == Phase::idle ? pl.count : 0);
      std::vector<std::byte> sink(pl.phase == Phase::bandwidth ? pl.msg_bytes : 0);
      bool announced = false;
      const double cpu0 = cpu_seconds();
      const uint64_t wall0 = mono_ns();
      uint64_t got = 0;
      while (got < pl.count) {
        if (!announced && !zmq_peer) {
          sh->ready.fetch_add(1);
          announced = true;
        }
        bool real = true;
        bool ok = t->recv([&](std::span<const std::byte> m) {
          const uint64_t now = mono_ns();
          if (m.size() < 8) return;
          uint64_t ts;
          std::memcpy(&ts, m.data(), 8);
          if (ts == 0) {  // a zmq readiness probe
            real = false;
            if (!announced) {
              sh->ready.fetch_add(1);
              announced = true;
            }
            return;
          }
          if (pl.phase == Phase::latency || pl.phase == Phase::idle) rep.lat_us.push_back(double(now - ts) / 1e3);
          if (pl.phase == Phase::bandwidth) std::memcpy(sink.data(), m.data(), std::min(m.size(), sink.size()));
        });
        if (!ok) _exit(3);
        if (!real) continue;
        ++got;
        if (pl.phase != Phase::throughput || got == pl.count) sh->acks.fetch_add(pl.phase == Phase::throughput ? got : 1);
      }
      rep.cpu_frac = (cpu_seconds() - cpu0) / (double(mono_ns() - wall0) / 1e9);
      send_report(p[1], rep);
      _exit(0);
    }
    close(p[1]);
    kids.push_back(pid);
    fds.push_back(p[0]);
  }
  bool ok = t->ready(30.0);
  std::vector<std::byte> msg(std::max<size_t>(pl.msg_bytes, 16), std::byte{1});
  const uint64_t t0 = mono_ns();
  for (uint64_t i = 0; ok && i < pl.count; ++i) {
    if (pl.phase == Phase::idle) std::this_thread::sleep_for(std::chrono::duration<double>(pl.idle_gap_s));
    const uint64_t ts = mono_ns();
    std::memcpy(msg.data(), &ts, 8);
    ok = t->send(msg.data(), pl.msg_bytes);
    if (ok && pl.phase != Phase::throughput && pl.phase != Phase::bandwidth)
      ok = wait_for(sh->acks, (i + 1) * pl.readers, 30.0);
  }
  if (ok && (pl.phase == Phase::throughput || pl.phase == Phase::bandwidth))
    ok = wait_for(sh->acks, pl.count * pl.readers, 120.0);
  elapsed_s = double(mono_ns() - t0) / 1e9;
  reports.clear();
  for (size_t i = 0; i < kids.size(); ++i) {
    ReaderReport rep;
    if (ok && read_report(fds[i], rep)) reports.push_back(std::move(rep));
    close(fds[i]);
  }
  for (auto pid : kids) {
    if (!ok) kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
  }
  t.reset();
  munmap(sh, 4096);
  return ok && reports.size() == kids.size();
}

Value stat_value(std::vector<double> s) {
  Stat st = summarize(std::move(s));
  Value::Map m;
  m.emplace_back("median_us", st.median_us);
  m.emplace_back("p99_us", st.p99_us);
  return Value(std::move(m));
}

}  // namespace

Value bench_mq(const MqBenchOptions& o, const std::function<void(const std::string&)>& progress) {
  Value::Map out;
  for (bool peer : {false, true}) {
    const char* who = peer ? "zeromq" : "stagelink";
    Value::Map m;
    std::vector<ReaderReport> reps;
    double el = 0;
    for (uint32_t n : {1u, 4u}) {
      if (progress) progress(std::string(who) + ": 64 B one-way latency, 1 -> " + std::to_string(n));
      Plan lat{Phase::latency, n, 64, o.latency_msgs + 200, 200, 0};
      if (run_phase(lat, peer, reps, el)) {
        std::vector<double> all;
        for (auto& r : reps) all.insert(all.end(), r.lat_us.begin() + std::min<size_t>(200, r.lat_us.size()), r.lat_us.end());
        m.emplace_back("latency_64B_1to" + std::to_string(n), stat_value(all));
      }
      if (progress) progress(std::string(who) + ": 64 B messages per second, 1 -> " + std::to_string(n));
      Plan thr{Phase::throughput, n, 64, o.throughput_msgs, 0, 0};
      if (run_phase(thr, peer, reps, el)) m.emplace_back("msgs_per_s_1to" + std::to_string(n), double(thr.count) / el);
    }
    for (size_t size : {size_t(1) << 20, size_t(16) << 20}) {
      if (progress) progress(std::string(who) + ": bandwidth at " + std::to_string(size >> 20) + " MiB, 1 -> 1");
      Plan bw{Phase::bandwidth, 1, size, size >= (16u << 20) ? o.bandwidth_msgs / 8 + 4 : o.bandwidth_msgs, 0, 0};
      if (run_phase(bw, peer, reps, el))
        m.emplace_back("gbps_" + std::to_string(size >> 20) + "MiB", double(bw.count) * double(size) / el / 1e9);
    }
    if (progress) progress(std::string(who) + ": wake-up after " + std::to_string(o.idle_gap_s) + " s idle, x" +
                           std::to_string(o.idle_msgs) + " (idle CPU measured meanwhile)");
    Plan idle{Phase::idle, 1, 64, o.idle_msgs, 0, o.idle_gap_s};
    if (run_phase(idle, peer, reps, el)) {
      m.emplace_back("wakeup_after_idle", stat_value(reps[0].lat_us));
      m.emplace_back("idle_reader_cpu_pct", reps[0].cpu_frac * 100.0);
    }
    out.emplace_back(who, Value(std::move(m)));
  }
  return Value(std::move(out));
}

}  // namespace stagelink::bench
