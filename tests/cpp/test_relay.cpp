// The relay: credits per edge with deadlines, completion by release, cleanup, close, backends.
// Each test here is one of SGLang-Omni's relay failures (issue 10) shown not to happen.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "util.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::wait_child;

namespace {
std::string unique_ns() {
  static int n = 0;
  return "trel" + std::to_string(getpid()) + "x" + std::to_string(n++);
}
RelayConfig cfg(uint32_t credits = 2, double timeout = 0.3, const std::string& backend = "shm") {
  RelayConfig c;
  c.backend = backend;
  c.credits = credits;
  c.timeout_s = timeout;
  c.slot_size_mb = 1;
  Value::Map e;
  e.emplace_back("namespace", unique_ns());
  c.extra = Value(std::move(e));
  return c;
}
std::unique_ptr<Relay> make(const RelayConfig& c) {
  auto r = Relay::create(c);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return r.ok() ? std::move(r).value() : nullptr;
}
Payload bytes_payload(const std::vector<std::byte>& data, size_t tensors = 1) {
  Payload p;
  Value::List refs;
  for (size_t i = 0; i < tensors; ++i) {
    p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(data)));
    refs.emplace_back(TensorRef{uint32_t(i)});
  }
  p.tree = Value(std::move(refs));
  return p;
}
std::vector<std::byte> pattern(size_t n, uint8_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::byte(uint8_t(i * 31 + seed));
  return v;
}
}  // namespace

TEST(Relay, CrossProcessRoundTripCompletesWhenRead) {
  auto c = cfg(4, 5.0);
  auto relay = make(c);
  ASSERT_TRUE(relay);
  const auto data = pattern(3 << 20, 7);  // larger than the inline threshold: through the arena
  auto op = relay->put_async(bytes_payload(data), {.request_id = "req-1", .edge = "talker"});
  ASSERT_TRUE(op.ok()) << op.error().message;
  EXPECT_FALSE(op->done());
  const auto md = value_to_msgpack(op->metadata());
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  pid_t pid = fork();
  if (pid == 0) {
    uint32_t n = 0;
    if (read(to_child[0], &n, 4) != 4) _exit(2);
    std::vector<std::byte> buf(n);
    if (read(to_child[0], buf.data(), n) != ssize_t(n)) _exit(3);
    auto mdv = value_from_msgpack(buf);
    if (!mdv.ok()) _exit(4);
    RelayConfig rc = c;
    auto r = Relay::create(rc);
    if (!r.ok()) _exit(5);
    std::vector<std::byte> dest(data.size());
    auto g = r.value()->get_async(mdv.value(), {.request_id = "req-1", .dest = dest});
    const int code = !g.ok() || !g->wait(1).ok() ? 6 : checksum(dest) == checksum(data) ? 0 : 7;
    r.value().reset();  // detach before _exit: the directory goes with its last process
    _exit(code);
  }
  const uint32_t n = uint32_t(md.size());
  ASSERT_EQ(write(to_child[1], &n, 4), 4);
  ASSERT_EQ(write(to_child[1], md.data(), n), ssize_t(n));
  EXPECT_EQ(wait_child(pid), 0);
  EXPECT_TRUE(op->wait(2.0).ok());  // released by the child's read
  EXPECT_TRUE(op->done());
  for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) close(fd);
}

// Reference: one pool for every edge, credit waits without a timeout.
TEST(Relay, CreditsArePerEdgeAndEveryWaitHasADeadline) {
  auto relay = make(cfg(2, 0.3));
  ASSERT_TRUE(relay);
  const auto data = pattern(100 << 10, 1);
  auto a1 = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "a"});
  auto a2 = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "a"});
  ASSERT_TRUE(a1.ok() && a2.ok());
  const auto t0 = Clock::now();
  auto a3 = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "a"});
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_FALSE(a3.ok());
  EXPECT_EQ(a3.error().code, Errc::exhausted);
  EXPECT_NE(a3.error().message.find("'a'"), std::string::npos) << a3.error().message;
  EXPECT_GE(waited, 0.25);
  EXPECT_LT(waited, 2.0);
  // Another edge has its own credits.
  auto b1 = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "b"});
  EXPECT_TRUE(b1.ok());
  // A read returns a credit to the waiting edge.
  auto g = relay->get_async(a1->metadata());
  ASSERT_TRUE(g.ok()) << g.error().message;
  auto a4 = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "a"});
  EXPECT_TRUE(a4.ok());
}

// Reference: a chunk with 2 metadata tensors needs 3 credits of a pool of 2 and blocks forever.
TEST(Relay, OneCreditPerPutHoweverManyTensors) {
  auto relay = make(cfg(2, 0.2));
  ASSERT_TRUE(relay);
  const auto data = pattern(4096, 2);
  auto p1 = relay->put_async(bytes_payload(data, 3), {.request_id = "r", .edge = "e"});
  auto p2 = relay->put_async(bytes_payload(data, 3), {.request_id = "r", .edge = "e"});
  ASSERT_TRUE(p1.ok() && p2.ok());
  auto g = relay->get_async(p1->metadata());
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->payload().tensors.size(), 3u);
  EXPECT_EQ(checksum(g->payload().tensors[2].data), checksum(data));
}

// Reference: a put that is never waited on leaks its segment and its credit.
TEST(Relay, DroppedOperationLosesNothingAndReturnsItsCredit) {
  auto relay = make(cfg(1, 0.3));
  ASSERT_TRUE(relay);
  const auto data = pattern(1 << 20, 3);
  Value md;
  {
    auto op = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "e"});
    ASSERT_TRUE(op.ok());
    md = op->metadata();
  }  // dropped, never waited on: the data stays readable
  auto g = relay->get_async(md);
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload().tensors[0].data), checksum(data));
  auto again = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "e"});
  EXPECT_TRUE(again.ok()) << "credit not returned: " << again.error().message;
  auto g2 = relay->get_async(again->metadata());
  ASSERT_TRUE(g2.ok());
  g2 = make_error(Errc::io, "");  // drop the copy
  Value h = relay->health();
  const Value* conn = h.find("connector");
  ASSERT_TRUE(conn);
  uint64_t used = 1;
  ASSERT_TRUE(relay->put_async(bytes_payload(pattern(10, 1)), {.edge = "x"}).ok());  // reclaims lazily
  h = relay->health();
  ASSERT_TRUE(h.find("connector")->find("outstanding")->get_u64(used));
  EXPECT_EQ(used, 1u);  // only the last, unread put: the others went back
}

// Reference: cleanup/close do nothing.
TEST(Relay, CleanupReleasesUnreadPutsAndCredits) {
  auto relay = make(cfg(1, 0.3));
  ASSERT_TRUE(relay);
  const auto data = pattern(200 << 10, 4);
  auto op = relay->put_async(bytes_payload(data), {.request_id = "req-9", .edge = "e"});
  ASSERT_TRUE(op.ok());
  EXPECT_EQ(relay->cleanup("req-9"), 1u);
  auto w = op->wait(1.0);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().code, Errc::cancelled);
  auto g = relay->get_async(op->metadata(), {.timeout_s = 0});
  EXPECT_FALSE(g.ok());
  auto next = relay->put_async(bytes_payload(data), {.request_id = "req-10", .edge = "e"});
  EXPECT_TRUE(next.ok());
}

// A receiver that cleans a request up after reading it (SGLang-Omni's read_payload does) must not
// cancel what the producer put for that request's other receivers: cleanup is the relay's own
// puts only. Before, it cancelled every unread put of the request on the host.
TEST(Relay, CleanupTakesOnlyThisRelaysOwnPuts) {
  for (const std::string backend : {"shm", "local"}) {
    auto c = cfg(2, 1.0, backend);
    auto producer = make(c);
    auto receiver = make(c);  // same namespace: it reads the producer's puts
    ASSERT_TRUE(producer && receiver);
    const auto data = pattern(200 << 10, 8);
    auto to_b = producer->put_async(bytes_payload(data), {.request_id = "req", .edge = "b"});
    auto to_c = producer->put_async(bytes_payload(data), {.request_id = "req", .edge = "c"});
    ASSERT_TRUE(to_b.ok() && to_c.ok());
    auto got = receiver->get_async(to_b->metadata(), {});
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(receiver->cleanup("req"), 0u) << backend;
    auto other = receiver->get_async(to_c->metadata(), {.timeout_s = 0});
    ASSERT_TRUE(other.ok()) << backend << ": " << other.error().message;
    EXPECT_EQ(checksum(other->payload().tensors[0].data), checksum(data));
    EXPECT_TRUE(to_c->wait(1).ok());
    EXPECT_EQ(producer->cleanup("req"), 0u);  // everything was read
    if (backend == "shm") {  // the memory of the puts read is back now, not at its next put (asked of
      // the receiver: the producer's own health() would return it)
      uint64_t live = 1;
      ASSERT_TRUE(receiver->health().find("connector")->find("directory_live_entries")->get_u64(live));
      EXPECT_EQ(live, 0u);
    }
    auto unread = producer->put_async(bytes_payload(data), {.request_id = "req", .edge = "c"});
    ASSERT_TRUE(unread.ok());
    EXPECT_EQ(producer->cleanup("req"), 1u);  // its own unread put
    auto w = unread->wait(1);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.error().code, Errc::cancelled);
  }
}

// Every put's metadata carries SGLang-Omni's fields: the sender's engine_id and transfer_info
// {size: the bytes a destination needs, req_id}.
TEST(Relay, MetadataCarriesEngineIdAndTransferInfo) {
  for (const std::string backend : {"shm", "local"}) {
    auto c = cfg(2, 1.0, backend);
    c.engine_id = "thinker-0";
    auto relay = make(c);
    ASSERT_TRUE(relay);
    const auto data = pattern(1000, 9);
    auto op = relay->put_async(bytes_payload(data), {.request_id = "r7", .edge = "e"});
    ASSERT_TRUE(op.ok()) << op.error().message;
    const Value& md = op->metadata();
    ASSERT_TRUE(md.find("engine_id") && md.find("engine_id")->is<std::string>());
    EXPECT_EQ(md.find("engine_id")->as<std::string>(), "thinker-0");
    const Value* ti = md.find("transfer_info");
    ASSERT_TRUE(ti);
    uint64_t size = 0;
    ASSERT_TRUE(ti->find("size") && ti->find("size")->get_u64(size));
    EXPECT_EQ(size, data.size()) << backend;
    EXPECT_EQ(ti->find("req_id")->as<std::string>(), "r7");
    std::vector<std::byte> dest(size);
    auto got = relay->get_async(md, {.dest = std::span<std::byte>(dest)});
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(checksum(dest), checksum(data));
  }
  Value::Map m;
  m.emplace_back("engine_id", uint64_t(3));
  EXPECT_FALSE(RelayConfig::from_value(Value(std::move(m))).ok());  // a string, or a clear error
}

// SGLang-Omni's put_many_async: segments written at their offsets into one uint8 tensor, zeros
// between, in the relay's shared memory (a loan: one copy) or one owned buffer (local).
TEST(Relay, PutSegmentsLaysOutOneBufferAndRefusesBadSegments) {
  for (const std::string backend : {"shm", "local"}) {
    auto relay = make(cfg(2, 1.0, backend));
    ASSERT_TRUE(relay);
    const auto a = pattern(300 << 10, 1), b = pattern(100, 2);
    const size_t total = (300 << 10) + 64 + 100 + 36;
    std::vector<RelaySegment> segs{{(300 << 10) + 64, b}, {0, a}};  // any order
    auto op = relay->put_segments(segs, total, {.request_id = "seg", .edge = "e"});
    ASSERT_TRUE(op.ok()) << backend << ": " << op.error().message;
    uint64_t size = 0;
    ASSERT_TRUE(op->metadata().find("transfer_info")->find("size")->get_u64(size));
    EXPECT_EQ(size, total);
    std::vector<std::byte> dest(total, std::byte{0x5a});
    auto got = relay->get_async(op->metadata(), {.dest = std::span<std::byte>(dest)});
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(got->size(), total);
    EXPECT_EQ(std::memcmp(dest.data(), a.data(), a.size()), 0);
    for (size_t i = a.size(); i < a.size() + 64; ++i) ASSERT_EQ(dest[i], std::byte{0}) << i;
    EXPECT_EQ(std::memcmp(dest.data() + a.size() + 64, b.data(), b.size()), 0);
    for (size_t i = total - 36; i < total; ++i) ASSERT_EQ(dest[i], std::byte{0}) << i;
    EXPECT_TRUE(op->wait(1).ok());
    std::vector<RelaySegment> overlap{{0, a}, {100, b}};
    auto bad = relay->put_segments(overlap, total, {.edge = "e"});
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.error().code, Errc::invalid_argument);
    EXPECT_NE(bad.error().message.find("overlaps"), std::string::npos);
    std::vector<RelaySegment> past{{total - 10, b}};
    auto far = relay->put_segments(past, total, {.edge = "e"});
    ASSERT_FALSE(far.ok());
    EXPECT_NE(far.error().message.find("past total_size"), std::string::npos);
    EXPECT_TRUE(relay->put_async(bytes_payload(b), {.edge = "e"}).ok());  // refusals took no credit
    EXPECT_TRUE(relay->put_async(bytes_payload(b), {.edge = "e"}).ok());
  }
}

TEST(Relay, CloseEndsACreditWaitAtOnce) {
  auto c = cfg(1, 30);
  auto relay = make(c);
  ASSERT_TRUE(relay);
  const auto data = pattern(100 << 10, 5);
  auto held = relay->put_async(bytes_payload(data), {.edge = "e"});
  ASSERT_TRUE(held.ok());
  Result<RelayOp> blocked = make_error(Errc::io, "not run");
  const auto t0 = Clock::now();
  std::thread t([&] { blocked = relay->put_async(bytes_payload(data), {.edge = "e"}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  relay->close();
  t.join();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.error().code, Errc::closed);
  EXPECT_FALSE(held->wait(0).ok());
}

// RelayPutOptions::keep_waiting (Ctrl-C from Python) ends a credit wait; the relay works on.
TEST(Relay, KeepWaitingEndsACreditWait) {
  for (const std::string backend : {"shm", "local"}) {
    auto relay = make(cfg(1, 30, backend));
    ASSERT_TRUE(relay);
    const auto data = pattern(10 << 10, 6);
    auto held = relay->put_async(bytes_payload(data), {.edge = "e"});
    ASSERT_TRUE(held.ok());
    int asked = 0;
    const auto t0 = Clock::now();
    auto blocked = relay->put_async(bytes_payload(data),
                                    {.request_id = "cut", .edge = "e", .keep_waiting = [&] { return ++asked < 3; }});
    ASSERT_FALSE(blocked.ok());
    EXPECT_EQ(blocked.error().code, Errc::cancelled) << blocked.error().message;
    EXPECT_EQ(asked, 3);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 3.0);
    EXPECT_EQ(relay->cleanup("cut"), 0u);  // the cancelled put holds nothing
    auto got = relay->get_async(held->metadata(), {});
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_TRUE(held->wait(5).ok());
    EXPECT_TRUE(relay->put_async(bytes_payload(data), {.edge = "e"}).ok());  // its credit came back
  }
}

// A put whose reader failed (SGLang-Omni's mark_receiver_failed) is withdrawn: its wait ends
// cancelled, its data is gone, its credit is back; a read put is not withdrawn.
TEST(Relay, WithdrawnPutEndsCancelledAndReturnsItsCredit) {
  for (const std::string backend : {"shm", "local"}) {
    auto relay = make(cfg(1, 0.3, backend));
    ASSERT_TRUE(relay);
    const auto data = pattern(200 << 10, 7);  // past the inline size: no copy rides in the metadata
    auto put = relay->put_async(bytes_payload(data), {.request_id = "r", .edge = "e"});
    ASSERT_TRUE(put.ok());
    EXPECT_TRUE(put->withdraw()) << backend;
    EXPECT_FALSE(put->withdraw());
    Status w = put->wait(1);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.error().code, Errc::cancelled) << w.error().message;
    EXPECT_FALSE(relay->get_async(put->metadata(), {}).ok());  // its data is gone
    auto next = relay->put_async(bytes_payload(data), {.edge = "e"});  // the only credit is back
    ASSERT_TRUE(next.ok()) << next.error().message;
    auto got = relay->get_async(next->metadata(), {});
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_TRUE(next->wait(5).ok());
    EXPECT_FALSE(next->withdraw());  // read already
    EXPECT_FALSE(got->withdraw());   // a get
  }
}

// Reference: reads are destructive; a second reader fails.
TEST(Relay, FanOutToTwoReaders) {
  auto relay = make(cfg(2, 1));
  ASSERT_TRUE(relay);
  const auto data = pattern(300 << 10, 6);
  auto op = relay->put_async(bytes_payload(data), {.edge = "e", .readers = 2});
  ASSERT_TRUE(op.ok());
  auto g1 = relay->get_async(op->metadata());
  EXPECT_FALSE(op->done());
  auto g2 = relay->get_async(op->metadata());
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_EQ(checksum(g2->payload().tensors[0].data), checksum(data));
  EXPECT_TRUE(op->wait(1).ok());
}

TEST(Relay, LocalBackendPassesByReference) {
  auto a = make(cfg(2, 0.2, "local"));
  auto b = make(cfg(2, 0.2, "local"));
  ASSERT_TRUE(a && b);
  const auto data = pattern(1 << 20, 8);
  auto op = a->put_async(bytes_payload(data), {.request_id = "r", .edge = "e"});
  ASSERT_TRUE(op.ok());
  auto g = b->get_async(op->metadata());
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(g->payload().tensors[0].data.data(), data.data());  // the same bytes, not a copy
  EXPECT_TRUE(op->wait(0.1).ok());
  auto again = b->get_async(op->metadata());
  EXPECT_FALSE(again.ok());
  EXPECT_EQ(again.error().code, Errc::not_found);
}

TEST(Relay, LocalBackendKeepsAPackedTreeAndExt) {
  // Regression: a payload whose tree and ext came packed (as the Python binding puts them) lost
  // both on the local backend, which kept only the Value fields; the packed bytes are the
  // caller's and die with the call.
  auto a = make(cfg(2, 0.2, "local"));
  auto b = make(cfg(2, 0.2, "local"));
  ASSERT_TRUE(a && b);
  const auto data = pattern(4096, 3);
  Payload p = bytes_payload(data);
  Value::Map tree;
  tree.emplace_back("hidden", TensorRef{0});
  tree.emplace_back("ids", Value::List{Value(uint64_t(7)), Value(uint64_t(70000))});
  Value::Map ext;
  ext.emplace_back("tk", Value::List{Value(int64_t(1))});
  auto packed_tree = std::make_unique<std::vector<std::byte>>(value_to_msgpack(Value(std::move(tree))));
  auto packed_ext = std::make_unique<std::vector<std::byte>>(value_to_msgpack(Value(std::move(ext))));
  p.tree = Value();
  p.packed_tree = *packed_tree;
  p.packed_ext = *packed_ext;
  auto op = a->put_async(p, {.request_id = "r", .edge = "e"});
  ASSERT_TRUE(op.ok()) << op.error().message;
  std::fill(packed_tree->begin(), packed_tree->end(), std::byte{0xc1});  // the caller's bytes are gone
  std::fill(packed_ext->begin(), packed_ext->end(), std::byte{0xc1});
  auto g = b->get_async(op->metadata());
  ASSERT_TRUE(g.ok()) << g.error().message;
  const Payload& got = g->payload();
  ASSERT_TRUE(got.tree.is<Value::Map>());
  const Value* ids = got.tree.find("ids");
  ASSERT_TRUE(ids && ids->is<Value::List>());
  uint64_t v = 0;
  EXPECT_TRUE(ids->as<Value::List>()[1].get_u64(v));
  EXPECT_EQ(v, 70000u);
  EXPECT_TRUE(got.ext_has("tk"));
  EXPECT_FALSE(got.ext_has("pickle"));
}

TEST(Relay, BadInputIsAClearError) {
  auto relay = make(cfg());
  ASSERT_TRUE(relay);
  Value::Map bad;
  bad.emplace_back("size", uint64_t(1));
  auto g = relay->get_async(Value(bad));
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, Errc::corrupt);
  const auto data = pattern(1 << 20, 9);
  auto op = relay->put_async(bytes_payload(data), {.edge = "e"});
  ASSERT_TRUE(op.ok());
  std::vector<std::byte> small(100);
  auto g2 = relay->get_async(op->metadata(), {.dest = small});
  ASSERT_FALSE(g2.ok());
  EXPECT_EQ(g2.error().code, Errc::invalid_argument);
  auto neg = relay->put_async(bytes_payload(data), {.dst_rank = -1});
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.error().code, Errc::invalid_argument);
  // Without world_size any dst_rank is an edge of its own (SGLang-Omni's shm relay takes one it
  // ignores); with it, dst_rank must be below it.
  EXPECT_TRUE(relay->put_async(bytes_payload(data), {.dst_rank = 3}).ok());
  auto sized_cfg = cfg();
  sized_cfg.world_size = 2;
  auto sized = make(sized_cfg);
  ASSERT_TRUE(sized);
  auto r = sized->put_async(bytes_payload(data), {.dst_rank = 3});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::invalid_argument);

  Value::Map c;
  c.emplace_back("credit", uint64_t(4));
  auto rc = RelayConfig::from_value(Value(c));
  ASSERT_FALSE(rc.ok());
  EXPECT_NE(rc.error().message.find("'credit'"), std::string::npos);
  Value::Map c2;
  c2.emplace_back("backend", "nccl");
  EXPECT_FALSE(RelayConfig::from_value(Value(c2)).ok());
  Value::Map c3;
  c3.emplace_back("credits", uint64_t(0));
  EXPECT_FALSE(RelayConfig::from_value(Value(c3)).ok());
  Value::Map c4;
  c4.emplace_back("credits", uint64_t(3));
  c4.emplace_back("slot_size_mb", 2.0);
  auto ok = RelayConfig::from_value(Value(c4));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->credits, 3u);
}

// A shm relay's pool (credits x slot size) is reserved in /dev/shm as puts reach into it: made,
// it holds nothing; a 1 MiB put reserves 2 MiB of its 8. The first put of a pipeline's edge used
// to reserve and fault in the whole pool (18 ms for 8 x 4 MiB). A pool larger than /dev/shm (a
// container's 64 MiB) moves what fits, and a put beyond that fails with exhausted.
TEST(Relay, ShmRelayReservesItsPoolAsItIsUsed) {
  testing_util::SmallTmpfs fs;
  for (bool small_dir : {false, true}) {
    if (small_dir && !fs.ok()) GTEST_SKIP() << "cannot mount a tmpfs here (not root)";
    auto c = cfg(4);
    c.slot_size_mb = 2;
    if (small_dir) c.extra.as<Value::Map>().emplace_back("shm_dir", fs.dir());  // 4 MiB
    auto relay = make(c);
    ASSERT_TRUE(relay);
    auto conn = [&] { return *relay->health().find("connector"); };
    EXPECT_EQ(conn().find("arena_reserved")->as<uint64_t>(), 0u);
    EXPECT_TRUE(relay->sender_info().is_nil());  // shared memory: nothing to connect to
    ASSERT_OK(relay->connect(Value(), 1));
    std::vector<std::vector<std::byte>> sent;
    std::vector<RelayOp> ops;
    Status failed;
    for (uint8_t i = 0; i < 4; ++i) {
      auto d = pattern(1 << 20, i);
      auto op = relay->put_async(bytes_payload(d), {.edge = "e"});
      if (!op.ok()) {
        failed = std::move(op).error();
        break;
      }
      if (i == 0) {
        EXPECT_EQ(conn().find("arena_bytes")->as<uint64_t>(), 8u << 20);
        EXPECT_EQ(conn().find("arena_reserved")->as<uint64_t>(), 2u << 20);
      }
      sent.push_back(std::move(d));
      ops.push_back(std::move(op).value());
    }
    if (small_dir) {
      ASSERT_FALSE(failed.ok()) << "4 MiB of puts fit in a 4 MiB tmpfs beside the directory";
      EXPECT_EQ(failed.error().code, Errc::exhausted);
      EXPECT_NE(failed.error().message.find("no space"), std::string::npos) << failed.error().message;
    } else {
      ASSERT_TRUE(failed.ok()) << failed.error().message;
    }
    ASSERT_GE(sent.size(), 1u);
    for (size_t i = 0; i < sent.size(); ++i) {
      std::vector<std::byte> out(sent[i].size());
      auto g = relay->get_async(ops[i].metadata(), {.dest = out});
      ASSERT_TRUE(g.ok()) << g.error().message;
      ASSERT_TRUE(g->wait(5).ok());
      EXPECT_EQ(out, sent[i]);
    }
  }
}

// The ucx backend: the relay on the transfer engine; credits come back when the receiver pulled.
TEST(Relay, UcxBackendMovesPayloadsAndReturnsCreditsWhenPulled) {
  auto ucx_cfg = [] {
    RelayConfig c;
    Value::Map m;
    m.emplace_back("backend", "ucx");
    m.emplace_back("credits", uint64_t(1));
    m.emplace_back("timeout_s", 0.5);
    Value::Map x;
    x.emplace_back("host", "127.0.0.1");
    x.emplace_back("zmq_port", uint64_t(0));
    x.emplace_back("memory_pool_size", uint64_t(64) << 20);
    m.emplace_back("extra", Value(std::move(x)));
    return RelayConfig::from_value(Value(std::move(m))).value();
  };
  auto a = make(ucx_cfg());
  auto b = make(ucx_cfg());
  ASSERT_TRUE(a && b);
  // Connected ahead (what a pipeline's start-up does): the first get then goes over UCX.
  const Value info = a->sender_info();
  ASSERT_TRUE(info.find("source_host") && info.find("source_port"));
  ASSERT_OK(b->connect(info, 5));
  const auto data = pattern(3 << 20, 11);
  auto op = a->put_async(bytes_payload(data), {.request_id = "r", .edge = "b"});
  ASSERT_TRUE(op.ok()) << op.error().message;
  auto blocked = a->put_async(bytes_payload(data), {.request_id = "r", .edge = "b"});
  ASSERT_FALSE(blocked.ok());  // one credit, held until the receiver pulls
  EXPECT_EQ(blocked.error().code, Errc::exhausted);
  auto g = b->get_async(op->metadata());
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload().tensors[0].data), checksum(data));
  const Value bh = b->health();
  const Value* bc = bh.find("connector");
  EXPECT_EQ(bc->find("connects")->as<uint64_t>(), 1u);
  EXPECT_EQ(bc->find("gets_over_side_channel")->as<uint64_t>(), 0u);
  EXPECT_EQ(bc->find("gets_over_ucx")->as<uint64_t>(), 1u);
  EXPECT_TRUE(op->wait(2).ok());
  EXPECT_TRUE(a->put_async(bytes_payload(data), {.request_id = "r", .edge = "b"}).ok());
  EXPECT_EQ(a->cleanup("r"), 1u);
  // put_segments where the connector lends no memory: one owned buffer, put as any payload.
  const auto seg = pattern(1000, 12);
  std::vector<RelaySegment> segs{{64, seg}};
  auto sp = a->put_segments(segs, 2048, {.edge = "b"});
  ASSERT_TRUE(sp.ok()) << sp.error().message;
  std::vector<std::byte> dest(2048, std::byte{0x5a});
  auto sg = b->get_async(sp->metadata(), {.dest = std::span<std::byte>(dest)});
  ASSERT_TRUE(sg.ok()) << sg.error().message;
  EXPECT_EQ(std::memcmp(dest.data() + 64, seg.data(), seg.size()), 0);
  EXPECT_EQ(dest[0], std::byte{0});
  EXPECT_EQ(dest[2047], std::byte{0});
  b->close();  // a closed relay connects to nothing
  Status st = b->connect(info, 1);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::closed);
}
