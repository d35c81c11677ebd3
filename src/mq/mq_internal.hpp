// What the MessageQueue's writer (message_queue.cpp) and readers (mq_readers.cpp) share:
// message tags, deadlines, the remote readers' subscription topics. Internal.
#pragma once
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <zmq.hpp>

#include "core/log.hpp"
#include "core/msgpack_io.hpp"
#include "core/net.hpp"
#include "core/proc.hpp"
#include "core/zmq_fork.hpp"
#include "core/zap.hpp"
#include "core/zmq_util.hpp"
#include "shm/ring.hpp"
#include "stagelink/allocator.hpp"
#include "stagelink/shm.hpp"

namespace stagelink {

using shm::Ring;
using shm::RingChunk;
using shm::Segment;

// Connections a writer's remote-reader socket lets in at once; strangers beyond it are shut down.
inline constexpr size_t kRemoteMaxConnections = 1024;
inline constexpr char kMsgTag = 'M';
inline constexpr char kShutdownTag = 'S';
inline constexpr size_t kMaxSegName = 200;

inline uint64_t deadline_from(double timeout_s) {
  if (timeout_s == 0) return mono_ns() + 1;  // one attempt
  return deadline_ns(timeout_s, mono_ns());  // 0: for ever (negative, infinite, NaN, absurd)
}
// The subscription topic a remote reader adds so the writer knows its rank. Messages start with
// 'M' or 'S', so this topic never matches one.
// A remote reader's subscription topic: its rank and a nonce (two readers may share a rank, -1).
inline std::string rank_topic(int64_t rank) {
  static std::atomic<uint32_t> n{0};
  return "\xffR" + std::to_string(rank) + "/" + std::to_string(getpid()) + "." + std::to_string(n.fetch_add(1));
}
inline constexpr const char* kShutDown = "cancelled: message queue was shut down";

inline std::string ranks_str(const std::vector<uint32_t>& r) {
  std::string s;
  for (auto x : r) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace stagelink
