// stagelink shm ls / reap.
#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "shm/directory.hpp"
#include "stagelink/shm.hpp"

namespace stagelink::shm {

std::string user_prefix() { return "sl." + std::to_string(::getuid()) + "."; }

namespace {
// Files under our prefix that are ours (check_owner); with `foreign`, those another user made
// under our names instead: never opened, read or removed, only listed.
std::vector<std::string> our_files(const std::string& dir, bool foreign = false) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  const std::string pre = user_prefix();
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    struct stat st{};
    if (n.rfind(pre, 0) != 0 || ::lstat((dir + "/" + n).c_str(), &st) != 0) continue;
    if (check_owner(dir + "/" + n, st).ok() != foreign) out.push_back(n);
  }
  ::closedir(d);
  return out;
}
// A control inbox ring (sl.<uid>.ci.NAME, src/control/shm_transport.cpp) starts with
// {u32 magic, u32 version, u64 capacity, u32 owner_pid, u32, u64 owner_start}: its owner.
bool control_inbox_owner(const std::string& dir, const std::string& n, ProcId& owner) {
  if (n.rfind(user_prefix() + "ci.", 0) != 0) return false;
  auto s = Segment::open(dir, n, false, false, 32);
  if (!s.ok()) return false;
  uint32_t pid;
  uint64_t start;
  std::memcpy(&pid, s.value()->data() + 16, 4);
  std::memcpy(&start, s.value()->data() + 24, 8);
  owner = ProcId{pid, start};
  return true;
}
bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}
// Names end in ".<kind><pid>.<n>" (kinds a, x; q, o, m for message queues): the creating pid.
uint32_t pid_in_name(const std::string& n, std::string& kind) {
  auto dot = n.rfind('.');
  if (dot == std::string::npos || dot == 0) return 0;
  auto dot2 = n.rfind('.', dot - 1);
  if (dot2 == std::string::npos || dot2 + 2 > dot) return 0;
  switch (n[dot2 + 1]) {
    case 'a': kind = "arena"; break;
    case 'x': kind = "segment"; break;
    case 'q': kind = "mq ring"; break;          // message queue: named until every reader attached
    case 'o': kind = "mq overflow"; break;
    case 'm': kind = "mq message"; break;       // one large message, until every reader read it
    default: return 0;
  }
  return uint32_t(std::strtoul(n.c_str() + dot2 + 2, nullptr, 10));
}
}  // namespace

std::vector<ResourceInfo> list_resources(const std::string& shm_dir) {
  std::vector<ResourceInfo> out;
  const double now = double(now_ns()) / 1e9;
  std::set<std::string> listed;
  for (auto& n : our_files(shm_dir)) {
    if (!ends_with(n, ".dir")) continue;
    ResourceInfo r;
    r.name = n;
    r.kind = "directory";
    struct stat st{};
    if (::stat((shm_dir + "/" + n).c_str(), &st) == 0) {
      r.size = uint64_t(st.st_size);
      r.held = uint64_t(st.st_blocks) * 512;
      r.age_s = now - double(st.st_mtim.tv_sec);
    }
    auto d = Directory::open_admin(shm_dir, n);
    if (d.ok()) {
      auto& h = d.value()->header();
      r.attached = d.value()->attached_count();
      r.live_entries = d.value()->live_entries();
      r.age_s = now - double(h.created_ns) / 1e9;
      for (size_t i = 0; i < kMaxAttach; ++i)
        if (uint32_t pid = h.attached[i].pid.load(); pid && pid != shm::kSlotClaiming) {
          r.owner_pid = pid;
          r.owner_alive = r.owner_alive || proc_alive(ProcId{pid, h.attached[i].start.load()});
        }
      out.push_back(r);
      for (uint32_t i = 0; i < kMaxArenas; ++i) {
        ArenaRec& a = d.value()->arena(i);
        if (a.state.load() != 2) continue;
        ResourceInfo ar;
        ar.name = std::string(a.name, strnlen(a.name, sizeof a.name));
        ar.kind = a.dedicated ? "segment" : "arena";
        ar.owner_pid = a.owner_pid;
        ar.owner_alive = proc_alive(ProcId{a.owner_pid, a.owner_start});
        ar.size = a.size;
        if (struct stat ast{}; ::stat((shm_dir + "/" + ar.name).c_str(), &ast) == 0)
          ar.held = uint64_t(ast.st_blocks) * 512;
        ar.age_s = now - double(a.created_ns) / 1e9;
        listed.insert(ar.name);
        out.push_back(ar);
      }
    } else {
      r.kind = "directory (uninitialized)";
      out.push_back(r);
    }
    listed.insert(n);
  }
  for (auto& n : our_files(shm_dir)) {
    if (listed.count(n)) continue;
    ResourceInfo r;
    r.name = n;
    std::string kind = "orphan";
    if (ProcId o; control_inbox_owner(shm_dir, n, o)) {
      r.kind = "control inbox";
      r.owner_pid = o.pid;
      r.owner_alive = proc_alive(o);
    } else {
      r.owner_pid = pid_in_name(n, kind);
      r.kind = "orphan " + kind;
      r.owner_alive = r.owner_pid && proc_alive(ProcId{r.owner_pid, 0});
    }
    struct stat st{};
    if (::stat((shm_dir + "/" + n).c_str(), &st) == 0) {
      r.size = uint64_t(st.st_size);
      r.held = uint64_t(st.st_blocks) * 512;
      r.age_s = now - double(st.st_mtim.tv_sec);
    }
    out.push_back(r);
  }
  for (auto& n : our_files(shm_dir, true)) {
    ResourceInfo r;
    r.name = n;
    struct stat st{};
    if (::lstat((shm_dir + "/" + n).c_str(), &st) == 0) {
      r.kind = "squatted by uid " + std::to_string(st.st_uid) + " (refused)";
      r.size = uint64_t(st.st_size);
    }
    out.push_back(r);
  }
  return out;
}

namespace {
// Whether any process this user can see maps `path` (its /proc/PID/maps names it).
bool mapped_by_anyone(const std::string& path) {
  DIR* proc = ::opendir("/proc");
  if (!proc) return true;  // cannot tell: keep it
  bool found = false;
  std::string line;
  while (dirent* e = ::readdir(proc)) {
    if (found) break;
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    FILE* f = std::fopen(("/proc/" + std::string(e->d_name) + "/maps").c_str(), "r");
    if (!f) {
      // Gone, or another user's (which cannot map this user's 0600 file): look on. Anything
      // else (out of descriptors or memory) means this cannot tell: keep the file.
      if (errno == ENOENT || errno == ESRCH || errno == EACCES || errno == EPERM) continue;
      found = true;
      break;
    }
    char buf[4096];
    while (std::fgets(buf, sizeof buf, f))
      if (std::strstr(buf, path.c_str())) {
        found = true;
        break;
      }
    std::fclose(f);
  }
  ::closedir(proc);
  return found;
}

// The CUDA driver's file of a process that used CUDA IPC (cuda.shm.<uid>.<pid in hex>.<n>): it is
// removed when that process exits cleanly, and stays behind one that was killed (or left through
// os._exit, as multiprocessing's children do). Removed here when it is ours, its process is gone,
// and no process maps it.
std::vector<std::string> reap_cuda_driver_files(const std::string& shm_dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(shm_dir.c_str());
  if (!d) return out;
  const std::string pre = "cuda.shm." + std::to_string(::getuid()) + ".";
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d))
    if (std::strncmp(e->d_name, pre.c_str(), pre.size()) == 0) names.emplace_back(e->d_name);
  ::closedir(d);
  for (auto& n : names) {
    char* end = nullptr;
    const unsigned long pid = std::strtoul(n.c_str() + pre.size(), &end, 16);
    if (!pid || pid > 0x3fffffff || !end || *end != '.') continue;
    const std::string path = shm_dir + "/" + n;
    struct stat st{};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::getuid()) continue;
    if (proc_alive(ProcId{uint32_t(pid), 0}) || mapped_by_anyone(path)) continue;
    if (::unlink(path.c_str()) == 0) out.push_back("CUDA driver file " + n + " of dead process " + std::to_string(pid));
  }
  return out;
}
}  // namespace

std::vector<std::string> reap(const std::string& shm_dir) {
  std::vector<std::string> out;
  std::set<std::string> referenced;
  for (auto& n : our_files(shm_dir)) {
    if (!ends_with(n, ".dir")) continue;
    auto d = Directory::open_admin(shm_dir, n);
    if (!d.ok()) {
      // Never initialized (its creator died during set-up): remove once it is clearly stale.
      struct stat st{};
      if (::stat((shm_dir + "/" + n).c_str(), &st) == 0 && double(now_ns()) / 1e9 - double(st.st_mtim.tv_sec) > 10) {
        Segment::unlink(shm_dir, n);
        out.push_back("uninitialized directory " + n);
      }
      continue;
    }
    for (auto& r : d.value()->reap()) out.push_back(r);
    auto& h = d.value()->header();
    if ((h.attach_word.load() & kDying) && h.attach_word.load() == kDying) {
      // Everyone left (the last one died before unlinking): remove the directory and its arenas.
      for (uint32_t i = 0; i < kMaxArenas; ++i) {
        ArenaRec& a = d.value()->arena(i);
        if (a.state.load() == 2 && !proc_alive(ProcId{a.owner_pid, a.owner_start}))
          Segment::unlink(shm_dir, std::string(a.name, strnlen(a.name, sizeof a.name)));
      }
      if (Segment::unlink(shm_dir, n)) out.push_back("directory " + n + " with no live process");
      continue;
    }
    referenced.insert(n);
    for (uint32_t i = 0; i < kMaxArenas; ++i) {
      ArenaRec& a = d.value()->arena(i);
      if (a.state.load() == 2) referenced.insert(std::string(a.name, strnlen(a.name, sizeof a.name)));
    }
  }
  // Segments no directory lists whose creating process is gone.
  for (auto& n : our_files(shm_dir)) {
    if (referenced.count(n) || ends_with(n, ".dir")) continue;
    if (ProcId o; control_inbox_owner(shm_dir, n, o)) {
      if (o.pid && !proc_alive(o) && Segment::unlink(shm_dir, n))
        out.push_back("control inbox " + n + " of dead process " + std::to_string(o.pid));
      continue;
    }
    std::string kind;
    uint32_t pid = pid_in_name(n, kind);
    if (pid && !proc_alive(ProcId{pid, 0})) {
      if (Segment::unlink(shm_dir, n)) out.push_back("orphan " + kind + " " + n + " of dead process " + std::to_string(pid));
    }
  }
  for (auto& r : reap_cuda_driver_files(shm_dir)) out.push_back(std::move(r));
  return out;
}

}  // namespace stagelink::shm
