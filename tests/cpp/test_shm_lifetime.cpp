// The shared-memory connector's lifetime and trust: processes killed mid-put or mid-get, reapers,
// fork, a full /dev/shm, concurrent producers and consumers, names squatted by another user.
#include <gtest/gtest.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include <random>

#include "core/proc.hpp"
#include "shm/directory.hpp"
#include "shm_test_util.hpp"
#include "util.hpp"
#include "connectors/capabilities.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using namespace shm_test;
using testing_util::checksum;
using testing_util::wait_child;

// Producer killed with SIGKILL after putting (and a consumer killed while holding a view):
// another process reclaims both, automatically at attach and by reap().
TEST(Shm, KilledProducerAndConsumerAreReclaimed) {
  const std::string ns = unique_ns("kill");
  int p2c[2];
  ASSERT_EQ(pipe(p2c), 0);
  pid_t prod = fork();
  if (prod == 0) {
    auto c = create_connector("SharedMemoryConnector", extra(ns, 8u << 20));
    std::vector<std::byte> d(1 << 20);
    for (int i = 0; i < 4; ++i) (void)c.value()->put("0", "1", "k" + std::to_string(i), payload_of(d, 0));
    char x = 1;
    (void)!write(p2c[1], &x, 1);
    pause();
    _exit(0);
  }
  char x;
  ASSERT_EQ(read(p2c[0], &x, 1), 1);
  // A consumer claims a zero-copy view of k0 and is killed while holding it.
  int c2p[2];
  ASSERT_EQ(pipe(c2p), 0);
  pid_t cons = fork();
  if (cons == 0) {
    auto c = create_connector("SharedMemoryConnector", extra(ns));
    auto g = c.value()->get("0", "1", "k0", nullptr, deadline_after(5), GetOptions{true});
    char y = g.ok() ? 1 : 0;
    (void)!write(c2p[1], &y, 1);
    pause();
    _exit(0);
  }
  ASSERT_EQ(read(c2p[0], &x, 1), 1);
  EXPECT_EQ(x, 1);
  kill(cons, SIGKILL);
  kill(prod, SIGKILL);
  wait_child(cons);
  wait_child(prod);
  EXPECT_GE(files_with(ns), 2u);  // directory + the dead producer's arena
  auto removed = shm::reap();
  EXPECT_FALSE(removed.empty());
  EXPECT_EQ(files_with(ns), 0u);  // everyone attached is dead: directory gone too
  for (int fd : {p2c[0], p2c[1], c2p[0], c2p[1]}) close(fd);
}

// A consumer killed in the middle of a get (its claim taken, its copy not finished) loses
// nothing: its claim is given back, a retry by another consumer reads the payload intact, and
// only then is the producer's memory free. (It used to count as read: the payload was gone and a
// second consumer got nothing.) 186 MiB: a segment of its own, as the probe used.
TEST(Shm, ReaderKilledMidGetGivesItsReadBackAndARetryReadsIt) {
  const std::string ns = unique_ns("rdead");
  auto c = make(extra(ns, 1u << 20, 0.5));
  auto big = pattern(186u << 20, 11);
  const uint64_t sum = checksum(big);
  auto r = c->put("0", "1", "a", payload_of(big, sum));
  ASSERT_TRUE(r.ok()) << r.error().message;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    auto cc = create_connector("SharedMemoryConnector", extra(ns));
    auto g = cc.value()->get("0", "1", "a", &r->metadata, kNoWait, GetOptions{true});
    char y = g.ok();
    (void)!write(fds[1], &y, 1);
    pause();  // killed here: claimed, never released
    _exit(0);
  }
  char y;
  ASSERT_EQ(read(fds[0], &y, 1), 1);
  ASSERT_EQ(y, 1);
  kill(pid, SIGKILL);
  wait_child(pid);
  close(fds[0]);
  close(fds[1]);
  pid = fork();
  if (pid == 0) {  // the retry, in another process: the whole payload, intact
    auto cc = create_connector("SharedMemoryConnector", extra(ns));
    auto g = cc.value()->get("0", "1", "a", &r->metadata, kNoWait);
    _exit(g.ok() && checksum(g->payload.tensors[0].data) == sum ? 0 : 1);
  }
  EXPECT_EQ(wait_child(pid), 0) << "the retry did not read the payload intact";
  EXPECT_FALSE(c->get("0", "1", "a", &r->metadata, kNoWait).ok());  // read once, by the retry
  (void)shm::reap();
  std::vector<std::byte> d(700000);
  EXPECT_TRUE(c->put("0", "1", "b", payload_of(d, 0)).ok());  // the producer's memory came back
}

TEST(Shm, ConcurrentProducersAndConsumers) {
  const std::string ns = unique_ns("conc");
  constexpr int kProducers = 2, kConsumers = 2, kPer = 300;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProducers; ++p) {
    pid_t pid = fork();
    if (pid == 0) {
      auto c = create_connector("SharedMemoryConnector", extra(ns, 16u << 20));
      for (int i = 0; i < kPer; ++i) {
        auto d = pattern(100 + (i * 7919) % 200000, i);
        if (!c.value()->put("p" + std::to_string(p), "c", "m" + std::to_string(i), payload_of(d, checksum(d))).ok()) _exit(20);
      }
      // Wait until consumers drained everything, then close.
      auto done = c.value()->get("c", "p" + std::to_string(p), "done", nullptr, deadline_after(60));
      c.value()->close();
      _exit(done.ok() ? 0 : 21);
    }
    kids.push_back(pid);
  }
  for (int k = 0; k < kConsumers; ++k) {
    pid_t pid = fork();
    if (pid == 0) {
      auto c = create_connector("SharedMemoryConnector", extra(ns));
      // Consumer k reads producer k's messages in order, by key, blocking.
      for (int i = 0; i < kPer; ++i) {
        auto g = c.value()->get("p" + std::to_string(k), "c", "m" + std::to_string(i), nullptr, deadline_after(30));
        if (!g.ok()) _exit(30);
        uint64_t sum;
        g->payload.tree.find("sum")->get_u64(sum);
        if (checksum(g->payload.tensors[0].data) != sum) _exit(31);
      }
      (void)c.value()->put("c", "p" + std::to_string(k), "done", Payload{});
      // Stay until the producer picked up "done".
      for (int t = 0; t < 600 && c.value()->health().find("outstanding")->as<uint64_t>() > 0; ++t) {
        (void)c.value()->cleanup("nothing");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      c.value()->close();
      _exit(0);
    }
    kids.push_back(pid);
  }
  for (auto k : kids) EXPECT_EQ(wait_child(k), 0);
  (void)shm::reap();
  EXPECT_EQ(files_with(ns), 0u);
}

// A full /dev/shm: a 4 MiB tmpfs stands in for it (needs root to mount; skipped otherwise).
TEST(Shm, FullShmDirectoryIsExhaustedNotSigbus) {
  testing_util::SmallTmpfs fs;
  if (!fs.ok()) GTEST_SKIP() << "cannot mount a tmpfs here (not root)";
  const std::string& dir = fs.dir();
  {
    // A 16 MiB arena on a 4 MiB /dev/shm: puts go on while their bytes can be reserved, then
    // fail with exhausted; what was put before stays whole.
    auto c = create_connector("SharedMemoryConnector", extra(unique_ns("fullfs"), 16u << 20, 0.1, dir));
    ASSERT_TRUE(c.ok()) << c.error().message;
    std::vector<std::vector<std::byte>> put;
    Status failed;
    for (uint32_t i = 0; i < 8 && failed.ok(); ++i) {
      auto d = pattern(1u << 20, i);
      auto r = c.value()->put("0", "1", "k" + std::to_string(i), payload_of(d, checksum(d)));
      if (r.ok()) put.push_back(std::move(d));
      else failed = std::move(r).error();
    }
    ASSERT_FALSE(failed.ok()) << "8 MiB fit in a 4 MiB tmpfs";
    EXPECT_EQ(failed.error().code, Errc::exhausted);
    EXPECT_NE(failed.error().message.find("no space"), std::string::npos) << failed.error().message;
    EXPECT_GE(put.size(), 1u);
    for (size_t i = 0; i < put.size(); ++i) {
      auto g = c.value()->get("0", "1", "k" + std::to_string(i), nullptr);
      ASSERT_TRUE(g.ok()) << i;
      EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(put[i]));
    }
    // Preallocated, the same arena fails when the connector is made.
    Value e = extra(unique_ns("fullpre"), 16u << 20, 0.1, dir);
    e.as<Value::Map>().emplace_back("preallocate_arena", true);
    auto pre = create_connector("SharedMemoryConnector", e);
    ASSERT_FALSE(pre.ok());
    EXPECT_EQ(pre.error().code, Errc::exhausted);
  }
}

// Regressions (found reading the reaper after the ring's attach race on a 16-core machine): a
// reaper must judge a process by a pid and start time written together.
namespace {
pid_t dead_pid() {  // a pid that existed and is gone (reaped child)
  pid_t p = fork();
  if (p == 0) _exit(0);
  wait_child(p);
  return p;
}
}  // namespace

TEST(Shm, AReaperLeavesAPutWhoseOwnerIsStillSayingWhoItIs) {
  const std::string ns = unique_ns("own");
  auto d = shm::Directory::attach("/dev/shm", ns, 64).value();
  const std::string key = "k@0_1";
  auto cl = d->reserve(key, 1, "", shm::key_hash(key), mono_ns());
  ASSERT_TRUE(cl.ok());
  shm::Entry& e = d->entry(cl->idx);
  // The window between claiming the entry (WRITING) and writing its owner: the identity fields
  // still hold a previous owner's, here a dead process.
  e.owner_pid = uint32_t(dead_pid());
  e.owner_start = 0;
  e.owner_gen = cl->gen - 1;
  EXPECT_TRUE(d->reap().empty());  // before the fix: "entry 'k@0_1' of dead producer", a live put freed
  EXPECT_FALSE(d->is_released(cl->idx, cl->gen));
  EXPECT_TRUE(d->reap().empty());  // still within the grace period
  // A producer that died in that window: still silent a grace period later, the entry is freed,
  // and a publish that comes after all fails instead of writing over the free entry.
  std::this_thread::sleep_for(std::chrono::nanoseconds(shm::kUnownedGraceNs + 50'000'000));
  auto orphan = d->reap();
  ASSERT_EQ(orphan.size(), 1u);
  EXPECT_NE(orphan[0].find("died while claiming it"), std::string::npos);
  EXPECT_TRUE(d->is_released(cl->idx, cl->gen));
  EXPECT_FALSE(d->publish(*cl, 1));
  // Again, this time with the identity written: a dead owner's unfinished put is freed at once.
  cl = d->reserve(key, 1, "", shm::key_hash(key), mono_ns());
  ASSERT_TRUE(cl.ok());
  shm::Entry& e2 = d->entry(cl->idx);
  e2.owner_pid = uint32_t(dead_pid());
  e2.owner_start = 0;
  e2.owner_gen = cl->gen;
  auto reaped = d->reap();
  ASSERT_EQ(reaped.size(), 1u);
  EXPECT_NE(reaped[0].find("dead producer"), std::string::npos);
  EXPECT_TRUE(d->is_released(cl->idx, cl->gen));
}

// Regression (trust, second round): proc_alive() read any failure to open /proc/PID/stat as
// "dead", so a process that had run out of descriptors (EMFILE: a soft NOFILE of 1024 and a
// thousand half-open connections) reaped every live producer's entries and arenas.
namespace {
// Holds every descriptor this process may open (under a lowered soft limit) until destroyed.
struct OutOfDescriptors {
  rlimit old{};
  std::vector<int> fds;
  OutOfDescriptors() {
    getrlimit(RLIMIT_NOFILE, &old);
    rlimit low = old;
    low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 512);
    setrlimit(RLIMIT_NOFILE, &low);
    for (;;) {
      int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      fds.push_back(fd);
    }
  }
  ~OutOfDescriptors() {
    for (int fd : fds) ::close(fd);
    setrlimit(RLIMIT_NOFILE, &old);
  }
};
}  // namespace

TEST(Shm, AReaperOutOfDescriptorsTakesNoLiveProcessForDead) {
  const std::string ns = unique_ns("emfile");
  auto d = shm::Directory::attach("/dev/shm", ns, 64).value();
  const std::string key = "k@0_1";
  auto cl = d->reserve(key, 1, "", shm::key_hash(key), mono_ns());
  ASSERT_TRUE(cl.ok());
  shm::Entry& e = d->entry(cl->idx);
  const ProcId me = self_proc();
  ASSERT_NE(me.start, 0u);
  e.owner_pid = me.pid;  // a live producer, this process, with its start time known
  e.owner_start = me.start;
  e.owner_gen = cl->gen;
  ASSERT_TRUE(d->publish(*cl, 1));
  pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  const pid_t gone = dead_pid();
  std::vector<std::string> reaped;
  bool child_alive = false, self_alive = false, gone_alive = true;
  {
    OutOfDescriptors full;
    ASSERT_GT(full.fds.size(), 0u);
    ASSERT_LT(::open("/dev/null", O_RDONLY), 0);
    ASSERT_EQ(errno, EMFILE);
    child_alive = proc_alive(ProcId{uint32_t(child), 0});
    self_alive = proc_alive(me);
    gone_alive = proc_alive(ProcId{uint32_t(gone), 0});  // the kernel's ESRCH needs no descriptor
    reaped = d->reap();
  }
  kill(child, SIGKILL);
  wait_child(child);
  EXPECT_TRUE(child_alive);
  EXPECT_TRUE(self_alive);  // before the fix: false, and the reap below freed this live put
  EXPECT_FALSE(gone_alive);
  EXPECT_TRUE(reaped.empty()) << reaped.front();
  EXPECT_FALSE(d->is_released(cl->idx, cl->gen));
  // With descriptors again, the same reap still keeps it, and a dead owner is still reaped.
  EXPECT_TRUE(d->reap().empty());
  e.owner_pid = uint32_t(gone);
  e.owner_start = 0;
  auto r = d->reap();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NE(r[0].find("dead producer"), std::string::npos);
}

TEST(Shm, AReaperLeavesAnAttachSlotBeingClaimed) {
  const std::string ns = unique_ns("att");
  auto d = shm::Directory::attach("/dev/shm", ns, 64).value();
  auto& slot = d->header().attached[shm::kMaxAttach - 1];
  // A slot mid-claim: its pid word says so, its start is a previous occupant's.
  slot.start.store(12345);
  slot.pid.store(shm::kSlotClaiming);
  const uint32_t before = d->attached_count();
  EXPECT_TRUE(d->reap().empty());  // before the fix: a new pid read with an old start was "dead"
  EXPECT_EQ(slot.pid.load(), shm::kSlotClaiming);
  EXPECT_EQ(d->attached_count(), before);
  slot.pid.store(0);
  // A second attachment in this process claims a slot the same way and is counted as alive.
  pid_t pid = fork();
  if (pid == 0) {
    auto d2 = shm::Directory::attach("/dev/shm", ns, 64);
    const bool ok = d2.ok() && d2.value()->reap().empty();
    d2 = make_error(Errc::closed, "");  // detach before _exit
    _exit(ok ? 0 : 1);
  }
  EXPECT_EQ(wait_child(pid), 0);
}

// A connector made before fork() and used in the child: the child's puts must not land in the
// parent's arena through the child's copy of its allocator (regression: the parent's next put
// took the same range and overwrote the child's unread payload), the child's close must not free
// the parent's puts or arena, and a loan taken before the fork is the parent's memory.
TEST(Shm, AConnectorInheritedThroughForkIsTheChildsOwnAndLeavesTheParentsAlone) {
  const std::string ns = unique_ns("fork");
  auto c = make(extra(ns, 4u << 20));
  auto r = make(extra(ns, 1u << 20));
  ASSERT_TRUE(c && r);
  const size_t n = 256u << 10;  // above the inline threshold: in the arena
  auto d1 = pattern(n, 1), dc = pattern(n, 2), d2 = pattern(n, 3);
  ASSERT_TRUE(c->put("0", "1", "p1", payload_of(d1, checksum(d1))).ok());
  TensorSpec spec;
  spec.dtype = DType::u8;
  spec.shape = {int64_t(n)};
  spec.nbytes = n;
  auto loan = c->capability<Lending>()->loan(Value(TensorRef{0}), std::span<const TensorSpec>(&spec, 1));
  ASSERT_TRUE(loan.ok()) << loan.error().message;
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  pid_t pid = fork();
  if (pid == 0) {
    char b = 0;
    if (!c->put("0", "1", "c1", payload_of(dc, checksum(dc))).ok()) _exit(10);
    if (write(to_parent[1], "x", 1) != 1 || read(to_child[0], &b, 1) != 1) _exit(11);  // parent reads c1
    auto lp = c->capability<Lending>()->put_loan("0", "1", "fromloan", std::move(loan.value()), {});
    if (lp.ok() || lp.error().code != Errc::invalid_argument) _exit(12);
    c->close();  // frees the child's own arena, nothing of the parent's
    r->close();
    _exit(0);
  }
  char b = 0;
  ASSERT_EQ(read(to_parent[0], &b, 1), 1);
  // The parent's allocator does not know the child's put: with the bug this took c1's range.
  ASSERT_TRUE(c->put("0", "1", "p2", payload_of(d2, checksum(d2))).ok());
  auto g = r->get("0", "1", "c1", nullptr, deadline_after(5), {});
  ASSERT_TRUE(g.ok()) << g.error().message;
  ASSERT_EQ(g->payload.tensors.size(), 1u);
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(dc)) << "the child's put was overwritten";
  g = Result<GetResult>(make_error(Errc::io, ""));  // drop the view before the child frees its arena
  ASSERT_EQ(write(to_child[1], "x", 1), 1);
  EXPECT_EQ(wait_child(pid), 0);
  for (auto [key, data] : {std::pair{"p1", &d1}, std::pair{"p2", &d2}}) {
    auto gp = r->get("0", "1", key, nullptr, deadline_after(5), {});
    ASSERT_TRUE(gp.ok()) << key << ": " << gp.error().message;
    EXPECT_EQ(checksum(gp->payload.tensors[0].data), checksum(*data)) << key;
  }
  ASSERT_TRUE(c->capability<Lending>()->put_loan("0", "1", "fromloan", std::move(loan.value()), {}).ok());  // still ours here
  auto gl = r->get("0", "1", "fromloan", nullptr, deadline_after(5), {});
  EXPECT_TRUE(gl.ok()) << gl.error().message;
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) close(fd);
  c->close();
  r->close();
  EXPECT_EQ(files_with(ns), 0u);
}

// An arena record is shared memory any local process can write: a get maps only arenas named in
// its own namespace. The check now runs after the lookup of arenas already mapped (it used to
// run, with a getuid() system call, on every get): a record never mapped is still checked.
TEST(Shm, AnArenaRecordNamingASegmentOutsideTheNamespaceIsCorrupt) {
  const std::string ns = unique_ns("arn");
  auto d = shm::Directory::attach("/dev/shm", ns, 64).value();
  const uint32_t idx = shm::kMaxArenas - 1;
  shm::ArenaRec& a = d->arena(idx);
  ASSERT_EQ(a.state.load(), 0u);
  a.gen.store(7);
  a.dedicated = 0;
  a.size = 4096;
  for (const std::string forged : {shm::user_prefix() + "another.a1.0", std::string("sl.0.x.a1"),
                                   d->prefix() + "../../etc/passwd"}) {
    std::snprintf(a.name, sizeof a.name, "%s", forged.c_str());
    a.state.store(2);
    auto m = d->map_arena(idx, 7);
    ASSERT_FALSE(m.ok()) << forged;
    EXPECT_EQ(m.error().code, Errc::corrupt) << forged;
    EXPECT_NE(m.error().message.find("outside this namespace"), std::string::npos) << m.error().message;
  }
  a.state.store(0);
  a.name[0] = '\0';
  EXPECT_EQ(d->map_arena(idx, 7).error().code, Errc::not_found);
}

// /dev/shm is world-writable: another user may create a file under our names first (an empty
// directory file to stop every connector of ours, a forged arena holding their bytes). Such a file
// is never mapped: open refuses it (not ours, or readable by others), the connector's directory
// moves to an alternate name, and the squatter's file is left as it was.
TEST(Shm, SquattedNamesOfAnotherUserAreRefusedAndTheConnectorStillWorks) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as a second user";
  const std::string ns = unique_ns("squat");
  const std::string pre = shm::user_prefix() + ns + ".";
  const std::string squat_dir = pre + "dir", squat_seg = pre + "a1.0";
  pid_t pid = fork();
  if (pid == 0) {  // the other user
    if (::setgid(54321) != 0 || ::setuid(54321) != 0) _exit(2);
    for (const auto& n : {squat_dir, squat_seg}) {
      int fd = ::open(("/dev/shm/" + n).c_str(), O_RDWR | O_CREAT | O_EXCL, 0666);
      if (fd < 0 || ::fchmod(fd, 0666) != 0) _exit(3);
      if (n == squat_seg && ::write(fd, "forged payload bytes of another user", 36) != 36) _exit(4);
      ::close(fd);
    }
    _exit(0);
  }
  ASSERT_EQ(wait_child(pid), 0);
  auto forged = shm::Segment::open("/dev/shm", squat_seg, false, false);
  ASSERT_FALSE(forged.ok()) << "mapped another user's file";
  EXPECT_EQ(forged.error().code, Errc::permission_denied);
  EXPECT_NE(forged.error().message.find("uid 54321"), std::string::npos) << forged.error().message;
  EXPECT_NE(forged.error().message.find(squat_seg), std::string::npos) << forged.error().message;
  {
    auto c = make(extra(ns, 4u << 20));
    ASSERT_TRUE(c);
    auto d = pattern(4096, 7);
    auto put = c->put("0", "1", "k", payload_of(d, checksum(d)));
    ASSERT_TRUE(put.ok()) << put.error().message;
    auto g = c->get("0", "1", "k", nullptr);
    ASSERT_TRUE(g.ok()) << g.error().message;
    EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
    EXPECT_EQ(files_with(ns + "~1.dir"), 1u) << "the directory did not move to its alternate name";
  }
  struct stat st{};
  ASSERT_EQ(::stat(("/dev/shm/" + squat_dir).c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0) << "the squatter's file was written";
  EXPECT_EQ(st.st_uid, 54321u);
  // One of our own files that others may read is refused too.
  const std::string loose = pre + "loose";
  int fd = ::open(("/dev/shm/" + loose).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 64), 0);
  ASSERT_EQ(::fchmod(fd, 0644), 0);
  ::close(fd);
  auto l = shm::Segment::open("/dev/shm", loose, false, false);
  EXPECT_FALSE(l.ok());
  if (!l.ok()) EXPECT_EQ(l.error().code, Errc::permission_denied);
  for (const auto& n : {squat_dir, squat_seg, loose}) ::unlink(("/dev/shm/" + n).c_str());
  EXPECT_EQ(files_with(ns), 0u);
}
