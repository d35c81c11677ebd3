// Shared-memory transport administration: list and reclaim what stagelink put in /dev/shm.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "stagelink/result.hpp"

namespace stagelink::shm {

struct ResourceInfo {
  std::string name;       // name under the shm directory
  std::string kind;       // directory, arena, segment, orphan
  uint32_t owner_pid = 0;
  bool owner_alive = false;
  uint64_t size = 0;
  uint64_t held = 0;      // bytes the shm directory holds for it (an arena is reserved as used)
  double age_s = 0;
  uint64_t live_entries = 0;  // directories: entries in use
  uint64_t attached = 0;      // directories: attached processes
};

// Default prefix: "sl.<uid>." (per user). `shm_dir` defaults to /dev/shm.
std::string user_prefix();
std::vector<ResourceInfo> list_resources(const std::string& shm_dir = "/dev/shm");
// Reclaim what dead processes owned (stagelink's segments and directory entries, and the CUDA
// driver's cuda.shm.<uid>.<pid>.<n> file of a killed process that used CUDA IPC). Returns the
// names removed or repaired.
std::vector<std::string> reap(const std::string& shm_dir = "/dev/shm");

}  // namespace stagelink::shm
