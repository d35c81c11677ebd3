// TransferEngineConnector over UCX (TCP on loopback): payloads verified end to end, across
// processes, bad input, failures. The contract every connector keeps (fan-out, cleanup, close, ...)
// is test_contract.cpp's.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <zmq.hpp>

#include "connectors/names.hpp"
#include "stagelink/stagelink.hpp"
#include "util.hpp"
#include "cuda/driver.hpp"
#include "ucx/engine.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::pattern;
using testing_util::payload_of;
using testing_util::wait_child;

namespace {
Value te_extra(const std::string& role, int port = 0, size_t pool = 256u << 20, unsigned lanes = 1,
               bool serve_by_key = false) {
  Value::Map m;
  if (serve_by_key) m.emplace_back("serve_by_key", true);
  m.emplace_back("lanes", uint64_t(lanes));
  m.emplace_back("host", "127.0.0.1");
  m.emplace_back("zmq_port", uint64_t(port));
  m.emplace_back("protocol", "tcp");
  m.emplace_back("memory_pool_size", uint64_t(pool));
  m.emplace_back("role", role);
  m.emplace_back("timeout_s", 5.0);
  return Value(std::move(m));
}
std::unique_ptr<Connector> te(const std::string& role, int port = 0, size_t pool = 256u << 20, unsigned lanes = 1) {
  auto c = create_connector("TransferEngineConnector", te_extra(role, port, pool, lanes));
  EXPECT_TRUE(c.ok()) << (c.ok() ? "" : c.error().message);
  return c.ok() ? std::move(c).value() : nullptr;
}
uint64_t port_of(const Value& md) {
  uint64_t p = 0;
  md.find("source_port")->get_u64(p);
  return p;
}
}  // namespace

TEST(TransferEngine, SizesFromZeroVerifiedEndToEnd) {
  auto snd = te("sender");
  auto rcv = te("receiver");
  ASSERT_TRUE(snd && rcv);
  for (size_t size : {size_t(0), size_t(1), size_t(4096), size_t(1) << 20, size_t(64) << 20}) {
    const auto data = pattern(size, uint32_t(size));
    auto pr = snd->put("0", "1", "req-" + std::to_string(size), payload_of(data));
    ASSERT_TRUE(pr.ok()) << pr.error().message;
    const Value& md = pr->metadata;
    EXPECT_EQ(md.find("source_host")->as<std::string>(), "127.0.0.1");
    EXPECT_TRUE(md.find("is_fast_path")->as<bool>());
    for (bool view : {false}) {
      GetOptions go;
      go.zero_copy = view;
      auto g = rcv->get("0", "1", "req-" + std::to_string(size), &md, kNoWait, go);
      ASSERT_TRUE(g.ok()) << size << ": " << g.error().message;
      ASSERT_EQ(g->payload.tensors.size(), 1u);
      EXPECT_EQ(g->payload.tensors[0].nbytes(), size);
      EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data)) << size;
    }
  }
  Value h = snd->health();
  EXPECT_EQ(h.find("outstanding")->as<uint64_t>(), 0u);  // every put read once: freed
  EXPECT_NE(h.find("ucx")->find("transports")->as<std::string>().find("tcp"), std::string::npos)
      << h.find("ucx")->find("transports")->as<std::string>();
}

// The receiver is forked before this process starts UCX (a child must not inherit a running
// engine); the metadata of 400 puts reaches it through a pipe.
TEST(TransferEngine, FourHundredBackToBackAcrossProcessesNoneTorn) {
  constexpr int kN = 400;
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    ::close(fds[1]);
    auto rcv = create_connector("TransferEngineConnector", te_extra("receiver"));
    if (!rcv.ok()) _exit(2);
    int bad = 0;
    for (int i = 0; i < kN; ++i) {
      uint32_t n = 0;
      uint64_t sum = 0;
      if (read(fds[0], &sum, 8) != 8 || read(fds[0], &n, 4) != 4) _exit(3);
      std::vector<std::byte> buf(n);
      size_t got = 0;
      while (got < n) {
        ssize_t r = read(fds[0], buf.data() + got, n - got);
        if (r <= 0) _exit(4);
        got += size_t(r);
      }
      auto md = value_from_msgpack(buf).value();
      auto g = rcv.value()->get("0", "1", "k" + std::to_string(i), &md, kNoWait, {});
      if (!g.ok() || checksum(g->payload.tensors[0].data) != sum) ++bad;
    }
    rcv.value()->close();
    _exit(bad == 0 ? 0 : 10 + std::min(bad, 100));
  }
  ::close(fds[0]);
  auto snd = te("sender");
  ASSERT_TRUE(snd);
  for (int i = 0; i < kN; ++i) {
    const auto d = pattern(size_t(4096) + size_t(i) * 997 % (300 << 10), uint32_t(i));
    auto pr = snd->put("0", "1", "k" + std::to_string(i), payload_of(d));
    ASSERT_TRUE(pr.ok()) << pr.error().message;
    const auto md = value_to_msgpack(pr->metadata);
    const uint64_t sum = checksum(d);
    const uint32_t n = uint32_t(md.size());
    ASSERT_EQ(write(fds[1], &sum, 8), 8);
    ASSERT_EQ(write(fds[1], &n, 4), 4);
    ASSERT_EQ(write(fds[1], md.data(), n), ssize_t(n));
  }
  EXPECT_EQ(wait_child(pid), 0);  // 0 torn or failed of 400
  ::close(fds[1]);
}

TEST(TransferEngine, GetWithoutMetadataAsksTheSenderGivenByUpdateSenderInfo) {
  // A sender serves gets naming only the key when asked to (extra.serve_by_key; or with curve).
  auto made = create_connector("TransferEngineConnector", te_extra("sender", 0, 256u << 20, 1, true));
  ASSERT_TRUE(made.ok()) << made.error().message;
  auto snd = std::move(made).value();
  auto rcv = te("receiver");
  const uint64_t port = snd->health().find("zmq_port")->as<uint64_t>();
  auto none = rcv->get("0", "1", "later", nullptr, kNoWait, {});
  EXPECT_EQ(none.error().code, Errc::not_found);  // no sender known
  ASSERT_TRUE(rcv->capability<SenderLink>()->update_sender_info("127.0.0.1", int(port)).ok());
  EXPECT_EQ(rcv->capability<SenderLink>()->update_sender_info("", 0).error().code, Errc::invalid_argument);
  const auto d = pattern(100000, 8);
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(snd->put("0", "1", "later", payload_of(d)).ok());
  });
  auto g = rcv->get("0", "1", "later", nullptr, deadline_after(5), {});  // waits for the put
  late.join();
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
  auto gone = rcv->get("0", "1", "never", nullptr, deadline_after(0.2), {});
  EXPECT_EQ(gone.error().code, Errc::not_found);
  // keep_waiting (Ctrl-C from Python) ends the wait for a put the sender does not have yet.
  int asked = 0;
  GetOptions stop;
  stop.keep_waiting = [&] { return ++asked < 3; };
  const auto t0 = Clock::now();
  auto ended = rcv->get("0", "1", "never", nullptr, deadline_after(30), stop);
  EXPECT_EQ(ended.error().code, Errc::cancelled) << ended.error().message;
  EXPECT_EQ(asked, 3);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
}

TEST(TransferEngine, ReceiverPullsFromTwoSendersAtOnce) {
  auto s1 = te("sender");
  auto s2 = te("sender");
  auto rcv = te("receiver");
  const auto a = pattern(2 << 20, 1), b = pattern(3 << 20, 2);
  auto p1 = s1->put("0", "2", "x", payload_of(a));
  auto p2 = s2->put("1", "2", "x", payload_of(b));
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_NE(port_of(p1->metadata), port_of(p2->metadata));
  Result<GetResult> g1 = make_error(Errc::io, ""), g2 = make_error(Errc::io, "");
  std::thread t([&] { g1 = rcv->get("0", "2", "x", &p1->metadata, kNoWait, {}); });
  g2 = rcv->get("1", "2", "x", &p2->metadata, kNoWait, {});
  t.join();
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_EQ(checksum(g1->payload.tensors[0].data), checksum(a));
  EXPECT_EQ(checksum(g2->payload.tensors[0].data), checksum(b));
}

TEST(TransferEngine, BadInputAndFailuresAreClearErrors) {
  auto snd = te("sender", 0, 1 << 20);
  auto rcv = te("receiver");
  ASSERT_TRUE(snd && rcv);
  // A taken port: named.
  const uint64_t port = snd->health().find("zmq_port")->as<uint64_t>();
  auto dup = create_connector("TransferEngineConnector", te_extra("sender", int(port)));
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.error().message.find(std::to_string(port)), std::string::npos) << dup.error().message;
  // memory_pool_device: cuda (the seed's key) runs where there is a GPU (CUDA tensors staged
  // through the registered host pool; health says so and whether UCX moves GPU memory), and is
  // refused as unsupported, saying why, where there is none; an unknown device: invalid.
  for (const char* dev : {"cuda", "tpu"}) {
    Value e = te_extra("sender");
    e.as<Value::Map>().emplace_back("memory_pool_device", dev);
    auto g = create_connector("TransferEngineConnector", e);
    if (std::string(dev) == "tpu") {
      ASSERT_FALSE(g.ok());
      EXPECT_EQ(g.error().code, Errc::invalid_argument) << g.error().message;
      continue;
    }
    auto drv = cuda::driver();
    if (!drv.ok()) {
      ASSERT_FALSE(g.ok());
      EXPECT_EQ(g.error().code, Errc::unsupported);
      EXPECT_NE(g.error().message.find(drv.error().message), std::string::npos) << g.error().message;
      continue;
    }
    ASSERT_TRUE(g.ok()) << g.error().message;
    const Value h = (*g)->health();
    EXPECT_EQ(h.find("memory_pool_device")->as<std::string>(), "cuda");
    EXPECT_NE(h.find("ucx_cuda"), nullptr);
    (*g)->close();
  }
  EXPECT_EQ(snd->health().find("memory_pool_device")->as<std::string>(), "cpu");
  EXPECT_FALSE(snd->health().find("ucx_cuda")->as<bool>());  // Debian's UCX has no CUDA transport
  // Pool exhaustion: a payload over the pool.
  const auto big = pattern(2 << 20, 5);
  auto pb = snd->put("0", "1", "big", payload_of(big));
  ASSERT_FALSE(pb.ok());
  EXPECT_EQ(pb.error().code, Errc::exhausted);
  // Missing key; no metadata.
  const auto d = pattern(1000, 6);
  auto pr = snd->put("0", "1", "k", payload_of(d));
  ASSERT_TRUE(pr.ok());
  auto nf = rcv->get("0", "1", "other", &pr->metadata, kNoWait, {});
  ASSERT_FALSE(nf.ok());
  EXPECT_EQ(nf.error().code, Errc::not_found);
  auto nomd = rcv->get("0", "1", "k", nullptr, kNoWait, {});
  ASSERT_FALSE(nomd.ok());
  EXPECT_EQ(nomd.error().code, Errc::not_found);
  Value::Map bad;
  bad.emplace_back("source_host", uint64_t(3));
  bad.emplace_back("source_port", uint64_t(1));
  const Value bad_md(std::move(bad));
  auto corrupt = rcv->get("0", "1", "k", &bad_md, kNoWait, {});
  EXPECT_EQ(corrupt.error().code, Errc::corrupt);
  // Malformed side-channel messages: answered with errors; the sender goes on.
  zmq::context_t ctx(1);
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, 2000);
  s.connect("tcp://127.0.0.1:" + std::to_string(port));
  for (std::string junk : {std::string("\xc1\x00garbage"), std::string("\x81\xa2op\xa4pull"), std::string(300, '\xff')}) {
    s.send(zmq::buffer(junk), zmq::send_flags::none);
    zmq::message_t m;
    ASSERT_TRUE(s.recv(m, zmq::recv_flags::none));
    auto v = value_from_msgpack(std::span<const std::byte>(static_cast<const std::byte*>(m.data()), m.size()));
    ASSERT_TRUE(v.ok());
    EXPECT_FALSE(v->find("ok")->as<bool>());
  }
  // Worker addresses that are not one a live engine sent (random bytes; a real one truncated or
  // with a byte changed), in a connect's hello: an error reply naming it, never an abort inside
  // UCX (regression: random bytes failed an assertion in ucp_ep_create and killed the sender).
  auto ask = [&](Value::Map req) {
    const auto bytes = value_to_msgpack(Value(std::move(req)));
    s.send(zmq::buffer(bytes.data(), bytes.size()), zmq::send_flags::none);
    zmq::message_t m;
    EXPECT_TRUE(s.recv(m, zmq::recv_flags::none));
    auto v = value_from_msgpack(std::span<const std::byte>(static_cast<const std::byte*>(m.data()), m.size()));
    EXPECT_TRUE(v.ok());
    return v.ok() ? std::move(v).value() : Value();
  };
  // Safe by default (issue 61): a stranger who knows (or guesses) a key but not the put's
  // metadata gets nothing. Before, the side channel answered any query and pull by key, and the
  // real receiver then found its put gone.
  const std::string ik = make_internal_key("k", "0", "1");
  const Value no_cap = ask({{"op", Value("query")}, {"key", Value(ik)}});
  EXPECT_EQ(no_cap.find("code")->as<std::string>(), "permission_denied");
  const Value pull_no_cap = ask({{"op", Value("pull")}, {"key", Value(ik)}, {"len", Value(uint64_t(1000))},
                                 {"worker", Value::copy_bytes(std::vector<std::byte>(8, std::byte(1)))},
                                 {"token", Value(uint64_t(7))}, {"inline_max", Value(uint64_t(1 << 16))}});
  EXPECT_EQ(pull_no_cap.find("code")->as<std::string>(), "permission_denied");
  EXPECT_EQ(pull_no_cap.find("data"), nullptr);
  const Value wrong_cap = ask({{"op", Value("query")}, {"key", Value(ik)}, {"cap", Value(uint64_t(12345))}});
  EXPECT_EQ(wrong_cap.find("code")->as<std::string>(), "not_found");
  EXPECT_GE(snd->health().find("refused_pulls")->as<uint64_t>(), 2u);
  const Value q = ask({{"op", Value("query")}, {"key", Value(ik)}, {"cap", *pr->metadata.find("cap")}});
  ASSERT_TRUE(q.find("worker") && q.find("worker")->is<Value::Bytes>()) << "a query names the sender's engine";
  const auto real = q.find("worker")->as<Value::Bytes>();
  std::vector<std::vector<std::byte>> bad_workers;
  std::mt19937 rng(5);
  for (size_t n : {size_t(1), size_t(8), size_t(64), size_t(300)}) {
    bad_workers.emplace_back(n);
    for (auto& b : bad_workers.back()) b = std::byte(rng());
  }
  bad_workers.emplace_back(real.begin(), real.end() - 1);
  bad_workers.emplace_back(real.begin(), real.end());
  bad_workers.back()[real.size() / 2] ^= std::byte(1);
  // A pull naming a remote address and key to write to (the removed RMA path) instead of a
  // token: refused before anything is sent (regression: one naming the sender's own engine and
  // address 0x1000 made the sender write into itself and crash).
  const Value old_pull = ask({{"op", Value("pull")}, {"key", Value(make_internal_key("k", "0", "1"))},
                              {"addr", Value(uint64_t(0x1000))}, {"len", Value(uint64_t(1000))},
                              {"rkey", Value::copy_bytes(std::vector<std::byte>(40, std::byte(0x5a)))},
                              {"worker", Value::copy_bytes(real)}});
  ASSERT_TRUE(old_pull.find("ok"));
  EXPECT_FALSE(old_pull.find("ok")->as<bool>());
  EXPECT_EQ(old_pull.find("code")->as<std::string>(), "corrupt");
  for (const auto& w : bad_workers) {
    const Value r = ask({{"op", Value("hello")}, {"key", Value("")}, {"worker", Value::copy_bytes(w)}});
    ASSERT_TRUE(r.find("ok")) << w.size();
    EXPECT_FALSE(r.find("ok")->as<bool>()) << w.size();
    EXPECT_EQ(r.find("code")->as<std::string>(), "corrupt") << w.size();
  }
  auto g = rcv->get("0", "1", "k", &pr->metadata, kNoWait, {});
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
  // cleanup frees unread puts; close is idempotent.
  ASSERT_TRUE(snd->put("0", "1", "c1", payload_of(d)).ok());
  EXPECT_EQ(snd->cleanup("c1"), 1u);
  snd->close();
  snd->close();
}

// Regression: with the data moved by a put (RMA emulated over TCP), UCX 1.13 aborted the
// receiving process in about 1 run in 4 when the sender died mid-put (ucp_put_handler: "Fatal:
// unexpected error: Endpoint timeout"). Active messages complete the receive with an error.
uint64_t counter(Connector& c, const char* k) { return c.health().find(k)->as<uint64_t>(); }

// After the first pull from a sender (over the side channel, whose reply names the sender's
// engine), pulls go as UCX messages; payloads split over several lanes arrive whole.
TEST(TransferEngine, LaterPullsGoOverUcxAndLanesSplitPayloads) {
  for (unsigned lanes : {1u, 4u}) {
    auto snd = te("sender", 0, 256u << 20, lanes);
    auto rcv = te("receiver");
    ASSERT_TRUE(snd && rcv);
    int n = 0;
    for (size_t size : {size_t(3), size_t(4096), size_t(1 << 20) + 7, size_t(16 << 20) + 1, size_t(0), size_t(70000)}) {
      const auto data = pattern(size, uint32_t(size + lanes));
      const std::string key = "k" + std::to_string(n++);
      auto pr = snd->put("0", "1", key, payload_of(data));
      ASSERT_TRUE(pr.ok()) << pr.error().message;
      auto g = rcv->get("0", "1", key, &pr->metadata, kNoWait, {});
      ASSERT_TRUE(g.ok()) << lanes << " lanes, " << size << ": " << g.error().message;
      EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data)) << lanes << " lanes, " << size;
    }
    EXPECT_EQ(counter(*rcv, "gets_over_side_channel"), 1u) << lanes;
    EXPECT_EQ(counter(*rcv, "gets_over_ucx"), 5u) << lanes;
    // The sender's side of the last pull completes on its own thread, just after the receiver's.
    for (int i = 0; i < 200 && counter(*snd, "outstanding") != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(counter(*snd, "outstanding"), 0u);
    // A key the sender no longer has: its error comes back over UCX at once, not a timeout.
    auto pr = snd->put("0", "1", "once", payload_of(pattern(100, 1)));
    ASSERT_TRUE(pr.ok());
    ASSERT_TRUE(rcv->get("0", "1", "once", &pr->metadata, kNoWait, {}).ok());
    const auto t0 = Clock::now();
    auto again = rcv->get("0", "1", "once", &pr->metadata, kNoWait, {});
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.error().code, Errc::not_found) << again.error().to_string();
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
    EXPECT_EQ(rcv->health().find("ucx")->find("pool_used")->as<uint64_t>(), 0u);
  }
}

// connect() sets up ahead of the first get what that get would (side channel, the sender's
// endpoints on every lane, the receiver's for pull requests): the first get then already goes
// over UCX, as later ones do. Bad or unreachable senders are clear errors within the deadline.
TEST(TransferEngine, ConnectSetsUpTheFirstGetsPathAhead) {
  auto snd = te("sender", 0, 256u << 20, 4);
  auto rcv = te("receiver");
  ASSERT_TRUE(snd && rcv);
  EXPECT_TRUE(rcv->capability<SenderLink>()->sender_info().is_nil());  // a receiver serves nothing
  const Value info = snd->capability<SenderLink>()->sender_info();
  ASSERT_TRUE(info.find("source_host") && info.find("source_port"));
  auto ucx_counter = [](Connector& c, const char* k) { return c.health().find("ucx")->find(k)->as<uint64_t>(); };
  EXPECT_EQ(ucx_counter(*snd, "endpoints"), 0u);
  Status st = rcv->capability<SenderLink>()->connect(info, deadline_after(5));
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_EQ(counter(*rcv, "connects"), 1u);
  EXPECT_EQ(ucx_counter(*snd, "endpoints"), 4u);  // one per lane
  EXPECT_EQ(ucx_counter(*rcv, "endpoints"), 1u);
  const auto data = pattern((4u << 20) + 3, 9);
  auto pr = snd->put("0", "1", "k", payload_of(data));
  ASSERT_TRUE(pr.ok()) << pr.error().message;
  auto g = rcv->get("0", "1", "k", &pr->metadata, kNoWait, {});
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data));
  EXPECT_EQ(counter(*rcv, "gets_over_side_channel"), 0u);  // without connect: 1
  EXPECT_EQ(counter(*rcv, "gets_over_ucx"), 1u);
  EXPECT_EQ(ucx_counter(*snd, "endpoints"), 4u);  // none made by the get
  EXPECT_TRUE(rcv->capability<SenderLink>()->connect(pr->metadata, deadline_after(5)).ok());  // a put's metadata works too
  // Nothing known: not_found. Malformed: corrupt. Nobody there: timeout at the deadline.
  auto other = te("receiver");
  ASSERT_TRUE(other);
  st = other->capability<SenderLink>()->connect(Value(), deadline_after(1));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::not_found) << st.error().to_string();
  Value::Map bad{{"source_host", Value("127.0.0.1")}, {"source_port", Value("x")}};
  st = other->capability<SenderLink>()->connect(Value(std::move(bad)), deadline_after(1));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::corrupt) << st.error().to_string();
  st = other->capability<SenderLink>()->connect(Value("127.0.0.1:5555"), deadline_after(1));  // not a map
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::corrupt) << st.error().to_string();
  Value gone_info;
  {
    auto gone = te("sender");  // its port, with nobody serving it any more
    ASSERT_TRUE(gone);
    gone_info = gone->capability<SenderLink>()->sender_info();
    gone->close();
  }
  const auto t0 = Clock::now();
  st = other->capability<SenderLink>()->connect(gone_info, deadline_after(0.5));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::timeout) << st.error().to_string();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
  // Connectors with nothing to connect: no info, and connect is ok.
  Value::Map shm_extra{{"namespace", Value("teconnect" + std::to_string(getpid()))}};
  auto shm = create_connector("SharedMemoryConnector", Value(std::move(shm_extra)));
  ASSERT_TRUE(shm.ok()) << shm.error().message;
  EXPECT_EQ(shm.value()->capability<SenderLink>(), nullptr);  // shared memory: no sender to reach, nothing to connect
  shm.value()->close();
}

// A sender that restarts on the same port has a new engine: the receiver's UCX path to the old
// one fails, and the pull goes by the side channel again (regression: it must not time out).
TEST(TransferEngine, SenderRestartedOnTheSamePortIsReachedAgain) {
  auto rcv = te("receiver");
  int port = 0;
  {
    auto a = te("sender");
    auto pr = a->put("0", "1", "x", payload_of(pattern(5000, 1)));
    ASSERT_TRUE(pr.ok());
    port = int(port_of(pr->metadata));
    ASSERT_TRUE(rcv->get("0", "1", "x", &pr->metadata, kNoWait, {}).ok());
  }
  auto b = te("sender", port);
  ASSERT_TRUE(b);
  const auto data = pattern(300000, 2);
  auto pr = b->put("0", "1", "y", payload_of(data));
  ASSERT_TRUE(pr.ok());
  const auto t0 = Clock::now();
  auto g = rcv->get("0", "1", "y", &pr->metadata, kNoWait, {});
  ASSERT_TRUE(g.ok()) << g.error().to_string();
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 4.0);
  EXPECT_EQ(counter(*rcv, "gets_over_side_channel"), 2u);
}

// A put of a key right after its previous put was read: the sender's completion of that pull may
// still be on its way; the put waits for it instead of failing (regression: 'being transferred').
TEST(TransferEngine, PutOfAKeyJustReadWaitsForItsTransferToEnd) {
  auto snd = te("sender");
  auto rcv = te("receiver");
  for (int i = 0; i < 300; ++i) {
    const auto data = pattern(i % 2 ? 4096 : 300000, uint32_t(i));
    auto pr = snd->put("0", "1", "same", payload_of(data));
    ASSERT_TRUE(pr.ok()) << i << ": " << pr.error().to_string();
    auto g = rcv->get("0", "1", "same", &pr->metadata, kNoWait, {});
    ASSERT_TRUE(g.ok()) << i << ": " << g.error().to_string();
    ASSERT_EQ(checksum(g->payload.tensors[0].data), checksum(data)) << i;
  }
}

// The sender killed in the middle of a transfer: the get fails within its timeout and the pool
// region comes back. Two small gets connect the two first (the first pull goes over the side
// channel and the sender connects to send; the second is a UCX message, the receiver connecting),
// so the kill lands in the transfer: a peer that dies while UCX 1.13 is still setting up a
// connection can abort the survivor in UCX's own code (docs/te.md, "Known issues").
TEST(TransferEngine, SenderKilledMidTransferIsAnErrorWithinTheTimeout) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    auto s = create_connector("TransferEngineConnector", te_extra("sender"));
    if (!s.ok()) _exit(2);
    const auto small = pattern(4096, 3), d = pattern(200 << 20, 7);
    for (const auto& [key, data] : {std::pair{"warm0", &small}, std::pair{"warm1", &small}, std::pair{"huge", &d}}) {
      auto pr = s.value()->put("0", "1", key, payload_of(*data));
      if (!pr.ok()) _exit(3);
      const auto md = value_to_msgpack(pr->metadata);
      const uint32_t n = uint32_t(md.size());
      if (write(fds[1], &n, 4) != 4 || write(fds[1], md.data(), n) != ssize_t(n)) _exit(4);
    }
    pause();
    _exit(0);
  }
  auto read_md = [&] {
    uint32_t n = 0;
    EXPECT_EQ(read(fds[0], &n, 4), 4);
    std::vector<std::byte> buf(n);
    EXPECT_EQ(read(fds[0], buf.data(), n), ssize_t(n));
    return value_from_msgpack(buf).value();
  };
  const Value warm0 = read_md(), warm1 = read_md(), md = read_md();
  auto rcv = te("receiver");
  ASSERT_TRUE(rcv->get("0", "1", "warm0", &warm0, kNoWait, {}).ok());
  ASSERT_TRUE(rcv->get("0", "1", "warm1", &warm1, kNoWait, {}).ok());
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    kill(pid, SIGKILL);
  });
  const auto t0 = Clock::now();
  auto g = rcv->get("0", "1", "huge", &md, kNoWait, {});
  killer.join();
  waitpid(pid, nullptr, 0);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  if (g.ok()) GTEST_SKIP() << "the transfer finished before the kill (" << took << " s)";
  EXPECT_LT(took, 5.0 + 200.0 * 1048576 / 50e6 + 2);  // its timeout: base + size at 50 MB/s
  EXPECT_TRUE(g.error().code == Errc::timeout || g.error().code == Errc::peer_dead || g.error().code == Errc::io)
      << g.error().to_string();
  // The receiver's pool region came back.
  EXPECT_EQ(rcv->health().find("ucx")->find("pool_used")->as<uint64_t>(), 0u);
  close(fds[0]);
  close(fds[1]);
}

// A receiver killed in the middle of its pull: the sender survives, frees nothing it still owes
// others, and serves the next receiver. The child is forked before this process starts UCX.
void receiver_killed_mid_transfer() {
  int fds[2], ready[2];
  ASSERT_EQ(pipe(fds), 0);
  ASSERT_EQ(pipe(ready), 0);
  pid_t pid = fork();
  if (pid == 0) {
    ::close(fds[1]);
    ::close(ready[0]);
    uint32_t n = 0;
    if (read(fds[0], &n, 4) != 4) _exit(2);
    std::vector<std::byte> buf(n);
    if (read(fds[0], buf.data(), n) != ssize_t(n)) _exit(3);
    const Value md = value_from_msgpack(buf).value();
    auto rcv = create_connector("TransferEngineConnector", te_extra("receiver", 0, 512u << 20));
    if (!rcv.ok()) _exit(4);
    const char go = 1;
    if (write(ready[1], &go, 1) != 1) _exit(5);
    (void)rcv.value()->get("0", "1", "huge", &md, kNoWait, {});  // killed during this
    _exit(0);
  }
  ::close(fds[0]);
  auto snd = te("sender", 0, 512u << 20);
  ASSERT_TRUE(snd);
  const auto d = pattern(200 << 20, 9);
  // One reader: the killed one's read never completed, so it must be given back for the retry
  // below (a failed pull gives its reader back; issue 50's "a reader that dies loses nothing").
  auto pr = snd->put("0", "1", "huge", payload_of(d));
  ASSERT_TRUE(pr.ok());
  const auto md = value_to_msgpack(pr->metadata);
  const uint32_t n = uint32_t(md.size());
  ASSERT_EQ(write(fds[1], &n, 4), 4);
  ASSERT_EQ(write(fds[1], md.data(), n), ssize_t(n));
  ::close(ready[1]);
  char go = 0;
  ASSERT_EQ(read(ready[0], &go, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(40));  // its pull under way (200 MiB: ~100 ms)
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ::close(fds[1]);
  ::close(ready[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  if (snd->health().find("pulls_served")->as<uint64_t>() != 0)
    GTEST_SKIP() << "the pull completed before the kill landed";
  auto rcv = te("receiver", 0, 512u << 20);
  auto g = rcv->get("0", "1", "huge", &pr->metadata, kNoWait, {});
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
}

// Run in a process of its own, whose end is read here: UCX 1.13.1's TCP transport (Debian 12's)
// aborts the sender now and then (about 1 kill in 16 on a loaded 2-core host) on the dead
// receiver's last rendezvous acknowledgements (tcp_ep.c:939, `ep->flags &
// UCT_TCP_EP_FLAG_PUT_TX_WAITING_ACK`), inside ucp_worker_progress, where nothing of ours runs.
// That upstream abort is reported as a skip naming it (docs/te.md, "Known limits"); any other
// failure or crash of the sender fails the test.
TEST(TransferEngine, ReceiverKilledMidTransferLeavesTheSenderServing) {
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t pid = fork();
  if (pid == 0) {
    ::close(out[0]);
    dup2(out[1], 1);
    dup2(out[1], 2);
    receiver_killed_mid_transfer();
    std::fflush(nullptr);
    _exit(::testing::Test::HasFailure() ? 1 : ::testing::Test::IsSkipped() ? 77 : 0);
  }
  ::close(out[1]);
  std::string log;
  char buf[4096];
  for (ssize_t n; (n = read(out[0], buf, sizeof buf)) != 0;)
    if (n > 0) log.append(buf, size_t(n));
    else if (errno != EINTR) break;
  ::close(out[0]);
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  if (WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT && log.find("UCT_TCP_EP_FLAG_PUT_TX_WAITING_ACK") != std::string::npos)
    GTEST_SKIP() << "UCX's TCP transport aborted the sender on the killed receiver's acknowledgements "
                    "(an upstream UCX 1.13 assertion, docs/te.md):\n" << log;
  ASSERT_TRUE(WIFEXITED(st)) << "the sender died of signal " << (WIFSIGNALED(st) ? WTERMSIG(st) : 0) << ":\n" << log;
  if (WEXITSTATUS(st) == 77) GTEST_SKIP() << log;
  EXPECT_EQ(WEXITSTATUS(st), 0) << log;
}

// A pull over UCX is served only with the token the sender's side channel issued to that
// receiver's engine: a peer that reaches the sender's UCX worker some other way (its address is
// no secret to a host on the path) gets an error, and the put stays whole for its real reader.
TEST(TransferEngine, UcxPullsWithoutTheSideChannelsTokenAreRefused) {
  auto snd = te("sender");
  auto rcv = te("receiver");
  ASSERT_TRUE(snd && rcv);
  const auto data = pattern(1u << 20, 5);
  auto pr = snd->put("0", "1", "k", payload_of(data));
  ASSERT_TRUE(pr.ok());
  ucx::EngineOptions eo;
  eo.pool_bytes = 8u << 20;
  auto eve = ucx::Engine::create(eo);
  ASSERT_TRUE(eve.ok()) << eve.error().message;
  // Eve meets the side channel once (as anyone may without CURVE): the sender's worker address
  // and the token issued to Eve's engine.
  zmq::context_t ctx(1);
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.set(zmq::sockopt::rcvtimeo, 5000);
  d.connect("tcp://127.0.0.1:" + std::to_string(port_of(pr->metadata)));
  Value::Map hello{{"op", Value("hello")}, {"key", Value("")}, {"rq", Value(uint64_t(1))},
                   {"worker", Value::copy_bytes(eve.value()->worker_address())}};
  const auto hb = value_to_msgpack(Value(std::move(hello)));
  d.send(zmq::const_buffer(hb.data(), hb.size()));
  zmq::message_t rep;
  ASSERT_TRUE(d.recv(rep));
  auto rv = value_from_msgpack(std::span<const std::byte>(static_cast<const std::byte*>(rep.data()), rep.size()));
  ASSERT_TRUE(rv.ok());
  const auto sender = rv->find("worker")->as<Value::Bytes>();
  uint64_t issued = 0;
  ASSERT_TRUE(rv->find("auth") && rv->find("auth")->get_u64(issued));
  ASSERT_TRUE(eve.value()->connect(sender, 1, deadline_after(5)).ok());
  const std::string ik = pr->metadata.find("key") ? pr->metadata.find("key")->as<std::string>() : std::string();
  uint64_t size = 0;
  pr->metadata.find("data_size")->get_u64(size);
  auto pull = [&](std::optional<uint64_t> auth, uint64_t token) {
    auto keep = std::make_shared<int>(0);
    eve.value()->expect(token, eve.value()->pool_base(), size, keep);
    Value::Map m{{"key", Value(ik)}, {"len", Value(size)}, {"token", Value(token)},
                 {"worker", Value::copy_bytes(eve.value()->worker_address())}};
    if (auth) m.emplace_back("auth", *auth);
    const auto msg = value_to_msgpack(Value(std::move(m)));
    EXPECT_TRUE(eve.value()->request(sender, msg, deadline_after(5)).ok());
    Status st = eve.value()->wait_landed(token, deadline_after(5));
    eve.value()->forget(token);
    return st;
  };
  for (auto [auth, token] : {std::pair<std::optional<uint64_t>, uint64_t>{std::nullopt, 11}, {issued ^ 1, 12}}) {
    Status st = pull(auth, token);
    ASSERT_FALSE(st.ok()) << "served a pull without the issued token";
    EXPECT_EQ(st.error().code, Errc::permission_denied) << st.error().to_string();
  }
  EXPECT_EQ(counter(*snd, "refused_pulls"), 2u);
  auto g = rcv->get("0", "1", "k", &pr->metadata, kNoWait, {});  // the real reader: whole
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data));
  eve.value()->close();
}

// A hello naming a receiver engine that does not answer (a stopped process) used to hold the
// side channel, which serves every peer on one thread, for the whole connect timeout. The
// connect-back now runs off that thread: other receivers are served meanwhile.
TEST(TransferEngine, AHelloNamingAStoppedPeerHoldsUpNoOtherReceiver) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {  // an engine whose process then stops
    ucx::EngineOptions eo;
    eo.pool_bytes = 4u << 20;
    auto e = ucx::Engine::create(eo);
    if (!e.ok()) _exit(2);
    const auto& w = e.value()->worker_address();
    const uint32_t n = uint32_t(w.size());
    if (::write(fds[1], &n, 4) != 4 || ::write(fds[1], w.data(), n) != ssize_t(n)) _exit(3);
    raise(SIGSTOP);
    _exit(0);
  }
  uint32_t n = 0;
  ASSERT_EQ(read(fds[0], &n, 4), 4);
  std::vector<std::byte> stopped(n);
  ASSERT_EQ(read(fds[0], stopped.data(), n), ssize_t(n));
  close(fds[0]);
  close(fds[1]);
  auto snd = te("sender");
  ASSERT_TRUE(snd);
  const auto data = pattern(70000, 9);
  auto pr = snd->put("0", "1", "k", payload_of(data));
  ASSERT_TRUE(pr.ok());
  zmq::context_t ctx(1);
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.connect("tcp://127.0.0.1:" + std::to_string(port_of(pr->metadata)));
  Value::Map hello{{"op", Value("hello")}, {"key", Value("")}, {"rq", Value(uint64_t(1))},
                   {"worker", Value::copy_bytes(stopped)}};
  const auto hb = value_to_msgpack(Value(std::move(hello)));
  d.send(zmq::const_buffer(hb.data(), hb.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the connect-back is under way
  auto rcv = te("receiver");
  ASSERT_TRUE(rcv);
  const auto t0 = Clock::now();
  auto g = rcv->get("0", "1", "k", &pr->metadata, kNoWait, {});
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data));
  EXPECT_LT(took, 2.0) << "the side channel waited on the stopped peer";
  kill(pid, SIGKILL);  // its pending connect-back then fails, and close() joins it at once
  wait_child(pid);
}

// A hello's worker address comes from the peer and goes to UCX: garbage (random bytes, a real
// address cut short or with bytes flipped) is an error reply, never a crash of the sender, which
// then serves its real receiver as before.
TEST(TransferEngine, GarbageWorkerAddressesInAHelloAreErrorsNotCrashes) {
  auto snd = te("sender");
  auto rcv = te("receiver");
  ASSERT_TRUE(snd && rcv);
  const auto data = pattern(100000, 3);
  auto pr = snd->put("0", "1", "k", payload_of(data));
  ASSERT_TRUE(pr.ok());
  ucx::EngineOptions eo;
  eo.pool_bytes = 4u << 20;
  auto real = ucx::Engine::create(eo);
  ASSERT_TRUE(real.ok());
  const auto good = real.value()->worker_address();
  std::mt19937 rng(7);
  zmq::context_t ctx(1);
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.set(zmq::sockopt::rcvtimeo, 10000);
  d.connect("tcp://127.0.0.1:" + std::to_string(port_of(pr->metadata)));
  int answered = 0;
  for (int i = 0; i < 60; ++i) {
    std::vector<std::byte> w = good;
    if (i % 3 == 0) {  // random bytes of a random length
      w.resize(1 + rng() % 400);
      for (auto& b : w) b = std::byte(rng());
    } else if (i % 3 == 1) {  // cut short
      w.resize(1 + rng() % w.size());
    } else {  // bytes flipped
      for (int k = 0; k < 4; ++k) w[rng() % w.size()] ^= std::byte(1 + rng() % 255);
    }
    Value::Map hello{{"op", Value("hello")}, {"key", Value("")}, {"rq", Value(uint64_t(i))},
                     {"worker", Value::copy_bytes(w)}};
    const auto hb = value_to_msgpack(Value(std::move(hello)));
    d.send(zmq::const_buffer(hb.data(), hb.size()));
    zmq::message_t rep;
    if (d.recv(rep)) ++answered;
  }
  EXPECT_EQ(answered, 60);
  auto g = rcv->get("0", "1", "k", &pr->metadata, kNoWait, {});
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data));
  real.value()->close();
}
