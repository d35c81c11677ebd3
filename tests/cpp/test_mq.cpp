// MessageQueue: the ring under threads (also run under ThreadSanitizer), and real processes:
// local readers (fork), a remote reader over TCP, overflow, shutdown, timeouts, killed readers.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "core/net.hpp"
#include "shm/ring.hpp"
#include "util.hpp"
#include "stagelink/mq.hpp"
#include "stagelink/shm.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::wait_child;
using Clock = std::chrono::steady_clock;

namespace {
// Message i: deterministic size and bytes, so every reader can check it independently.
std::vector<std::byte> message(uint64_t i, size_t max_size) {
  std::mt19937_64 g(i * 7919 + 1);
  const size_t n = (i % 97 == 0) ? 0 : size_t(g() % (max_size + 1));
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(g());
  return v;
}
// Message-queue segments of process `pid` (names "sl.<uid>.mq.<kind><pid>.<n>..."): tests run in
// parallel, so count only our own.
size_t mq_files(pid_t pid = getpid()) {
  size_t n = 0;
  const std::string pre = shm::user_prefix() + "mq.";
  DIR* d = opendir("/dev/shm");
  while (dirent* e = readdir(d)) {
    std::string s = e->d_name;
    if (s.rfind(pre, 0) != 0 || s.size() < pre.size() + 2) continue;
    n += std::strtoul(s.c_str() + pre.size() + 1, nullptr, 10) == unsigned(pid);
  }
  closedir(d);
  return n;
}
size_t occurrences(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t pos = 0; (pos = s.find(what, pos)) != std::string::npos; ++pos) ++n;
  return n;
}
void jitter(std::mt19937& g) {
  if (g() % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(g() % 300));
}
// A reader process body: dequeue n messages, check order and bytes. Exit code 0 = all good.
int read_all(const MessageQueueHandle& h, uint32_t rank, uint64_t n, size_t max_size, bool slow) {
  auto q = MessageQueue::create_from_handle(h, rank);
  if (!q.ok()) { fprintf(stderr, "attach %u: %s\n", rank, q.error().message.c_str()); return 2; }
  std::mt19937 g(rank + 100);
  for (uint64_t i = 0; i < n; ++i) {
    auto m = (*q)->dequeue(30.0);
    if (!m.ok()) { fprintf(stderr, "rank %u msg %lu: %s\n", rank, (unsigned long)i, m.error().message.c_str()); return 3; }
    auto want = message(i, max_size);
    if (m->seq != i || m->payload.tensors.size() != 1 || checksum(m->payload.tensors[0].data) != checksum(want) ||
        m->payload.tensors[0].nbytes() != want.size()) {
      fprintf(stderr, "rank %u msg %lu: wrong message (seq %lu)\n", rank, (unsigned long)i, (unsigned long)m->seq);
      return 4;
    }
    if (slow || rank % 2) jitter(g);
  }
  return 0;
}
// A writer with two local readers (ranks 0 and 1) in this process.
struct Trio {
  std::unique_ptr<MessageQueue> w, r0, r1;
  explicit Trio(MessageQueueOptions o) {
    o.n_reader = o.n_local_reader = 2;
    auto wr = MessageQueue::create(o);
    EXPECT_TRUE(wr.ok()) << (wr.ok() ? "" : wr.error().message);
    if (!wr.ok()) return;
    w = std::move(wr).value();
    auto a = MessageQueue::create_from_handle(w->export_handle(), 0);
    auto b = MessageQueue::create_from_handle(w->export_handle(), 1);
    EXPECT_TRUE(a.ok() && b.ok());
    if (a.ok()) r0 = std::move(a).value();
    if (b.ok()) r1 = std::move(b).value();
  }
};
// Rings made by the tests are named as the queue names its own (".q<pid>.<n>"): if the process
// dies mid-test (a crashed sanitizer run), `stagelink shm reap` and the library's sweep reclaim them.
std::string test_ring_name(int n) { return shm::user_prefix() + "mq.q" + std::to_string(getpid()) + "." + std::to_string(n); }
shm::RingOptions ring_options(uint32_t readers, uint32_t chunks, uint64_t chunk_bytes) {
  shm::RingOptions o;
  o.n_readers = readers;
  o.max_chunks = chunks;
  o.chunk_bytes = chunk_bytes;
  return o;
}
MessageQueueOptions small(size_t chunk, uint32_t chunks) {
  MessageQueueOptions o;
  o.max_chunk_bytes = chunk;
  o.max_chunks = chunks;
  return o;
}
// A queue of one-message chunk whose rank 1 never reads, and a writer whose next enqueue blocks.
struct BlockedWriter {
  Trio t;
  explicit BlockedWriter(double warn_interval_s) : t([&] {
    auto o = small(256, 1);
    o.warn_interval_s = warn_interval_s;
    return o;
  }()) {
    std::byte b[8]{};
    EXPECT_TRUE(t.r1 && t.w->enqueue_bytes(b, 1).ok());
    EXPECT_TRUE(t.r0->dequeue(1).ok());  // rank 1 never reads
  }
};
}  // namespace

// The ring's protocol with threads: 1 writer, 3 readers, random sizes and delays. Under
// -DSTAGELINK_TSAN=ON this is the ThreadSanitizer check of the memory orders.
// Regression (seen on a 16-core machine): a reader took its slot before writing its pid, and a
// writer that looked in between judged "pid 0" dead and failed the enqueue with peer_dead. A
// reader caught mid-attach is not dead: the writer waits for it (timeout), then it attaches and
// reads.
TEST(Ring, AReaderCaughtMidAttachIsNotDead) {
  const std::string name = test_ring_name(2);
  const shm::RingOptions o = ring_options(1, 1, 64);
  auto w = shm::Ring::create("/dev/shm", name, o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  auto c = (*w)->acquire_write(mono_ns() + 1'000'000'000ull, false, 0, nullptr);
  ASSERT_TRUE(c.ok());
  (*w)->publish(*c, 8, shm::kInline, 0);
  // The slot as a reader leaves it between taking it and writing who it is.
  shm::RingReader& slot = (*w)->header().readers[0];
  slot.state.store(shm::kReaderAttaching);
  const uint64_t t0 = mono_ns();
  auto blocked = (*w)->acquire_write(mono_ns() + 300'000'000ull, false, 0, nullptr);
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.error().code, Errc::timeout) << blocked.error().message;
  EXPECT_GE(mono_ns() - t0, 290'000'000ull);
  EXPECT_EQ(shm::Ring::attach("/dev/shm", name, 0, o).error().code, Errc::exists);  // taken
  slot.state.store(shm::kReaderAbsent);  // let a real reader attach and read
  auto rd = shm::Ring::attach("/dev/shm", name, 0, o);
  ASSERT_TRUE(rd.ok()) << rd.error().message;
  EXPECT_EQ(slot.state.load(), shm::kReaderAttached);
  EXPECT_EQ(slot.pid.load(), uint32_t(getpid()));
  auto m = (*rd)->acquire_read(mono_ns() + 1'000'000'000ull);
  ASSERT_TRUE(m.ok());
  (*rd)->release_read(*m);
  EXPECT_TRUE((*w)->acquire_write(mono_ns() + 1'000'000'000ull, false, 0, nullptr).ok());
  shm::Segment::unlink("/dev/shm", name);
}

TEST(Ring, ThreadsSeeEveryMessageInOrderIntact) {
  const std::string name = test_ring_name(1);
  shm::RingOptions o = ring_options(3, 4, 256);
  o.spin_ns = 2000;
  auto w = shm::Ring::create("/dev/shm", name, o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  constexpr uint64_t kN = 5000;
  std::vector<std::thread> readers;
  std::atomic<int> bad{0};
  for (uint32_t r = 0; r < 3; ++r) {
    readers.emplace_back([&, r] {
      auto rd = shm::Ring::attach("/dev/shm", name, r, o);
      if (!rd.ok()) { bad++; return; }
      std::mt19937 g(r);
      for (uint64_t i = 0; i < kN; ++i) {
        auto c = (*rd)->acquire_read(mono_ns() + 20'000'000'000ull);
        if (!c.ok()) { bad++; return; }
        auto want = message(i, 248);
        if ((*c)->len != want.size() + 8 || std::memcmp((*rd)->data(*c), &i, 8) != 0 ||
            (!want.empty() && std::memcmp((*rd)->data(*c) + 8, want.data(), want.size()) != 0))
          bad++;
        (*rd)->release_read(*c);
        jitter(g);
      }
    });
  }
  std::mt19937 g(99);
  for (uint64_t i = 0; i < kN; ++i) {
    auto c = (*w)->acquire_write(mono_ns() + 20'000'000'000ull, false, 0, nullptr);
    ASSERT_TRUE(c.ok()) << c.error().message;
    auto m = message(i, 248);
    std::memcpy((*w)->data(*c), &i, 8);
    if (!m.empty()) std::memcpy((*w)->data(*c) + 8, m.data(), m.size());
    (*w)->publish(*c, m.size() + 8, shm::kInline, 0);
    jitter(g);
  }
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  shm::Segment::unlink("/dev/shm", name);
}

// 1 to 8 local readers in processes, plus one remote reader over TCP; 10,000 messages of random
// sizes from 0 B to 3x the chunk (overflow), random delays on both sides.
class MqFanOut : public ::testing::TestWithParam<uint32_t> {};
TEST_P(MqFanOut, EveryReaderGetsEveryMessageOnceInOrderIntact) {
  const uint32_t n_local = GetParam();
  const size_t before = mq_files();
  MessageQueueOptions o;
  o.n_reader = n_local + 1;
  o.n_local_reader = n_local;
  o.connect_ip = "127.0.0.1";  // tests stay on loopback
  o.max_chunk_bytes = 4096;
  o.max_chunks = 8;
  o.overflow_bytes = 64 << 10;
  o.spin_us = 20;
  constexpr uint64_t kN = 10000;
  const size_t max_size = 3 * 4096;
  // The readers are forked before the writer starts its threads (testing_util::EarlyChild); they
  // get the queue's handle through a pipe once it exists.
  std::vector<std::unique_ptr<testing_util::EarlyChild>> kids;
  for (uint32_t r = 0; r <= n_local; ++r) {
    kids.push_back(std::make_unique<testing_util::EarlyChild>([r, max_size](std::span<const std::byte> b) {
      auto h = MessageQueueHandle::from_msgpack(b);
      return h.ok() ? read_all(*h, r, kN, max_size, false) : 6;
    }));
    ASSERT_TRUE(kids.back()->ok());
  }
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  const auto hb = (*w)->export_handle().to_msgpack();
  for (auto& k : kids) ASSERT_TRUE(k->send(hb));
  ASSERT_OK((*w)->wait_until_ready(30));
  EXPECT_EQ(mq_files(), before) << "the ring's names are unlinked once everyone attached";
  std::mt19937 g(7);
  for (uint64_t i = 0; i < kN; ++i) {
    auto m = message(i, max_size);
    auto st = (*w)->enqueue_bytes(m, 30.0);
    ASSERT_TRUE(st.ok()) << i << ": " << st.error().message;
    jitter(g);
  }
  for (auto& k : kids) EXPECT_EQ(k->wait(), 0);
  auto s = (*w)->stats();
  EXPECT_GT(s.find("overflow_messages")->as<uint64_t>(), 0u);
  w->reset();
  EXPECT_EQ(mq_files(), before);
}
INSTANTIATE_TEST_SUITE_P(Readers, MqFanOut, ::testing::Values(1u, 4u, 8u));

// The writer keeps its frame plan from one message to the next: messages of one size whose
// layout differs (dtype, shape, the tree, ext) must each be planned again, never sent with the
// last one's header. Every reader sees each message as it was enqueued.
TEST(Mq, MessagesOfOneSizeButAnotherLayoutKeepTheirOwn) {
  Trio t(small(4096, 4));
  ASSERT_TRUE(t.w && t.r0 && t.r1);
  const auto bytes = testing_util::pattern(64, 1);
  auto tensor = [&](DType dt, std::vector<int64_t> shape) {
    Payload p;
    p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(bytes), dt, std::move(shape)));
    p.tree = Value(TensorRef{0});
    return p;
  };
  std::vector<Payload> msgs;
  msgs.push_back(tensor(DType::u8, {64}));
  msgs.push_back(tensor(DType::f32, {16}));
  msgs.push_back(tensor(DType::f32, {4, 4}));
  msgs.push_back(tensor(DType::f32, {4, 4}));  // the same layout again: the kept plan
  msgs.push_back(tensor(DType::i16, {32}));
  Payload with_ext = tensor(DType::i16, {32});
  with_ext.ext = Value(Value::Map{{"k", Value(int64_t(7))}});
  msgs.push_back(std::move(with_ext));
  msgs.push_back(tensor(DType::i16, {32}));  // and without it again
  Payload tree = tensor(DType::u8, {64});
  tree.tree = Value(Value::List{Value(TensorRef{0}), Value("x")});
  msgs.push_back(std::move(tree));
  msgs.push_back(tensor(DType::u8, {64}));
  for (int round = 0; round < 3; ++round) {
    for (const auto& m : msgs) {
      ASSERT_TRUE(t.w->enqueue(m, 5).ok());
      for (auto* r : {t.r0.get(), t.r1.get()}) {
        auto got = r->dequeue(5);
        ASSERT_TRUE(got.ok()) << got.error().message;
        const Tensor& x = got->payload.tensors.at(0);
        EXPECT_EQ(x.dtype, m.tensors[0].dtype);
        EXPECT_EQ(x.shape, m.tensors[0].shape);
        EXPECT_EQ(checksum(x.data), checksum(bytes));
        EXPECT_EQ(got->payload.tree.is<TensorRef>(), m.tree.is<TensorRef>());
        EXPECT_EQ(got->payload.ext.is_nil(), m.ext.is_nil());
      }
    }
  }
}

// enqueue_held (CUDA tensors left on their GPU, vLLM's tensor arena): the writer keeps a message's
// device slots until every reader has read it, and offers it only where every reader is local.
TEST(Mq, AHeldMessageKeepsItsDeviceSlotsUntilEveryReaderReadIt) {
  Trio t(small(4096, 4));
  ASSERT_TRUE(t.w && t.r0 && t.r1);
  EXPECT_EQ(t.w->device_slots(), size_t(256) << 20);
  EXPECT_EQ(t.r0->device_slots(), 0u);
  std::byte b[8]{};
  Payload p;
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(b, 8)));
  p.tree = Value(TensorRef{0});
  auto hold = std::make_shared<int>(1);
  std::weak_ptr<int> watch = hold;
  ASSERT_TRUE(t.w->enqueue_held(p, 1, std::move(hold)).ok());
  ASSERT_TRUE(t.r0->dequeue(1).ok());
  ASSERT_TRUE(t.w->enqueue_bytes(b, 1).ok());  // the writer reclaims at each enqueue
  EXPECT_FALSE(watch.expired()) << "dropped before every reader read it";
  ASSERT_TRUE(t.r1->dequeue(1).ok());
  ASSERT_TRUE(t.w->enqueue_bytes(b, 1).ok());
  EXPECT_TRUE(watch.expired()) << "kept after every reader read it";
  EXPECT_EQ(t.r0->enqueue_held(p, 1, std::make_shared<int>(2)).error().code, Errc::invalid_argument);
}

TEST(Mq, MessageLargerThanOverflowGetsOwnSegmentFreedWhenRead) {
  const size_t before = mq_files();
  auto o = small(1024, 2);
  o.overflow_bytes = 4096;
  Trio t(o);
  ASSERT_TRUE(t.r1);
  auto& w = t.w;
  auto& r0 = t.r0;
  auto& r1 = t.r1;
  ASSERT_OK(w->wait_until_ready(1));
  std::vector<std::byte> big(1 << 20, std::byte{5});
  ASSERT_TRUE(w->enqueue_bytes(big, 1).ok());
  EXPECT_EQ(mq_files(), before + 1);  // the message's own segment
  for (auto* r : {&r0, &r1}) {
    auto m = (*r)->dequeue(1);
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ(checksum(m->payload.tensors[0].data), checksum(big));
  }
  ASSERT_TRUE(w->enqueue_bytes(big, 1).ok());  // reclaims the first one's segment
  EXPECT_EQ(mq_files(), before + 1);
  for (auto* r : {&r0, &r1}) ASSERT_TRUE((*r)->dequeue(1).ok());
  r0.reset();
  r1.reset();
  w.reset();
  EXPECT_EQ(mq_files(), before);
}

TEST(Mq, TimeoutsNameTheReadersBehind) {
  Trio t(small(256, 2));
  ASSERT_TRUE(t.r1);
  auto& w = t.w;
  auto& r0 = t.r0;
  auto t0 = Clock::now();
  auto none = r0->dequeue(0.1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, Errc::timeout);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(90));
  std::byte b[8]{};
  ASSERT_TRUE(w->enqueue_bytes(b, 1).ok());
  ASSERT_TRUE(w->enqueue_bytes(b, 1).ok());
  ASSERT_TRUE(r0->dequeue(1).ok());  // rank 0 reads one; rank 1 reads none
  auto full = w->enqueue_bytes(b, 0.1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, Errc::timeout);
  EXPECT_NE(full.error().message.find("rank 1 (pid"), std::string::npos) << full.error().message;
  EXPECT_EQ(full.error().message.find("rank 0"), std::string::npos) << full.error().message;
}

TEST(Mq, BlockedWriterWarnsNamingTheReaderAtTheInterval) {
  BlockedWriter bw(0.1);
  std::byte b[8]{};
  ::testing::internal::CaptureStderr();
  auto st = bw.t.w->enqueue_bytes(b, 0.35);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(st.ok());
  const size_t warnings = occurrences(err, "blocked for");
  EXPECT_GE(warnings, 2u) << err;
  EXPECT_LE(warnings, 4u) << err;
  EXPECT_NE(err.find("waiting for rank 1 (pid"), std::string::npos) << err;
}

// Python waits in slices (so signal handlers run between them): a writer blocked on the same
// message across back-to-back calls keeps one clock, so its warnings still come at the interval
// and its timeout says how long the message has waited in all; after a pause the clock restarts.
TEST(Mq, ABlockedWriterWaitingInSlicesKeepsOneClock) {
  BlockedWriter bw(0.3);
  auto& w = bw.t.w;
  std::byte b[8]{};
  ::testing::internal::CaptureStderr();
  Status st;
  for (int i = 0; i < 8; ++i) st = w->enqueue_bytes(b, 0.1);  // 0.8 s in slices of 0.1 s
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::timeout);
  const size_t warnings = occurrences(err, "blocked for");
  EXPECT_GE(warnings, 1u) << err;  // a fresh clock per slice would never reach 0.3 s
  const size_t at = st.error().message.find("after ");
  ASSERT_NE(at, std::string::npos) << st.error().message;
  EXPECT_GE(std::stod(st.error().message.substr(at + 6)), 0.7) << st.error().message;
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  auto fresh = w->enqueue_bytes(b, 0.1);
  ASSERT_FALSE(fresh.ok());
  const size_t at2 = fresh.error().message.find("after ");
  EXPECT_LT(std::stod(fresh.error().message.substr(at2 + 6)), 0.5) << fresh.error().message;
}

TEST(Mq, ShutdownWakesBlockedReadersAndWriter) {
  Trio t(small(256, 1));
  ASSERT_TRUE(t.r1);
  auto& w = t.w;
  auto& r0 = t.r0;
  auto& r1 = t.r1;
  std::byte b[8]{};
  ASSERT_TRUE(w->enqueue_bytes(b, 1).ok());
  ASSERT_TRUE(r0->dequeue(1).ok());
  // rank 0 now waits for message 1; the writer waits for rank 1 to free the only chunk.
  Errc reader_err = Errc::ok, writer_err = Errc::ok;
  std::thread rt([&] { auto m = r0->dequeue(-1); reader_err = m.ok() ? Errc::ok : m.error().code; });
  std::thread wt([&] { auto s = w->enqueue_bytes(b, -1); writer_err = s.ok() ? Errc::ok : s.error().code; });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto t0 = Clock::now();
  w->shutdown(true);  // the queue ends for everyone
  rt.join();
  wt.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(100));
  EXPECT_EQ(reader_err, Errc::cancelled);
  EXPECT_EQ(writer_err, Errc::cancelled);
  // The pending message is still delivered to rank 1, then cancelled.
  EXPECT_TRUE(r1->dequeue(1).ok());
  EXPECT_EQ(r1->dequeue(1).error().code, Errc::cancelled);
}

// vLLM's semantics: the writer's shutdown() is its own. Its blocked enqueue ends with cancelled
// at once and later ones fail; readers are not cancelled (vLLM's shutdown test expects a reader to
// time out after the writer shut down), still get what was enqueued, and learn the queue ended
// only when the writer ends it for everyone (close, destruction, shutdown(true)).
TEST(Mq, WritersShutdownIsItsOwn) {
  Trio t(small(256, 1));
  ASSERT_TRUE(t.r1);
  std::byte b[8]{};
  ASSERT_TRUE(t.w->enqueue_bytes(b, 1).ok());
  ASSERT_TRUE(t.r0->dequeue(1).ok());
  Errc writer_err = Errc::ok;
  std::thread wt([&] { auto s = t.w->enqueue_bytes(b, -1); writer_err = s.ok() ? Errc::ok : s.error().code; });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = Clock::now();
  t.w->shutdown();
  wt.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(100));
  EXPECT_EQ(writer_err, Errc::cancelled);
  EXPECT_TRUE(t.w->shutting_down());
  EXPECT_EQ(t.w->enqueue_bytes(b, 1).error().code, Errc::cancelled);
  EXPECT_EQ(t.r0->dequeue(0.05).error().code, Errc::timeout);  // not cancelled
  EXPECT_FALSE(t.r0->shutting_down());
  EXPECT_TRUE(t.r1->dequeue(1).ok());  // the message enqueued before is delivered
  t.w->shutdown(true);
  EXPECT_EQ(t.r0->dequeue(1).error().code, Errc::cancelled);
  EXPECT_TRUE(t.r0->shutting_down());
}

TEST(Mq, KilledReaderIsReportedByRankThenDropped) {
  for (bool automatic : {false, true}) {
    MessageQueueOptions o;
    o.n_reader = o.n_local_reader = 2;
    o.max_chunk_bytes = 256;
    o.max_chunks = 2;
    o.drop_dead_readers = automatic;
    auto w = MessageQueue::create(o);
    ASSERT_TRUE(w.ok());
    const auto h = (*w)->export_handle();
    int ready[2];
    ASSERT_EQ(pipe(ready), 0);
    pid_t victim = fork();
    if (victim == 0) {
      auto r = MessageQueue::create_from_handle(h, 1);
      char c = r.ok() ? 1 : 0;
      if (write(ready[1], &c, 1) != 1) _exit(1);
      pause();
      _exit(0);
    }
    char c = 0;
    ASSERT_EQ(read(ready[0], &c, 1), 1);
    close(ready[0]);
    close(ready[1]);
    ASSERT_EQ(c, 1);
    auto r0 = MessageQueue::create_from_handle(h, 0);
    ASSERT_TRUE(r0.ok());
    ASSERT_OK((*w)->wait_until_ready(5));
    kill(victim, SIGKILL);
    EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
    std::byte b[8]{};
    for (int i = 0; i < 2; ++i) ASSERT_TRUE((*w)->enqueue_bytes(b, 1).ok());
    for (int i = 0; i < 2; ++i) ASSERT_TRUE((*r0)->dequeue(1).ok());
    auto st = (*w)->enqueue_bytes(b, 5);  // the chunk waits for the dead rank 1
    if (automatic) {
      EXPECT_TRUE(st.ok()) << st.error().message;
    } else {
      ASSERT_FALSE(st.ok());
      EXPECT_EQ(st.error().code, Errc::peer_dead);
      EXPECT_NE(st.error().message.find("rank 1"), std::string::npos) << st.error().message;
      ASSERT_TRUE((*w)->drop_reader(1).ok());
      EXPECT_TRUE((*w)->enqueue_bytes(b, 1).ok());
    }
    EXPECT_TRUE((*r0)->dequeue(1).ok());
  }
}

TEST(Mq, ReaderLearnsTheWriterDied) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t writer = fork();
  if (writer == 0) {
    MessageQueueOptions o;
    o.n_reader = o.n_local_reader = 1;
    o.max_chunk_bytes = 256;
    o.max_chunks = 2;
    o.overflow_bytes = 4096;
    auto w = MessageQueue::create(o);
    if (!w.ok()) _exit(1);
    auto bytes = (*w)->export_handle().to_msgpack();
    uint32_t n = uint32_t(bytes.size());
    if (write(pipefd[1], &n, 4) != 4 || write(pipefd[1], bytes.data(), n) != ssize_t(n)) _exit(1);
    pause();
    _exit(0);
  }
  uint32_t n = 0;
  ASSERT_EQ(read(pipefd[0], &n, 4), 4);
  std::vector<std::byte> bytes(n);
  ASSERT_EQ(read(pipefd[0], bytes.data(), n), ssize_t(n));
  auto h = MessageQueueHandle::from_msgpack(bytes);
  ASSERT_TRUE(h.ok()) << h.error().message;
  auto r = MessageQueue::create_from_handle(*h, 0);
  ASSERT_TRUE(r.ok()) << r.error().message;
  kill(writer, SIGKILL);
  EXPECT_EQ(wait_child(writer), 128 + SIGKILL);
  auto m = (*r)->dequeue(5);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code, Errc::peer_dead);
  // What the dead writer left (its ring name) is reclaimed by reap.
  shm::reap();
  r->reset();
  EXPECT_EQ(mq_files(writer), 0u);
}

// Regression: attach computed the ring's size from header fields before bounding them; 16 chunks
// of 2^60 bytes wrap to 0 and passed the size check.
TEST(Ring, AttachRejectsAHeaderWhoseSizeOverflows) {
  const std::string name = shm::user_prefix() + "mq.q" + std::to_string(getpid()) + ".2";
  shm::RingOptions o;
  o.max_chunks = 16;
  o.chunk_bytes = 256;
  auto w = shm::Ring::create("/dev/shm", name, o);
  ASSERT_TRUE(w.ok());
  (*w)->header().chunk_bytes = 1ull << 60;
  auto r = shm::Ring::attach("/dev/shm", name, 0, o);
  shm::Segment::unlink("/dev/shm", name);  // before asserting: a failure must not leave it behind
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::corrupt);
}

// A reader's own shutdown() wakes its blocked dequeue at once, at any moment of the wait (fails
// if the wake is lost: the waiter would sleep its 0.5 s liveness slice). The narrow window the
// review found (shutdown between the waiter's re-check and futex_wait, when shutdown only woke
// and did not move the word) is not reproducible on demand; it is closed by construction:
// cancel_local moves the words exactly as the writer's shutdown does.
TEST(Mq, ReaderShutdownFromAnotherThreadWakesItPromptly) {
  double worst_ms = 0;
  for (int i = 0; i < 60; ++i) {
    auto o = small(256, 2);
    o.spin_us = 0;  // straight to the kernel: the window is the futex path
    o.overflow_bytes = 0;
    Trio t(o);
    ASSERT_TRUE(t.r1);
    std::thread rt([&] { (void)t.r0->dequeue(-1); });
    if (i % 3) std::this_thread::sleep_for(std::chrono::microseconds(i * 7));
    auto t0 = Clock::now();
    t.r0->shutdown();
    rt.join();
    worst_ms = std::max(worst_ms, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  EXPECT_LT(worst_ms, 250.0);
}

// Regression: when a message reached the local readers but the send to a remote reader timed
// out, the writer did not spend its number, so the remote reader silently missed it. It must
// see the gap. The remote reader is stopped (SIGSTOP: a hung host) so its socket fills.
TEST(Mq, RemoteReaderReportsAMessageItMissedThatLocalReadersGot) {
  MessageQueueOptions o;
  o.n_reader = 2;
  o.n_local_reader = 1;
  o.connect_ip = "127.0.0.1";  // tests stay on loopback
  o.max_chunk_bytes = 4u << 20;
  o.max_chunks = 4;
  o.overflow_bytes = 0;
  o.remote_hwm = 1;
  int to_child[2], ready[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(ready), 0);
  // The remote reader: read what it is told arrived, then expect the gap. Forked before the
  // writer starts its threads (testing_util::EarlyChild); it gets the handle through a pipe.
  testing_util::EarlyChild kid([&](std::span<const std::byte> b) {
    auto h = MessageQueueHandle::from_msgpack(b);
    if (!h.ok()) return 6;
    auto r = MessageQueue::create_from_handle(*h, 1);
    char c = r.ok();
    if (write(ready[1], &c, 1) != 1 || !r.ok()) return 2;
    int sent = 0;
    if (read(to_child[0], &sent, sizeof sent) != sizeof sent) return 3;
    for (int i = 0; i < sent; ++i)
      if (!(*r)->dequeue(10).ok()) return 4;
    auto gap = (*r)->dequeue(10);
    return !gap.ok() && gap.error().code == Errc::corrupt ? 0 : 5;
  });
  ASSERT_TRUE(kid.ok());
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok());
  const auto h = (*w)->export_handle();
  ASSERT_TRUE(kid.send(h.to_msgpack()));
  const pid_t pid = kid.pid();
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 1);
  auto local = MessageQueue::create_from_handle(h, 0);
  ASSERT_TRUE(local.ok());
  ASSERT_OK((*w)->wait_until_ready(10));
  kill(pid, SIGSTOP);
  std::vector<std::byte> big(3u << 20, std::byte{1});
  int sent = 0;
  Status st;
  while (sent < 200 && (st = (*w)->enqueue_bytes(big, 0.3)).ok()) {
    ++sent;
    ASSERT_TRUE((*local)->dequeue(1).ok());
  }
  ASSERT_FALSE(st.ok()) << "the stopped reader's socket never filled";
  EXPECT_EQ(st.error().code, Errc::timeout);
  EXPECT_NE(st.error().message.find("local readers got it"), std::string::npos) << st.error().message;
  EXPECT_TRUE((*local)->dequeue(1).ok());  // the local reader has the message the remote one lacks
  kill(pid, SIGCONT);
  ASSERT_EQ(write(to_child[1], &sent, sizeof sent), ssize_t(sizeof sent));
  ASSERT_TRUE((*w)->enqueue_bytes(big, 10).ok());
  EXPECT_EQ(kid.wait(), 0);
  for (int fd : {to_child[0], to_child[1], ready[0], ready[1]}) close(fd);
}

TEST(Mq, BadHandlesAndArgumentsAreClearErrors) {
  std::byte junk[5] = {std::byte{1}, std::byte{2}};
  EXPECT_FALSE(MessageQueueHandle::from_msgpack(junk).ok());
  MessageQueueHandle h;
  h.shm_dir = "/dev/shm";
  h.ring_name = "../../etc/passwd";
  h.local_reader_ranks = {0};
  h.n_reader = 1;
  EXPECT_FALSE(MessageQueueHandle::from_msgpack(h.to_msgpack()).ok());
  h.ring_name.clear();
  h.local_reader_ranks.clear();
  ASSERT_TRUE(MessageQueueHandle::from_msgpack(h.to_msgpack()).ok());
  h.remote_addr = "tcp://\xff\xfe:1";  // regression: became a UnicodeDecodeError in Python
  auto e = MessageQueueHandle::from_msgpack(h.to_msgpack());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("UTF-8"), std::string::npos) << e.error().message;
  MessageQueueOptions o;
  o.n_reader = 1;
  o.n_local_reader = 2;
  EXPECT_EQ(MessageQueue::create(o).error().code, Errc::invalid_argument);
  o.n_local_reader = 1;
  o.max_chunk_bytes = 256;
  o.max_chunks = 2;
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(MessageQueue::create_from_handle((*w)->export_handle(), 5).error().code, Errc::invalid_argument);
  auto r = MessageQueue::create_from_handle((*w)->export_handle(), 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(MessageQueue::create_from_handle((*w)->export_handle(), 0).error().code, Errc::exists);
  EXPECT_FALSE((*r)->enqueue_bytes({}, 0).ok());
  EXPECT_FALSE((*w)->dequeue(0).ok());
}

// vLLM's process groups name local readers by group rank ([1, 2, 3] beside a writer of rank 0):
// the ranks need not be 0..n-1, and a remote reader may be of any rank (-1: remote only).
TEST(Mq, LocalReaderRanksAreAnyDistinctNumbersAndRemoteReadersAnyRank) {
  MessageQueueOptions o;
  o.n_reader = 3;
  o.n_local_reader = 2;
  o.local_reader_ranks = {1, 3};
  o.connect_ip = "127.0.0.1";
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok()) << w.error().message;  // regression: refused, 3 >= n_reader
  const MessageQueueHandle h = (*w)->export_handle();
  EXPECT_EQ(h.chunk_bytes, o.max_chunk_bytes);
  auto a = MessageQueue::create_from_handle(h, 1);
  auto b = MessageQueue::create_from_handle(h, 3);
  auto remote = MessageQueue::create_from_handle(h, -1);
  ASSERT_TRUE(a.ok() && b.ok() && remote.ok());
  EXPECT_EQ((*remote)->rank(), -1);
  ASSERT_OK((*w)->wait_until_ready(10));
  ASSERT_TRUE((*w)->enqueue_bytes(std::as_bytes(std::span("hello", 5)), 5).ok());
  for (auto* r : {&a, &b, &remote}) {
    auto m = (**r)->dequeue(5);
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ(m->payload.tensors[0].nbytes(), 5u);
  }
  MessageQueueOptions dup = o;
  dup.local_reader_ranks = {3, 3};
  EXPECT_EQ(MessageQueue::create(dup).error().code, Errc::invalid_argument);
  (*w)->shutdown(true);
  EXPECT_TRUE((*w)->shutting_down());
  auto after = (*a)->dequeue(5);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.error().code, Errc::cancelled);
  EXPECT_NE(after.error().message.find("cancelled"), std::string::npos) << after.error().message;
  EXPECT_TRUE((*a)->shutting_down());
}

// vLLM serves remote readers on the host's address when no connect_ip is given; so does stagelink
// (bound on every interface, the handle naming the host's address).
TEST(Mq, WithoutConnectIpRemoteReadersAreServedOnTheHostAddress) {
  setenv("STAGELINK_HOST_IP", "127.0.0.1", 1);  // this test's own choice: loopback, nothing else
  MessageQueueOptions o;
  o.n_reader = 1;
  o.n_local_reader = 0;
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  const std::string addr = (*w)->export_handle().remote_addr;
  EXPECT_EQ(addr.rfind("tcp://127.0.0.1:", 0), 0u) << addr;
  EXPECT_EQ(addr.find('*'), std::string::npos) << addr;  // an address a peer can connect to
  auto r = MessageQueue::create_from_handle((*w)->export_handle(), -1);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_OK((*w)->wait_until_ready(10));
  ASSERT_TRUE((*w)->enqueue_bytes(std::as_bytes(std::span("hi", 2)), 5).ok());
  auto m = (*r)->dequeue(5);
  ASSERT_TRUE(m.ok()) << m.error().message;
  unsetenv("STAGELINK_HOST_IP");
  in_addr parsed{};  // discovered from the interfaces: a dotted quad a peer can connect to
  EXPECT_EQ(inet_pton(AF_INET, stagelink::net::host_address().c_str(), &parsed), 1) << stagelink::net::host_address();
}

// wait_message: a reader waits for the next message without taking it (what vLLM's read loop
// needs); it says false for a timeout or a shutdown with nothing left, and the writer refuses it.
TEST(Mq, WaitMessageWaitsWithoutTakingTheMessage) {
  MessageQueueOptions o;
  o.n_reader = 2;
  o.n_local_reader = 1;
  o.connect_ip = "127.0.0.1";
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  auto local = MessageQueue::create_from_handle((*w)->export_handle(), 0);
  auto remote = MessageQueue::create_from_handle((*w)->export_handle(), -1);
  ASSERT_TRUE(local.ok() && remote.ok());
  ASSERT_OK((*w)->wait_until_ready(10));
  EXPECT_EQ((*w)->wait_message(0).error().code, Errc::invalid_argument);
  // wait_message(t): whether the message is there, how long it took; an error fails the test.
  auto ready = [](MessageQueue& q, double t) {
    const auto t0 = Clock::now();
    auto r = q.wait_message(t);
    EXPECT_TRUE(r.ok()) << r.error().message;
    return std::pair{r.ok() && *r, Clock::now() - t0};
  };
  for (auto* r : {&local, &remote}) {
    auto [got, took] = ready(***r, 0.05);
    EXPECT_FALSE(got);
    EXPECT_GE(took, std::chrono::milliseconds(45));
    EXPECT_FALSE(ready(***r, 0).first);
  }
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE((*w)->enqueue_bytes(std::as_bytes(std::span("hello", 5)), 5).ok());
  });
  for (auto* r : {&local, &remote}) {
    EXPECT_TRUE(ready(***r, 5).first);
    EXPECT_TRUE(ready(***r, 0).first);  // still there: waiting took nothing
    auto m = (**r)->dequeue(0);
    ASSERT_TRUE(m.ok()) << m.error().message;
    EXPECT_EQ(m->payload.tensors[0].nbytes(), 5u);
    EXPECT_FALSE(ready(***r, 0).first);
  }
  late.join();
  std::thread stop([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    (*local)->shutdown();
    (*remote)->shutdown();
  });
  for (auto* r : {&local, &remote}) {  // woken by the shutdown, nothing left to read
    auto [got, took] = ready(***r, 10);
    EXPECT_FALSE(got);
    EXPECT_LT(took, std::chrono::seconds(2));
  }
  stop.join();
}

// Trust, second round: a writer given no keys (vLLM's callers give none) serves its remote readers
// with CURVE all the same, its readers' key pair in its handle; a reader given keys refuses a
// handle that names no writer key (it used to take a plain writer's, and dequeue forged data).
TEST(Mq, AKeylessWriterPutsItsReadersKeysInItsHandleAndAReaderGivenKeysRefusesAKeylessHandle) {
  MessageQueueOptions o;
  o.n_reader = 1;
  o.n_local_reader = 0;
  o.connect_ip = "127.0.0.1";
  o.max_chunk_bytes = 4096;
  o.max_chunks = 4;
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  MessageQueueHandle h = (*w)->export_handle();
  ASSERT_EQ(h.server_key.size(), 40u);
  ASSERT_TRUE(h.reader_keys.has_value());
  auto back = MessageQueueHandle::from_msgpack(h.to_msgpack());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->reader_keys, h.reader_keys);
  auto r = MessageQueue::create_from_handle(*back, -1);  // the handle's own keys
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_TRUE((*w)->wait_until_ready(10).ok());
  const std::byte msg[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
  ASSERT_TRUE((*w)->enqueue_bytes(msg, 5).ok());
  auto got = (*r)->dequeue(5);
  ASSERT_TRUE(got.ok()) << got.error().message;
  // The handle stripped of its keys, as a forger (or an older writer) would send it.
  MessageQueueHandle plain = h;
  plain.server_key.clear();
  plain.reader_keys.reset();
  auto ck = curve_keypair();
  ASSERT_TRUE(ck.ok());
  CurveClient given{*ck, ck->public_key};
  auto refused = MessageQueue::create_from_handle(plain, -1, &given);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, Errc::permission_denied);
  EXPECT_NE(refused.error().message.find("names no writer key"), std::string::npos);
  // Reader keys without a server key are no handle at all.
  MessageQueueHandle odd = h;
  odd.server_key.clear();
  EXPECT_FALSE(MessageQueueHandle::from_msgpack(odd.to_msgpack()).ok());
}
