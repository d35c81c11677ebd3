// Benchmark of one relay hop (relay put + control message + get) between two processes, with
// memcpy and raw ZeroMQ measured in the same run.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "bench/shm_bench.hpp"
#include "stagelink/result.hpp"

namespace stagelink::bench {

struct RelayRow {
  size_t size = 0;
  // Round trips: S bytes one way, 64 bytes back, each as relay put + data_ready + get (copy out
  // into a reused buffer, or a zero-copy view), or as raw ZeroMQ PUSH/PULL messages.
  Stat rtt_copy, rtt_view, rtt_zmq, rtt_view_zmqctl, memcpy_;
};

Result<std::vector<RelayRow>> bench_relay(const std::vector<size_t>& sizes, int iters, const std::string& ns,
                                          const std::function<void(const std::string&)>& progress);

}  // namespace stagelink::bench
