// The shared-memory control transport (shm://): many producers, one inbox, across processes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <set>
#include <thread>

#include "stagelink/control.hpp"
#include "stagelink/shm.hpp"
#include "util.hpp"

using namespace stagelink;
using testing_util::wait_child;

namespace {
std::string unique_ep(const char* tag) {
  static int n = 0;
  return std::string("shm://t") + tag + std::to_string(getpid()) + "-" + std::to_string(n++);
}
bool inbox_file_exists(const std::string& ep) {
  return access(("/dev/shm/" + shm::user_prefix() + "ci." + ep.substr(6)).c_str(), F_OK) == 0;
}
ControlMessage numbered(uint32_t producer, uint64_t i, size_t body) {
  ControlMessage m;
  m.type = ControlType::data_ready;
  m.request_id = "p" + std::to_string(producer);
  m.chunk_id = i;
  m.body.assign(body, std::byte(uint8_t(i * 7 + producer)));
  return m;
}
}  // namespace

// Three producer processes, messages of 1 B to 200 KiB body (the 4 MiB ring wraps many times):
// every message arrives intact, each producer's in its order.
TEST(ControlShm, ManyProducersAcrossProcessesInOrderThroughWrapAround) {
  const std::string ep = unique_ep("mp");
  auto in = ControlInbox::bind(ep);
  ASSERT_TRUE(in.ok()) << in.error().message;
  constexpr uint32_t kProducers = 3;
  constexpr uint64_t kEach = 400;
  std::vector<pid_t> kids;
  for (uint32_t p = 0; p < kProducers; ++p) {
    pid_t pid = fork();
    if (pid == 0) {
      auto out = ControlOutbox::connect(ep);
      if (!out.ok()) _exit(2);
      std::mt19937 rng(p);
      for (uint64_t i = 0; i < kEach; ++i) {
        const size_t body = (rng() % 8 == 0) ? rng() % (200 << 10) : rng() % 300;
        if (!out.value()->send(numbered(p, i, body), 10).ok()) _exit(3);
      }
      _exit(0);
    }
    kids.push_back(pid);
  }
  std::vector<uint64_t> next(kProducers, 0);
  for (uint64_t got = 0; got < kProducers * kEach; ++got) {
    auto m = in.value()->recv(10);
    ASSERT_TRUE(m.ok()) << m.error().message;
    const uint32_t p = uint32_t(std::stoul(m->request_id.substr(1)));
    ASSERT_LT(p, kProducers);
    ASSERT_EQ(m->chunk_id.value(), next[p]) << "producer " << p << " out of order";
    for (auto b : m->body) ASSERT_EQ(b, std::byte(uint8_t(next[p] * 7 + p)));
    ++next[p];
  }
  for (pid_t k : kids) EXPECT_EQ(wait_child(k), 0);
  in.value()->close();
  EXPECT_FALSE(inbox_file_exists(ep));
}

TEST(ControlShm, DeadlinesCloseAndMalformedInput) {
  const std::string ep = unique_ep("dl");
  auto in = ControlInbox::bind(ep);
  ASSERT_TRUE(in.ok());
  EXPECT_EQ(ControlInbox::bind(ep).error().code, Errc::exists);  // one inbox per name
  auto t0 = std::chrono::steady_clock::now();
  auto r = in.value()->recv(0.2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::timeout);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(190));
  auto out = ControlOutbox::connect(ep);
  ASSERT_TRUE(out.ok());
  const std::byte junk[] = {std::byte{0xc1}, std::byte{0x00}, std::byte{0xff}};
  ASSERT_TRUE(out.value()->send_bytes(junk, 1).ok());
  ASSERT_TRUE(out.value()->send(numbered(0, 1, 10), 1).ok());
  auto bad = in.value()->recv(1);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Errc::corrupt);
  auto good = in.value()->recv(1);  // the inbox goes on
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->chunk_id.value(), 1u);
  // A full ring: the sender waits, then times out, naming the inbox.
  Status st;
  int sent = 0;
  while ((st = out.value()->send(numbered(0, 2, 100 << 10), 0.2)).ok()) ++sent;
  EXPECT_EQ(st.error().code, Errc::timeout);
  EXPECT_NE(st.error().message.find(ep), std::string::npos);
  EXPECT_GT(sent, 10);
  // close() wakes a recv blocked in another thread.
  auto in2 = ControlInbox::bind(unique_ep("cl"));
  ASSERT_TRUE(in2.ok());
  Result<ControlMessage> blocked = make_error(Errc::io, "");
  std::thread th([&] { blocked = in2.value()->recv(30); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  in2.value()->close();
  th.join();
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.error().code, Errc::closed);
  in.value()->close();
  EXPECT_EQ(out.value()->send(numbered(0, 3, 1), 0.2).error().code, Errc::closed);
}

TEST(ControlShm, OutboxWaitsForAnInboxBoundLater) {
  const std::string ep = unique_ep("late");
  auto out = ControlOutbox::connect(ep);
  ASSERT_TRUE(out.ok());
  std::unique_ptr<ControlInbox> in;
  std::thread binder([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    in = ControlInbox::bind(ep).value();
  });
  ASSERT_TRUE(out.value()->send(numbered(0, 5, 1), 5).ok());
  binder.join();
  auto m = in->recv(1);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->chunk_id.value(), 5u);
  auto nobody = ControlOutbox::connect(unique_ep("none")).value();
  EXPECT_EQ(nobody->send(numbered(0, 1, 1), 0.1).error().code, Errc::timeout);
}

TEST(ControlShm, AnInboxOfADeadProcessIsReaped) {
  // Other tests running beside this one (ctest -j) sweep /dev/shm with shm::reap() too and may
  // remove the dead inbox first: then it is made again (a few tries), so that this test sees it
  // listed and reaps it itself.
  bool listed = false, vanished = false;
  std::string ep;
  for (int attempt = 0; attempt < 5 && !listed; ++attempt) {
    ep = unique_ep("dead");
    pid_t pid = fork();
    if (pid == 0) {
      auto in = ControlInbox::bind(ep);
      if (!in.ok()) _exit(2);
      (void)in.value().release();  // never closed: the process dies holding it
      _exit(0);
    }
    ASSERT_EQ(wait_child(pid), 0);  // 0: the child bound the inbox
    if (!inbox_file_exists(ep)) continue;  // already reaped by a test beside this one: make another
    for (auto& r : shm::list_resources("/dev/shm"))
      if (r.name.find(ep.substr(6)) != std::string::npos) listed = r.kind == "control inbox" && !r.owner_alive;
    vanished = !inbox_file_exists(ep);  // reaped by another test meanwhile
    if (!listed && !vanished) break;  // there and not listed as a dead inbox: a real failure
  }
  EXPECT_TRUE(listed);
  shm::reap("/dev/shm");
  EXPECT_FALSE(inbox_file_exists(ep));
}
