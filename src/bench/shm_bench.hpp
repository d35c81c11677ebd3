// Benchmarks of the shared-memory connector through the C++ API, with memcpy as the peer.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace stagelink::bench {

struct Stat { double median_us = 0, p99_us = 0; };
Stat summarize(std::vector<double> samples_us);

struct ShmRow {
  size_t size = 0;
  int iters = 0;
  Stat put, get, get_into, get_view, roundtrip, memcpy_;  // get_into: into a reused buffer
};

// In-process put/get (producer and consumer connectors), and a cross-process round trip with a
// forked consumer: put, the consumer wakes in get(key), reads, puts an acknowledgement, which the
// producer gets. `ns`: shared-memory namespace to use.
std::vector<ShmRow> bench_shm(const std::vector<size_t>& sizes, int iters, const std::string& ns,
                              size_t arena_bytes);

// What the metrics seam adds to one put + get, in ns: exactly what Connector::put and get do to
// count a successful call (a call and a bytes counter, the traceparent test, and for one call in
// metrics::time_every() a time-stamp-counter read before and after and a histogram observation),
// `iters` times over, median of `rounds` rounds.
double seam_ns_per_put_get(int iters, int rounds);

}  // namespace stagelink::bench
