// Benchmarks of the MessageQueue, with ZeroMQ PUB/SUB over ipc:// measured in the same run.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "bench/shm_bench.hpp"
#include "stagelink/payload.hpp"

namespace stagelink::bench {

struct MqBenchOptions {
  uint64_t latency_msgs = 20000;     // one-way latency samples per reader (64 B)
  uint64_t throughput_msgs = 200000; // 64 B messages streamed for messages per second
  uint64_t bandwidth_msgs = 64;      // 1 MiB messages (16 MiB: an eighth of that, plus 4)
  uint64_t idle_msgs = 5;            // wake-ups after idle_gap_s of silence
  double idle_gap_s = 1.0;
};

// {"stagelink": {...}, "zeromq": {...}}: latency_64B_1to1/_1to4 {median_us, p99_us},
// msgs_per_s_1to1/_1to4, gbps_1MiB, gbps_16MiB, wakeup_after_idle {median_us, p99_us},
// idle_reader_cpu_pct.
Value bench_mq(const MqBenchOptions& o, const std::function<void(const std::string&)>& progress);

}  // namespace stagelink::bench
