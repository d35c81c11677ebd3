// Per-request trace spans: W3C trace context (traceparent) and one per-process span buffer.
//
// A request that is traced carries a traceparent ("00-<trace id>-<parent span id>-<flags>", W3C
// Trace Context level 1) in its control messages and in the put and get options of the connectors
// and relays it moves through. A call given a *sampled* traceparent, in a process whose recording
// is on (set_recording), records a span, a child of that parent, in this process's buffer; the
// pipeline runtime drains the buffers of every process and writes one trace (Chrome JSON, OTLP).
// A call given no traceparent, or an unsampled one, records nothing and costs one branch.
//
//   trace::set_recording(true);
//   PutOptions po;
//   po.traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
//   conn->put("a", "b", "k", payload, po);       // records a span "connector.put"
//   for (auto& s : trace::drain()) ...           // its name, times, ids, request, args
//
// Times are CLOCK_MONOTONIC nanoseconds: the processes of one host share that clock; the runtime
// estimates other hosts' offsets (docs/observability.md).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "stagelink/payload.hpp"

namespace stagelink::trace {

struct Context {
  uint64_t trace_hi = 0, trace_lo = 0;  // the 128-bit trace id
  uint64_t span = 0;                    // the parent span's id (the span that made this context)
  uint8_t flags = 0;                    // bit 0: sampled
  bool sampled() const noexcept { return flags & 1; }
};

// A W3C traceparent of version 00 (55 characters, lowercase hex); nullopt for anything else,
// including all-zero ids (the specification's "invalid"), which a receiver ignores.
std::optional<Context> parse(std::string_view traceparent) noexcept;
std::string format(const Context& c);
// A random non-zero 64-bit id (span ids; two make a trace id).
uint64_t new_id() noexcept;
uint64_t now_ns() noexcept;  // CLOCK_MONOTONIC

// Whether this process records the spans of sampled calls (off: sampled traceparents are passed
// on but nothing is kept).
bool recording() noexcept;
void set_recording(bool on) noexcept;

struct Span {
  std::string name, cat;  // cat: connector, relay, stage, pipeline (the Chrome trace's category)
  uint64_t start_ns = 0, end_ns = 0;
  uint64_t trace_hi = 0, trace_lo = 0, span_id = 0, parent_id = 0;
  std::string request_id;
  Value args;        // a map of small values (bytes, key, error, ...)
  uint64_t tid = 0;  // the recording thread (Linux thread id)
};

// Keep `s` (at most kMaxBuffered spans wait to be drained; past that a span is dropped and
// counted: stagelink_trace_spans_dropped_total).
inline constexpr size_t kMaxBuffered = 1u << 16;
void record(Span s);
std::vector<Span> drain();
uint64_t dropped() noexcept;
uint64_t this_thread_id() noexcept;

// Record a span under `parent` (a traceparent) for a call that ran from `start_ns` until now,
// when `parent` is sampled and recording is on; nothing otherwise. `args` a map (nil: none).
void record_under(std::string_view parent, const char* name, const char* cat, uint64_t start_ns,
                  std::string_view request_id, Value args = {});

}  // namespace stagelink::trace
