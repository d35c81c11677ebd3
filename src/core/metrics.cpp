// The per-process metrics tree (include/stagelink/metrics.hpp): families, live sources, what
// retired sources counted, collection, and run-time (Dynamic) metrics.
#include "stagelink/metrics.hpp"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace stagelink::metrics {
namespace {

using Clock = std::chrono::steady_clock;

struct Calibration {
  uint64_t t0 = ticks();
  Clock::time_point c0 = Clock::now();
};
Calibration& calibration() {
  static Calibration c;
  return c;
}
// Taken when the library loads, so a process's first collection has a long baseline.
[[maybe_unused]] const Calibration& g_calibration_at_load = calibration();

struct Families {
  std::mutex mu;
  std::vector<const Family*> list;
};
Families& family_list() {
  static Families* f = new Families;  // never destroyed: families of other libraries outlive ours
  return *f;
}

using Key = std::pair<const Family*, std::vector<std::string>>;

// Samples summed by (family, labels).
struct Table {
  std::map<Key, Sample> rows;
  void add(Sample&& s, bool keep_gauges = true) {
    if (!keep_gauges && s.family->kind == Kind::gauge) return;
    auto it = rows.find({s.family, s.labels});
    if (it == rows.end()) {
      Key k{s.family, s.labels};
      rows.emplace(std::move(k), std::move(s));
      return;
    }
    Sample& t = it->second;
    t.value += s.value;
    t.sum += s.sum;
    if (t.buckets.size() < s.buckets.size()) t.buckets.resize(s.buckets.size());
    for (size_t i = 0; i < s.buckets.size(); ++i) t.buckets[i] += s.buckets[i];
  }
};

struct TableSink final : Sink {
  Table& t;
  bool keep_gauges;
  TableSink(Table& t, bool keep_gauges) : t(t), keep_gauges(keep_gauges) {}
  void emit(Sample s) override { t.add(std::move(s), keep_gauges); }
};

struct Tree {
  std::mutex mu;
  std::vector<const Source*> live;
  Table retired;
};
Tree& tree() {
  static Tree* t = new Tree;  // never destroyed: sources may unregister during exit
  return *t;
}

bool valid_name(std::string_view n) {
  if (n.empty() || (n[0] >= '0' && n[0] <= '9')) return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == ':')) return false;
  return true;
}

}  // namespace

Family::Family(std::string_view n, Kind k, std::string_view u, std::string_view h,
               std::initializer_list<std::string_view> ls)
    : name(n), unit(u), help(h), kind(k) {
  for (auto l : ls) labels.emplace_back(l);
  auto& f = family_list();
  std::lock_guard<std::mutex> g(f.mu);
  f.list.push_back(this);
}

std::vector<const Family*> families() {
  auto& f = family_list();
  std::lock_guard<std::mutex> g(f.mu);
  std::vector<const Family*> out = f.list;
  std::stable_sort(out.begin(), out.end(), [](const Family* a, const Family* b) { return a->name < b->name; });
  out.erase(std::unique(out.begin(), out.end(), [](const Family* a, const Family* b) { return a->name == b->name; }),
            out.end());
  return out;
}

uint32_t time_every() noexcept { return g_time_every.load(std::memory_order_relaxed); }
void set_time_every(uint32_t n) noexcept { g_time_every.store(n ? n : 1, std::memory_order_relaxed); }

namespace {
// STAGELINK_METRICS_TIME_EVERY at load (a positive integer; anything else leaves the default).
const bool kTimeEveryFromEnv = [] {
  if (const char* v = std::getenv("STAGELINK_METRICS_TIME_EVERY")) {
    char* end = nullptr;
    const unsigned long n = std::strtoul(v, &end, 10);
    if (end != v && *end == '\0' && n > 0 && n <= 1u << 20) set_time_every(uint32_t(n));
  }
  return true;
}();
}  // namespace

double seconds_per_tick() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  auto& c = calibration();
  // A baseline of at least 2 ms (only a collection right after start-up waits for it).
  while (Clock::now() - c.c0 < std::chrono::milliseconds(2)) std::this_thread::yield();
  const auto now = Clock::now();
  const uint64_t t = ticks();
  const double ns = double(std::chrono::duration_cast<std::chrono::nanoseconds>(now - c.c0).count());
  return t > c.t0 ? ns * 1e-9 / double(t - c.t0) : 1e-9;
#else
  return 1e-9;
#endif
}

uint64_t Timing::count() const noexcept {
  uint64_t n = 0;
  for (const auto& b : b_) n += b.load(std::memory_order_relaxed);
  return n;
}

const std::vector<double>& bounds() {
  static const std::vector<double> b = {1e-6, 2.5e-6, 5e-6,  1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4,
                                        5e-4, 1e-3,   2.5e-3, 5e-3, 1e-2,   2.5e-2, 5e-2, 0.1,
                                        0.25, 0.5,    1,      2.5,  5,      10,     30,   INFINITY};
  return b;
}

void Sink::value(const Family& f, std::vector<std::string> labels, double v) {
  Sample s;
  s.family = &f;
  s.labels = std::move(labels);
  s.value = v;
  emit(std::move(s));
}

void Sink::timing(const Family& f, std::vector<std::string> labels, const Timing& t) {
  const auto& b = bounds();
  const double spt = seconds_per_tick();
  Sample s;
  s.family = &f;
  s.labels = std::move(labels);
  s.buckets.assign(b.size(), 0);
  size_t j = 0;
  for (int i = 0; i < Timing::kBuckets; ++i) {
    const uint64_t c = t.bucket(i);
    if (!c) continue;
    const double edge = double(Timing::upper(i)) * spt;
    while (j + 1 < b.size() && b[j] < edge) ++j;
    s.buckets[j] += c;
  }
  for (size_t i = 1; i < s.buckets.size(); ++i) s.buckets[i] += s.buckets[i - 1];
  s.value = double(s.buckets.back());
  s.sum = double(t.sum_ticks()) * spt;
  emit(std::move(s));
}

Registration::Registration(const Source* s) : s_(s) {
  auto& t = tree();
  std::lock_guard<std::mutex> g(t.mu);
  t.live.push_back(s);
}

Registration& Registration::operator=(Registration&& o) noexcept {
  if (this != &o) {
    reset();
    s_ = std::exchange(o.s_, nullptr);
  }
  return *this;
}

void Registration::reset() {
  if (!s_) return;
  auto& t = tree();
  std::lock_guard<std::mutex> g(t.mu);
  TableSink sink(t.retired, false);
  s_->collect(sink);
  t.live.erase(std::remove(t.live.begin(), t.live.end(), s_), t.live.end());
  s_ = nullptr;
}

std::vector<Sample> collect() {
  Table all;
  {
    auto& t = tree();
    std::lock_guard<std::mutex> g(t.mu);
    TableSink sink(all, true);
    for (const Source* s : t.live) s->collect(sink);
    for (const auto& [k, s] : t.retired.rows) all.add(Sample(s));
  }
  std::vector<Sample> out;
  out.reserve(all.rows.size());
  for (auto& [k, s] : all.rows) out.push_back(std::move(s));
  std::stable_sort(out.begin(), out.end(),
                   [](const Sample& a, const Sample& b) { return a.family->name < b.family->name; });
  return out;
}

Value collect_value() {
  const char* kinds[] = {"counter", "gauge", "histogram"};
  Value::List fams;
  const Family* cur = nullptr;
  Value::List samples;
  auto flush = [&] {
    if (!cur) return;
    Value::Map f;
    f.emplace_back("name", cur->name);
    f.emplace_back("kind", kinds[int(cur->kind)]);
    f.emplace_back("unit", cur->unit);
    f.emplace_back("help", cur->help);
    Value::List ln;
    for (auto& l : cur->labels) ln.emplace_back(l);
    f.emplace_back("labels", Value(std::move(ln)));
    if (cur->kind == Kind::histogram) {
      Value::List b;
      for (double x : bounds()) b.emplace_back(x);
      f.emplace_back("bounds", Value(std::move(b)));
    }
    f.emplace_back("samples", Value(std::move(samples)));
    fams.emplace_back(Value(std::move(f)));
    samples = {};
  };
  for (auto& s : collect()) {
    if (s.family != cur) {
      flush();
      cur = s.family;
    }
    Value::Map m;
    Value::List lv;
    for (auto& l : s.labels) lv.emplace_back(l);
    m.emplace_back("labels", Value(std::move(lv)));
    if (cur->kind == Kind::histogram) {
      Value::List b;
      for (uint64_t c : s.buckets) b.emplace_back(c);
      m.emplace_back("buckets", Value(std::move(b)));
      m.emplace_back("sum", s.sum);
    } else {
      m.emplace_back("value", s.value);
    }
    samples.emplace_back(Value(std::move(m)));
  }
  flush();
  return Value(std::move(fams));
}

// -- run-time metrics

struct Dynamic::Impl {
  std::unique_ptr<Family> family;
  mutable std::mutex mu;  // the map only: cells count without it
  std::map<std::vector<std::string>, std::unique_ptr<DynamicCell>> cells;
  Registration reg;
};

namespace {
struct Dynamics {
  std::mutex mu;
  std::unordered_map<std::string, Dynamic*> by_name;
};
Dynamics& dynamics() {
  static Dynamics* d = new Dynamics;  // never destroyed, as the metrics it holds
  return *d;
}
}  // namespace

Result<Dynamic*> Dynamic::get(std::string_view name, Kind kind, std::string_view unit, std::string_view help,
                              const std::vector<std::string>& labels) {
  if (!valid_name(name)) return make_error(Errc::invalid_argument, "metric name " + std::string(name) + ": letters, digits, _ and : only");
  for (auto& l : labels)
    if (!valid_name(l) || l.find(':') != std::string::npos)
      return make_error(Errc::invalid_argument, "metric " + std::string(name) + ": label name '" + l + "' is not valid");
  auto& d = dynamics();
  std::lock_guard<std::mutex> g(d.mu);
  if (auto it = d.by_name.find(std::string(name)); it != d.by_name.end()) {
    const Family& f = *it->second->f_;
    if (f.kind != kind || f.labels != labels)
      return make_error(Errc::invalid_argument, "metric " + std::string(name) + " is already declared with another kind or labels");
    return it->second;
  }
  for (const Family* f : families())
    if (f->name == name) return make_error(Errc::invalid_argument, "metric " + std::string(name) + " is stagelink's own");
  auto* dyn = new Dynamic;
  dyn->impl_ = new Impl;
  dyn->impl_->family = std::make_unique<Family>(name, kind, unit, help, std::initializer_list<std::string_view>{});
  dyn->impl_->family->labels = labels;
  dyn->f_ = dyn->impl_->family.get();
  dyn->impl_->reg = Registration(dyn);
  d.by_name.emplace(std::string(name), dyn);
  return dyn;
}

Result<DynamicCell*> Dynamic::cell(const std::vector<std::string>& labels) {
  if (labels.size() != f_->labels.size())
    return make_error(Errc::invalid_argument, "metric " + f_->name + " takes " + std::to_string(f_->labels.size()) +
                                                  " label values, not " + std::to_string(labels.size()));
  std::lock_guard<std::mutex> g(impl_->mu);
  auto& c = impl_->cells[labels];
  if (!c) c = std::make_unique<DynamicCell>(*f_, f_->kind == Kind::histogram ? bounds().size() : 0);
  return c.get();
}

Status Dynamic::add(const std::vector<std::string>& labels, double v) {
  SL_ASSIGN(DynamicCell * c, cell(labels));
  return c->add(v);
}
Status Dynamic::set(const std::vector<std::string>& labels, double v) {
  SL_ASSIGN(DynamicCell * c, cell(labels));
  return c->set(v);
}
Status Dynamic::observe(const std::vector<std::string>& labels, double seconds) {
  SL_ASSIGN(DynamicCell * c, cell(labels));
  return c->observe(seconds);
}

Status DynamicCell::add(double v) {
  if (f_->kind == Kind::histogram) return make_error(Errc::invalid_argument, f_->name + " is a histogram: observe()");
  if (f_->kind == Kind::counter && !(v >= 0)) return make_error(Errc::invalid_argument, f_->name + " is a counter: it only goes up");
  v_.fetch_add(v, std::memory_order_relaxed);
  return {};
}

Status DynamicCell::set(double v) {
  if (f_->kind != Kind::gauge) return make_error(Errc::invalid_argument, f_->name + " is not a gauge");
  v_.store(v, std::memory_order_relaxed);
  return {};
}

Status DynamicCell::observe(double seconds) {
  if (f_->kind != Kind::histogram) return make_error(Errc::invalid_argument, f_->name + " is not a histogram");
  if (!(seconds >= 0)) return make_error(Errc::invalid_argument, f_->name + ": a duration is not negative");
  const auto& b = bounds();
  const size_t j = size_t(std::lower_bound(b.begin(), b.end(), seconds) - b.begin());
  b_[std::min(j, b_.size() - 1)].fetch_add(1, std::memory_order_relaxed);
  v_.fetch_add(seconds, std::memory_order_relaxed);
  return {};
}

void Dynamic::collect(Sink& out) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  for (const auto& [labels, c] : impl_->cells) {
    Sample s;
    s.family = f_;
    s.labels = labels;
    s.value = c->value();
    if (f_->kind == Kind::histogram) {
      s.buckets.resize(c->buckets());
      for (size_t i = 0; i < s.buckets.size(); ++i) s.buckets[i] = c->bucket(i) + (i ? s.buckets[i - 1] : 0);
      s.sum = s.value;
      s.value = s.buckets.empty() ? 0 : double(s.buckets.back());
    }
    out.emit(std::move(s));
  }
}

}  // namespace stagelink::metrics
