#include "stagelink/trace.hpp"

#include <sys/random.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "stagelink/metrics.hpp"

namespace stagelink::trace {

namespace {

std::atomic<bool> g_recording{false};

const metrics::Family kDropped{"stagelink_trace_spans_dropped_total", metrics::Kind::counter, "",
                               "trace spans dropped: more than 65536 waited to be gathered", {}};
const metrics::Family kRecorded{"stagelink_trace_spans_total", metrics::Kind::counter, "",
                                "trace spans this process recorded (sampled requests only)", {}};

struct Buffer : metrics::Source {
  std::mutex mu;
  std::vector<Span> spans;
  metrics::Counter dropped, recorded;
  metrics::Registration reg{this};
  void collect(metrics::Sink& out) const override {
    out.value(kDropped, {}, double(dropped.value()));
    out.value(kRecorded, {}, double(recorded.value()));
  }
};
Buffer& buffer() {
  static Buffer* b = new Buffer;  // never destroyed: spans may be recorded during exit
  return *b;
}

int hexval(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // W3C: lowercase only
}
bool hex64(std::string_view s, uint64_t& out) noexcept {
  uint64_t v = 0;
  for (char c : s) {
    const int h = hexval(c);
    if (h < 0) return false;
    v = (v << 4) | uint64_t(h);
  }
  out = v;
  return true;
}
void put_hex(std::string& s, uint64_t v, int digits) {
  static const char* d = "0123456789abcdef";
  for (int i = digits - 1; i >= 0; --i) s.push_back(d[(v >> (4 * i)) & 15]);
}

}  // namespace

std::optional<Context> parse(std::string_view tp) noexcept {
  // 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>
  if (tp.size() != 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-') return std::nullopt;
  if (tp.substr(0, 2) != "00") return std::nullopt;
  Context c;
  uint64_t flags = 0;
  if (!hex64(tp.substr(3, 16), c.trace_hi) || !hex64(tp.substr(19, 16), c.trace_lo) ||
      !hex64(tp.substr(36, 16), c.span) || !hex64(tp.substr(53, 2), flags))
    return std::nullopt;
  if ((c.trace_hi == 0 && c.trace_lo == 0) || c.span == 0) return std::nullopt;
  c.flags = uint8_t(flags);
  return c;
}

std::string format(const Context& c) {
  std::string s = "00-";
  s.reserve(55);
  put_hex(s, c.trace_hi, 16);
  put_hex(s, c.trace_lo, 16);
  s.push_back('-');
  put_hex(s, c.span, 16);
  s.push_back('-');
  put_hex(s, c.flags, 2);
  return s;
}

uint64_t new_id() noexcept {
  // xorshift64*, seeded per thread from the kernel's random pool.
  thread_local uint64_t state = [] {
    uint64_t seed = 0;
    if (getrandom(&seed, sizeof seed, 0) != sizeof seed) seed = now_ns() ^ uint64_t(::syscall(SYS_gettid));
    return seed | 1;
  }();
  for (;;) {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    const uint64_t v = state * 0x2545F4914F6CDD1DULL;
    if (v) return v;
  }
}

uint64_t now_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ULL + uint64_t(ts.tv_nsec);
}

uint64_t this_thread_id() noexcept {
  thread_local const uint64_t tid = uint64_t(::syscall(SYS_gettid));
  return tid;
}

bool recording() noexcept { return g_recording.load(std::memory_order_relaxed); }
void set_recording(bool on) noexcept {
  if (on) (void)buffer();  // its metrics registered from now on
  g_recording.store(on, std::memory_order_relaxed);
}

void record(Span s) {
  Buffer& b = buffer();
  std::lock_guard<std::mutex> l(b.mu);
  if (b.spans.size() >= kMaxBuffered) {
    b.dropped.add();
    return;
  }
  b.recorded.add();
  b.spans.push_back(std::move(s));
}

std::vector<Span> drain() {
  Buffer& b = buffer();
  std::vector<Span> out;
  std::lock_guard<std::mutex> l(b.mu);
  out.swap(b.spans);
  return out;
}

uint64_t dropped() noexcept { return buffer().dropped.value(); }

void record_under(std::string_view parent, const char* name, const char* cat, uint64_t start_ns,
                  std::string_view request_id, Value args) {
  if (!recording()) return;
  auto c = parse(parent);
  if (!c || !c->sampled()) return;
  Span s;
  s.name = name;
  s.cat = cat;
  s.start_ns = start_ns;
  s.end_ns = now_ns();
  s.trace_hi = c->trace_hi;
  s.trace_lo = c->trace_lo;
  s.span_id = new_id();
  s.parent_id = c->span;
  s.request_id = std::string(request_id);
  s.args = std::move(args);
  s.tid = this_thread_id();
  record(std::move(s));
}

}  // namespace stagelink::trace
