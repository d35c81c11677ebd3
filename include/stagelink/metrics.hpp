// The one instrumentation seam: metrics declared by their owners (a Family: name, kind, unit, help,
// label names), counted in cells the owner holds (atomics, relaxed: no lock and no allocation when
// counting), and gathered from one per-process tree of Sources when something asks (health(),
// Python's stagelink.metrics(), the Prometheus endpoint). Rendering (text exposition) is done at
// the edge, in Python, by prometheus_client.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include "stagelink/payload.hpp"

namespace stagelink::metrics {

enum class Kind : uint8_t { counter, gauge, histogram };

// A metric family, declared once (a namespace-scope constant of its owner) and listed by
// families() (the docs page is generated from that list). Names follow Prometheus' conventions:
// the `stagelink_` prefix, base units (`_bytes`, `_seconds`), counters ending in `_total`.
// Histograms are of durations, in seconds.
struct Family {
  Family(std::string_view name, Kind kind, std::string_view unit, std::string_view help,
         std::initializer_list<std::string_view> labels);
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;
  std::string name, unit, help;
  Kind kind;
  std::vector<std::string> labels;  // label names; a sample gives one value per name, in order
};
// Every family declared in this process (the built-in ones and any a user declared), by name.
std::vector<const Family*> families();

// A clock for durations that costs a fraction of clock_gettime's (the TSC where there is one);
// ticks become seconds at collection (calibrated against CLOCK_MONOTONIC since start-up).
inline uint64_t ticks() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
#endif
}
// Seconds per tick, measured since this process's first use of the metrics (more exact the longer
// the process has run; 1e-9 where ticks are nanoseconds).
double seconds_per_tick() noexcept;

// Latency histograms on the hot paths (a connector's put and get) time one call in
// time_every() per thread: a time-stamp-counter read costs 17-20 ns on a VM, four of them a third
// of a 1 KiB shared-memory put + get's counting. Calls are counted exactly all the same (in
// counters of their own); a histogram's count is the calls it timed. STAGELINK_METRICS_TIME_EVERY
// sets it at load (default 8; 1: every call).
inline std::atomic<uint32_t> g_time_every{8};
uint32_t time_every() noexcept;
void set_time_every(uint32_t n) noexcept;  // 0 is taken as 1
// ticks() when this call is one to time, else 0. `op` keeps a count of its own per thread (puts
// 0, gets 1, ...): one count for alternating puts and gets would time only one of the two.
inline uint64_t timed_start(unsigned op) noexcept {
  thread_local uint32_t n[4] = {};
  uint32_t& c = n[op & 3];
  if (++c < g_time_every.load(std::memory_order_relaxed)) return 0;
  c = 0;
  return ticks() | 1;  // never 0 (one tick off at most)
}

class Counter {
 public:
  void add(uint64_t n = 1) noexcept { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

class Gauge {
 public:
  void set(int64_t v) noexcept { v_.store(v, std::memory_order_relaxed); }
  void add(int64_t n) noexcept { v_.fetch_add(n, std::memory_order_relaxed); }
  int64_t value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> v_{0};
};

// A histogram of durations, in ticks: log-linear buckets (four per power of two, so a bucket is at
// most 19% wide); rendered in fixed buckets of seconds (kBounds), each fine bucket counted in the
// first bound at or above its upper edge. Its count is the sum of its buckets (no extra counter).
class Timing {
 public:
  static constexpr int kBuckets = 4 * 44;  // up to 2^44 ticks (over an hour at 4 GHz)
  void observe(uint64_t dt) noexcept {
    b_[index(dt)].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(dt, std::memory_order_relaxed);
  }
  // Time since `t0` (ticks()).
  void since(uint64_t t0) noexcept { observe(ticks() - t0); }
  static int index(uint64_t dt) noexcept {
    if (dt < 4) return int(dt);
    const int e = 63 - __builtin_clzll(dt);  // >= 2
    const int i = 4 * (e - 1) + int((dt >> (e - 2)) & 3);
    return i < kBuckets ? i : kBuckets - 1;
  }
  // The first tick count past bucket i.
  static uint64_t upper(int i) noexcept {
    if (i < 4) return uint64_t(i) + 1;
    const int e = i / 4 + 1;
    return (uint64_t(4 + (i % 4)) + 1) << (e - 2);
  }
  uint64_t count() const noexcept;
  uint64_t sum_ticks() const noexcept { return sum_.load(std::memory_order_relaxed); }
  uint64_t bucket(int i) const noexcept { return b_[i].load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> b_[kBuckets] = {};
  std::atomic<uint64_t> sum_{0};
};
// The bounds (seconds) a Timing is rendered in, +Inf last.
const std::vector<double>& bounds();

// One collected sample: a value (counter, gauge) or a histogram's cumulative bucket counts.
struct Sample {
  const Family* family = nullptr;
  std::vector<std::string> labels;  // values, in the family's label order
  double value = 0;
  std::vector<uint64_t> buckets;  // histogram: cumulative counts per bounds() entry
  double sum = 0;                 // histogram: seconds
};

// What a Source emits into when collected.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void emit(Sample s) = 0;
  void value(const Family& f, std::vector<std::string> labels, double v);
  void timing(const Family& f, std::vector<std::string> labels, const Timing& t);
};

// An owner's metrics in the per-process tree: collect() emits its samples. Registered while the
// owner lives (Registration); when it goes, its counters and histograms are kept (added to what
// the tree has retired under the same labels), so no counter ever goes back; its gauges go.
// collect() runs under the tree's lock: it must not register, unregister or call into the tree.
class Source {
 public:
  virtual ~Source() = default;
  virtual void collect(Sink& out) const = 0;
};

// Adds `s` to the tree until destroyed or reset (then what it counted is retired). Movable.
class Registration {
 public:
  Registration() = default;
  explicit Registration(const Source* s);
  Registration(Registration&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Registration& operator=(Registration&& o) noexcept;
  ~Registration() { reset(); }
  void reset();

 private:
  const Source* s_ = nullptr;
};

// Every sample of the tree now (live sources, then what retired ones counted), families in
// declaration order, samples with equal labels summed.
std::vector<Sample> collect();
// The same as a Value: [{name, kind, unit, help, labels: [names], samples: [{labels: [values],
// value} or {labels, buckets: [cumulative...], sum}]}], bounds() under "bounds" of histograms.
Value collect_value();

// One label set's value of a Dynamic metric: found once (Dynamic::cell), then counted with no
// lock, lookup or allocation (relaxed atomics). Lives as long as the process.
class DynamicCell {
 public:
  DynamicCell(const Family& f, size_t buckets) : f_(&f), b_(buckets) {}
  Status add(double v);              // counter (v >= 0), gauge
  Status set(double v);              // gauge
  Status observe(double seconds);    // histogram
  double value() const { return v_.load(std::memory_order_relaxed); }  // a histogram's: its sum
  uint64_t bucket(size_t i) const { return b_[i].load(std::memory_order_relaxed); }
  size_t buckets() const { return b_.size(); }

 private:
  const Family* f_;
  std::atomic<double> v_{0};
  std::vector<std::atomic<uint64_t>> b_;  // histogram: per bounds() entry, not cumulative
};

// A metric made at run time (Python's stagelink.metrics.counter(...), a user's): a family and its
// samples by label values, in the tree for the life of the process. Thread-safe. add/set/observe
// find the label set's cell each call; a caller that counts often finds it once with cell().
class Dynamic : public Source {
 public:
  // The family `name` if one is already declared with the same kind and labels; else declared.
  // Errors: invalid_argument (a bad name, or the name declared with another kind or labels).
  static Result<Dynamic*> get(std::string_view name, Kind kind, std::string_view unit, std::string_view help,
                              const std::vector<std::string>& labels);
  Status add(const std::vector<std::string>& labels, double v);    // counter, gauge
  Status set(const std::vector<std::string>& labels, double v);    // gauge
  Status observe(const std::vector<std::string>& labels, double seconds);  // histogram
  // The cell of these label values (made on first use). Errors: invalid_argument (not one value
  // per label name).
  Result<DynamicCell*> cell(const std::vector<std::string>& labels);
  const Family& family() const { return *f_; }
  void collect(Sink& out) const override;

  struct Impl;

 private:
  Dynamic() = default;
  const Family* f_ = nullptr;
  Impl* impl_ = nullptr;
};

}  // namespace stagelink::metrics
