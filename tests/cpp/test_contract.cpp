// The connector contract (vLLM-Omni's put/get/cleanup/health/close by key), written once and run
// for every connector: shared memory, the transfer engine over loopback TCP, and the store against
// a redis-server the fixture starts. What only one connector does stays in its own file
// (test_shm.cpp, test_te.cpp, test_store.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "redis_util.hpp"
#include "stagelink/stagelink.hpp"
#include "util.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::pattern;
using testing_util::payload_of;

namespace {

// A sender and a receiver of one connector kind (the same connector where one object does both).
struct Pair {
  std::shared_ptr<void> keep;  // what the pair needs alive (a redis-server)
  std::unique_ptr<Connector> snd, rcv;
};

struct Kind {
  const char* name;
  // A fresh pair, or a reason to skip (empty: made).
  std::function<std::string(Pair&)> make;
  // The public capabilities it offers (docs/parity.md and the connector pages say which).
  bool lending, waiting_gets, arrivals, sender_link;
};

std::string make_shm(Pair& p) {
  static int n = 0;
  Value::Map m;
  m.emplace_back("namespace", "contract" + std::to_string(getpid()) + "_" + std::to_string(n++));
  m.emplace_back("arena_bytes", uint64_t(64u << 20));
  for (auto* c : {&p.snd, &p.rcv}) {
    auto made = create_connector("SharedMemoryConnector", Value(m));
    if (!made.ok()) return made.error().to_string();
    *c = std::move(made).value();
  }
  return {};
}

std::string make_te(Pair& p) {
  for (const char* role : {"sender", "receiver"}) {
    Value::Map m;
    m.emplace_back("host", "127.0.0.1");
    m.emplace_back("zmq_port", uint64_t(0));
    m.emplace_back("protocol", "tcp");
    m.emplace_back("memory_pool_size", uint64_t(64u << 20));
    m.emplace_back("role", role);
    m.emplace_back("timeout_s", 5.0);
    // Gets by key need it (or curve): by default only a get naming the put's metadata reads it.
    if (std::string(role) == "sender") m.emplace_back("serve_by_key", true);
    auto made = create_connector("TransferEngineConnector", Value(std::move(m)));
    if (!made.ok()) return made.error().to_string();
    (std::string(role) == "sender" ? p.snd : p.rcv) = std::move(made).value();
  }
  // A get by key asks this sender (vLLM-Omni's update_sender_info).
  const Value h = p.snd->health();
  uint64_t port = 0;
  if (const Value* v = h.find("zmq_port")) v->get_u64(port);
  if (!p.rcv->capability<SenderLink>()->update_sender_info("127.0.0.1", int(port)).ok()) return "update_sender_info failed";
  return {};
}

std::string make_store(Pair& p) {
  if (!testing_util::have_redis_server()) return "redis-server is not installed (./scripts/setup installs it)";
  auto srv = std::make_shared<testing_util::RedisServer>();
  for (auto* c : {&p.snd, &p.rcv}) {
    Value::Map m;
    m.emplace_back("host", "127.0.0.1");
    m.emplace_back("port", uint64_t(srv->port()));
    m.emplace_back("timeout_ms", uint64_t(2000));
    auto made = create_connector("StoreConnector", Value(std::move(m)));
    if (!made.ok()) return made.error().to_string();
    *c = std::move(made).value();
  }
  p.keep = srv;
  return {};
}

const Kind kKinds[] = {{"SharedMemory", make_shm, true, true, true, false},
                       {"TransferEngine", make_te, false, false, false, true},
                       {"Store", make_store, false, true, false, false}};

class Contract : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    const std::string why = GetParam().make(p_);
    if (!why.empty()) GTEST_SKIP() << why;
  }
  void TearDown() override {
    if (p_.rcv) p_.rcv->close();
    if (p_.snd) p_.snd->close();
  }
  Connector& snd() { return *p_.snd; }
  Connector& rcv() { return *p_.rcv; }
  Pair p_;
};

bool same_bytes(const GetResult& g, const std::vector<std::byte>& d) {
  return g.payload.tensors.size() == 1 && g.payload.tensors[0].nbytes() == d.size() &&
         checksum(g.payload.tensors[0].data) == checksum(d);
}

TEST_P(Contract, PutThenGetByMetadataReturnsTheBytesAtEverySize) {
  uint32_t seed = 1;
  for (size_t n : {size_t(0), size_t(1), size_t(4096), size_t(65537), size_t(3u << 20) + 5}) {
    const auto d = pattern(n, seed++);
    const std::string key = "sz" + std::to_string(n);
    auto pr = snd().put("0", "1", key, payload_of(d));
    ASSERT_TRUE(pr.ok()) << n << ": " << pr.error().to_string();
    auto g = rcv().get("0", "1", key, &pr->metadata, deadline_after(5), {});
    ASSERT_TRUE(g.ok()) << n << ": " << g.error().to_string();
    EXPECT_TRUE(same_bytes(*g, d)) << n;
  }
}

TEST_P(Contract, TheTreeAndEveryTensorComeBackAsPut) {
  const auto a = pattern(1000, 7), b = pattern(300000, 8);
  Payload p;
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(a), DType::f32, {250}));
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(b), DType::u8, {300, 1000}));
  Value::Map m;
  m.emplace_back("hidden", TensorRef{0});
  m.emplace_back("codes", TensorRef{1});
  m.emplace_back("step", int64_t(3));
  m.emplace_back("name", "talker");
  p.tree = Value(std::move(m));
  auto pr = snd().put("0", "1", "tree", p);
  ASSERT_TRUE(pr.ok()) << pr.error().to_string();
  auto g = rcv().get("0", "1", "tree", &pr->metadata, deadline_after(5), {});
  ASSERT_TRUE(g.ok()) << g.error().to_string();
  const Payload& q = g->payload;
  ASSERT_EQ(q.tensors.size(), 2u);
  EXPECT_EQ(q.tensors[0].dtype, DType::f32);
  EXPECT_EQ(q.tensors[1].shape, (std::vector<int64_t>{300, 1000}));
  EXPECT_EQ(checksum(q.tensors[0].data), checksum(a));
  EXPECT_EQ(checksum(q.tensors[1].data), checksum(b));
  int64_t step = 0;
  ASSERT_TRUE(q.tree.find("step") && q.tree.find("step")->get_i64(step));
  EXPECT_EQ(step, 3);
  EXPECT_EQ(q.tree.find("name")->as<std::string>(), "talker");
}

TEST_P(Contract, AGetByKeyWaitsForThePutOrItsDeadline) {
  const auto d = pattern(70000, 3);
  Result<GetResult> got = make_error(Errc::io, "not run");
  std::thread getter([&] { got = rcv().get("0", "1", "late", nullptr, deadline_after(5), {}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_TRUE(snd().put("0", "1", "late", payload_of(d)).ok());
  getter.join();
  ASSERT_TRUE(got.ok()) << got.error().to_string();
  EXPECT_TRUE(same_bytes(*got, d));
  // Never put: one attempt is not_found; a deadline is a timeout, kept to.
  auto none = rcv().get("0", "1", "never", nullptr, kNoWait, {});
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(none.error().code == Errc::not_found || none.error().code == Errc::timeout) << none.error().to_string();
  const auto t0 = Clock::now();
  auto late = rcv().get("0", "1", "never", nullptr, deadline_after(0.3), {});
  ASSERT_FALSE(late.ok());
  EXPECT_TRUE(late.error().code == Errc::timeout || late.error().code == Errc::not_found) << late.error().to_string();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
}

TEST_P(Contract, FanOutServesExactlyItsReaders) {
  const auto d = pattern(200000, 4);
  PutOptions po;
  po.readers = 2;
  auto pr = snd().put("0", "1", "fan", payload_of(d), po);
  ASSERT_TRUE(pr.ok()) << pr.error().to_string();
  for (int i = 0; i < 2; ++i) {
    auto g = rcv().get("0", "1", "fan", &pr->metadata, deadline_after(5), {});
    ASSERT_TRUE(g.ok()) << i << ": " << g.error().to_string();
    EXPECT_TRUE(same_bytes(*g, d));
  }
  auto third = rcv().get("0", "1", "fan", &pr->metadata, kNoWait, {});
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.error().code, Errc::not_found) << third.error().to_string();
}

TEST_P(Contract, CleanupFreesExactlyTheRequestsPuts) {
  PutOptions tied;
  tied.request_id = "R";
  ASSERT_TRUE(snd().put("0", "1", "R_chunk_0", payload_of(pattern(100, 1)), tied).ok());
  ASSERT_TRUE(snd().put("0", "1", "R_chunk_1", payload_of(pattern(2u << 20, 2)), tied).ok());
  ASSERT_TRUE(snd().put("0", "1", "R", payload_of(pattern(100, 3))).ok());
  const auto keep = pattern(100, 4);
  auto other = snd().put("0", "1", "R_1", payload_of(keep));  // not tied to R: stays
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(snd().cleanup("R"), 3u);
  for (const char* k : {"R_chunk_0", "R_chunk_1", "R"})
    EXPECT_FALSE(rcv().get("0", "1", k, nullptr, kNoWait, {}).ok()) << k;
  auto g = rcv().get("0", "1", "R_1", &other->metadata, deadline_after(5), {});
  ASSERT_TRUE(g.ok()) << g.error().to_string();
  EXPECT_TRUE(same_bytes(*g, keep));
}

TEST_P(Contract, AnotherPutsMetadataNeverReadsThatPayload) {
  const auto a = pattern(150000, 5), b = pattern(150000, 6);
  auto pa = snd().put("0", "1", "A", payload_of(a));
  auto pb = snd().put("0", "1", "B", payload_of(b));
  ASSERT_TRUE(pa.ok() && pb.ok());
  auto wrong = rcv().get("0", "1", "B", &pa->metadata, kNoWait, {});  // A's metadata for key B
  if (wrong.ok()) EXPECT_TRUE(same_bytes(*wrong, b)) << "key B read A's payload";
  else EXPECT_TRUE(wrong.error().code == Errc::corrupt || wrong.error().code == Errc::not_found ||
                   wrong.error().code == Errc::invalid_argument) << wrong.error().to_string();
  Value::Map junk;  // this connector's field names with values of the wrong types
  for (const char* k : {"entry", "gen", "inline", "source_host", "source_port", "data_size", "key", "generation"})
    junk.emplace_back(k, "??");
  const Value bad(std::move(junk));
  auto g = rcv().get("0", "1", "A", &bad, kNoWait, {});
  if (g.ok()) EXPECT_TRUE(same_bytes(*g, a));  // ignored as foreign metadata: found by key
  else EXPECT_TRUE(g.error().code == Errc::corrupt || g.error().code == Errc::not_found ||
                   g.error().code == Errc::invalid_argument) << g.error().to_string();
}

TEST_P(Contract, BadKeysAreRefusedAtPut) {
  for (const std::string& k : {std::string(""), std::string("a/b"), std::string(".."), std::string("x\n")}) {
    auto pr = snd().put("0", "1", k, payload_of(pattern(10, 1)));
    ASSERT_FALSE(pr.ok()) << "key '" << k << "'";
    EXPECT_EQ(pr.error().code, Errc::invalid_argument) << pr.error().to_string();
  }
}

TEST_P(Contract, HealthCountsPutsAndGets) {
  const uint64_t puts0 = snd().health().find("puts")->as<uint64_t>();
  auto pr = snd().put("0", "1", "h", payload_of(pattern(5000, 1)));
  ASSERT_TRUE(pr.ok());
  const uint64_t gets0 = rcv().health().find("gets")->as<uint64_t>();
  ASSERT_TRUE(rcv().get("0", "1", "h", &pr->metadata, deadline_after(5), {}).ok());
  EXPECT_EQ(snd().health().find("puts")->as<uint64_t>(), puts0 + 1);
  EXPECT_EQ(rcv().health().find("gets")->as<uint64_t>(), gets0 + 1);
}

TEST_P(Contract, CloseEndsEveryLaterCallAndMayBeRepeated) {
  auto pr = snd().put("0", "1", "c", payload_of(pattern(100, 1)));
  ASSERT_TRUE(pr.ok());
  rcv().close();
  auto g = rcv().get("0", "1", "c", &pr->metadata, kNoWait, {});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, Errc::closed) << g.error().to_string();
  snd().close();
  snd().close();
  auto p2 = snd().put("0", "1", "c2", payload_of(pattern(100, 1)));
  ASSERT_FALSE(p2.ok());
  EXPECT_EQ(p2.error().code, Errc::closed) << p2.error().to_string();
}

TEST_P(Contract, OffersExactlyItsCapabilities) {
  const Kind& k = GetParam();
  EXPECT_EQ(snd().capability<Lending>() != nullptr, k.lending);
  EXPECT_EQ(snd().capability<WaitingGets>() != nullptr, k.waiting_gets);
  EXPECT_EQ(snd().capability<ArrivalSignals>() != nullptr, k.arrivals);
  EXPECT_EQ(snd().capability<SenderLink>() != nullptr, k.sender_link);
  if (auto* l = snd().capability<Lending>()) {  // a loan is a put written in place
    const TensorSpec spec{DType::u8, {4096}, 4096, "cpu"};
    auto loan = l->loan(Value(TensorRef{0}), std::span<const TensorSpec>(&spec, 1));
    ASSERT_TRUE(loan.ok()) << loan.error().to_string();
    const auto d = pattern(4096, 11);
    std::memcpy(loan->region(0).data(), d.data(), d.size());
    auto pr = l->put_loan("0", "1", "loaned", std::move(loan).value());
    ASSERT_TRUE(pr.ok()) << pr.error().to_string();
    auto g = rcv().get("0", "1", "loaned", &pr->metadata, deadline_after(5), {});
    ASSERT_TRUE(g.ok()) << g.error().to_string();
    EXPECT_TRUE(same_bytes(*g, d));
  }
}

INSTANTIATE_TEST_SUITE_P(Connectors, Contract, ::testing::ValuesIn(kKinds),
                         [](const ::testing::TestParamInfo<Kind>& i) { return std::string(i.param.name); });

}  // namespace
