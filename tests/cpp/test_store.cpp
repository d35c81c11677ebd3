// StoreConnector against redis-server instances the tests start (loopback ports they choose):
// round trips verified, blocking gets woken by the put, fan-out, cleanup leaving no key, TTL,
// corruption and truncation, wrong password, server down / killed / restarted, limits, cluster.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "redis_util.hpp"
#include "stagelink/stagelink.hpp"
#include "util.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::pattern;
using testing_util::payload_of;
using testing_util::RedisServer;

namespace {
Value store_extra(int port, Value::Map more = {}) {
  Value::Map m;
  m.emplace_back("host", "127.0.0.1");
  m.emplace_back("port", uint64_t(port));
  m.emplace_back("timeout_ms", uint64_t(2000));
  m.emplace_back("chunk_bytes", uint64_t(4u << 20));
  for (auto& kv : more) {  // a key given again replaces the default
    auto it = std::find_if(m.begin(), m.end(), [&](const auto& e) { return e.first == kv.first; });
    if (it != m.end()) it->second = std::move(kv.second);
    else m.push_back(std::move(kv));
  }
  return Value(std::move(m));
}
std::unique_ptr<Connector> store_conn(int port, Value::Map more = {}) {
  auto c = create_connector("StoreConnector", store_extra(port, std::move(more)));
  EXPECT_TRUE(c.ok()) << (c.ok() ? "" : c.error().to_string());
  return c.ok() ? std::move(c).value() : nullptr;
}
// A command on the server, for what the tests look at (DBSIZE, KEYS, SETRANGE, ...).
store::Reply admin(int port, std::vector<std::string> args, const std::string& password = "") {
  store::RedisOptions o;
  o.nodes = {{"127.0.0.1", port}};
  o.password = password;
  auto r = store::Redis::connect(o);
  if (!r.ok()) return nullptr;
  store::Cmd c;
  for (auto& a : args) c.arg(a);
  auto rs = (*r)->run("", std::span<const store::Cmd>(&c, 1), deadline_after(5));
  if (!rs.ok()) return nullptr;
  return std::move((*rs)[0]);
}
long long dbsize(int port) { return store::integer(admin(port, {"DBSIZE"})); }
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
// A get of `key` from `rcv` (until `dl`) while `snd` puts `d` under it `delay_ms` later.
struct LateGet {
  Result<GetResult> got = make_error(Errc::io, "not run");
  Clock::time_point put_done, returned;
};
LateGet get_put_later(Connector& snd, Connector& rcv, const std::string& key, const std::vector<std::byte>& d,
                      int delay_ms, Deadline dl, const GetOptions& go = {}) {
  LateGet out;
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    EXPECT_TRUE(snd.put("0", "1", key, payload_of(d)).ok());
    out.put_done = Clock::now();
  });
  out.got = rcv.get("0", "1", key, nullptr, dl, go);
  out.returned = Clock::now();
  producer.join();
  return out;
}
}  // namespace

#define NEED_REDIS() \
  if (!testing_util::have_redis_server()) GTEST_SKIP() << "redis-server is not installed (./scripts/setup installs it)"

TEST(Store, RoundTripsVerifiedAcrossProcessesAndNothingLeftBehind) {
  NEED_REDIS();
  RedisServer srv;
  const std::vector<size_t> sizes{0, 1, 4096, (1u << 20) + 3, (20u << 20) + 5};
  pid_t pid = fork();
  if (pid == 0) {  // the producer, in its own process
    auto c = create_connector("StoreConnector", store_extra(srv.port()));
    if (!c.ok()) _exit(2);
    for (size_t s : sizes)
      if (!c.value()->put("0", "1", "k" + std::to_string(s), payload_of(pattern(s, uint32_t(s)))).ok()) _exit(3);
    _exit(0);
  }
  auto rcv = store_conn(srv.port());
  ASSERT_TRUE(rcv);
  for (size_t s : sizes) {
    auto g = rcv->get("0", "1", "k" + std::to_string(s), nullptr, deadline_after(10), {});
    ASSERT_TRUE(g.ok()) << s << ": " << g.error().to_string();
    ASSERT_EQ(g->payload.tensors.size(), 1u);
    EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(pattern(s, uint32_t(s)))) << s;
  }
  EXPECT_EQ(testing_util::wait_child(pid), 0);
  // Read once (readers: 1): gone, chunks, meta, signal and the request index all.
  EXPECT_EQ(rcv->get("0", "1", "k4096", nullptr, kNoWait, {}).error().code, Errc::not_found);
  EXPECT_EQ(dbsize(srv.port()), 0);
  // The put returns no metadata: the store is the rendezvous.
  auto pr = rcv->put("0", "1", "x", payload_of(pattern(10, 1)));
  ASSERT_TRUE(pr.ok());
  EXPECT_TRUE(pr->metadata.is_nil());
}

// A server of the test's own and two connectors to it: a sender and a receiver.
class StorePair : public ::testing::Test {
 protected:
  void SetUp() override {
    NEED_REDIS();
    srv = std::make_unique<RedisServer>();
    rcv = store_conn(srv->port());
    snd = store_conn(srv->port());
    ASSERT_TRUE(rcv && snd);
  }
  std::unique_ptr<RedisServer> srv;
  std::unique_ptr<Connector> rcv, snd;
};

TEST_F(StorePair, BlockingGetIsWokenByThePutNotByPolling) {
  const auto t0 = Clock::now();
  LateGet g = get_put_later(*snd, *rcv, "late", pattern(5000, 3), 300, deadline_after(5));
  ASSERT_TRUE(g.got.ok()) << g.got.error().to_string();
  EXPECT_GT(since(t0), 0.25);
  EXPECT_LT(std::chrono::duration<double>(g.returned - g.put_done).count(), 0.1);  // woken, not a poll period later
  EXPECT_EQ(rcv->health().find("waits")->as<uint64_t>(), 1u);             // one wait, no retries
  // Nothing comes: the deadline, then timeout (None in Python).
  const auto t1 = Clock::now();
  auto none = rcv->get("0", "1", "never", nullptr, deadline_after(0.3), {});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, Errc::timeout);
  EXPECT_GT(since(t1), 0.28);
  EXPECT_LT(since(t1), 1.5);
}

TEST(Store, FanOutToThreeReadersThenGoneAndWaitersAllWoken) {
  NEED_REDIS();
  RedisServer srv;
  auto snd = store_conn(srv.port());
  std::vector<std::unique_ptr<Connector>> rs;
  for (int i = 0; i < 3; ++i) rs.push_back(store_conn(srv.port()));
  const auto data = pattern(6u << 20, 9);
  std::vector<std::thread> waiters;
  std::atomic<int> ok{0};
  for (auto& r : rs)
    waiters.emplace_back([&, c = r.get()] {
      auto g = c->get("0", "1", "fan", nullptr, deadline_after(5), {});
      if (g.ok() && checksum(g->payload.tensors[0].data) == checksum(data)) ok.fetch_add(1);
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  PutOptions po;
  po.readers = 3;
  ASSERT_TRUE(snd->put("0", "1", "fan", payload_of(data), po).ok());
  for (auto& t : waiters) t.join();
  EXPECT_EQ(ok.load(), 3);
  EXPECT_EQ(snd->get("0", "1", "fan", nullptr, kNoWait, {}).error().code, Errc::not_found);  // a 4th: none left
  EXPECT_EQ(dbsize(srv.port()), 0);
}

TEST(Store, CleanupDeletesExactlyTheRequestsPuts) {
  NEED_REDIS();
  RedisServer srv;
  auto c = store_conn(srv.port());
  PutOptions tied;
  tied.request_id = "R";
  ASSERT_TRUE(c->put("0", "1", "R_chunk_0", payload_of(pattern(100, 1)), tied).ok());
  ASSERT_TRUE(c->put("1", "2", "R_chunk_1", payload_of(pattern(9u << 20, 2)), tied).ok());
  ASSERT_TRUE(c->put("0", "1", "R", payload_of(pattern(100, 3))).ok());
  ASSERT_TRUE(c->put("0", "1", "R_1", payload_of(pattern(100, 4))).ok());  // not tied to R: stays
  EXPECT_EQ(c->cleanup("R"), 3u);
  auto keys = admin(srv.port(), {"KEYS", "*"});
  for (size_t i = 0; i < store::elements(keys); ++i)
    EXPECT_NE(std::string(store::str(store::element(keys, i))).find("R_1"), std::string::npos)
        << store::str(store::element(keys, i));
  EXPECT_TRUE(c->get("0", "1", "R_1", nullptr, kNoWait, {}).ok());
  EXPECT_EQ(dbsize(srv.port()), 0);
}

TEST(Store, UnreadPutsExpireAfterTheirTtl) {
  NEED_REDIS();
  RedisServer srv;
  Value::Map m;
  m.emplace_back("ttl_seconds", 0.5);
  auto c = store_conn(srv.port(), std::move(m));
  ASSERT_TRUE(c->put("0", "1", "orphan", payload_of(pattern(5u << 20, 5))).ok());
  EXPECT_GT(dbsize(srv.port()), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  EXPECT_EQ(dbsize(srv.port()), 0);
}

TEST(Store, ReplacedKeyReadsTheNewPutAndLeavesNoOldChunks) {
  NEED_REDIS();
  RedisServer srv;
  auto c = store_conn(srv.port());
  ASSERT_TRUE(c->put("0", "1", "k", payload_of(pattern(9u << 20, 1))).ok());
  const auto second = pattern(3u << 20, 2);
  ASSERT_TRUE(c->put("0", "1", "k", payload_of(second)).ok());
  auto g = c->get("0", "1", "k", nullptr, kNoWait, {});
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(second));
  EXPECT_EQ(dbsize(srv.port()), 0);
}

TEST(Store, CorruptedOrTruncatedDataInTheStoreIsAnErrorNotGarbage) {
  NEED_REDIS();
  RedisServer srv;
  auto c = store_conn(srv.port());
  auto chunk_of = [&](const std::string& key) {
    auto keys = admin(srv.port(), {"KEYS", "sl:{" + key + "@0_1}:c:*"});
    return store::elements(keys) ? std::string(store::str(store::element(keys, 0))) : std::string();
  };
  ASSERT_TRUE(c->put("0", "1", "flip", payload_of(pattern(100000, 1))).ok());
  ASSERT_FALSE(chunk_of("flip").empty());
  admin(srv.port(), {"SETRANGE", chunk_of("flip"), "5000", "X"});
  auto g = c->get("0", "1", "flip", nullptr, kNoWait, {});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, Errc::corrupt) << g.error().to_string();
  ASSERT_TRUE(c->put("0", "1", "cut", payload_of(pattern(100000, 2))).ok());
  admin(srv.port(), {"SET", chunk_of("cut"), "short"});
  g = c->get("0", "1", "cut", nullptr, kNoWait, {});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, Errc::corrupt) << g.error().to_string();
  admin(srv.port(), {"SET", "sl:{bad@0_1}:m", "not a meta"});
  admin(srv.port(), {"SET", "sl:{bad@0_1}:r", "1"});
  g = c->get("0", "1", "bad", nullptr, kNoWait, {});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, Errc::corrupt) << g.error().to_string();
}

TEST(Store, WrongPasswordBadConfigAndTlsAreClearErrors) {
  NEED_REDIS();
  RedisServer srv({"--requirepass", "s3cret"});
  Value::Map bad;
  bad.emplace_back("password", "nope");
  auto c = create_connector("StoreConnector", store_extra(srv.port(), std::move(bad)));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, Errc::invalid_argument);
  EXPECT_NE(c.error().message.find("WRONGPASS"), std::string::npos) << c.error().message;
  Value::Map url;
  url.emplace_back("url", "redis://:s3cret@127.0.0.1:" + std::to_string(srv.port()) + "/2");
  auto ok = create_connector("StoreConnector", Value(std::move(url)));
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  ASSERT_TRUE(ok.value()->put("0", "1", "k", payload_of(pattern(10, 1))).ok());
  EXPECT_EQ(store::integer(admin(srv.port(), {"DBSIZE"}, "s3cret")), 0);  // db 0 untouched: it went to db 2
  for (auto [k, v] : std::vector<std::pair<std::string, Value>>{{"backend", Value("memcached")},
                                                                 {"ttl_seconds", Value("lots")},
                                                                 {"tls", Value("yes")},
                                                                 {"tls", Value(Value::Map{{"ca_flie", Value("x")}})},
                                                                 {"tls", Value(Value::Map{{"cert_file", Value("c")}})},
                                                                 {"tls", Value(Value::Map{{"ca_file", Value("/nonexistent")}})}}) {
    Value::Map m;
    m.emplace_back(k, v);
    auto e = create_connector("StoreConnector", store_extra(srv.port(), std::move(m)));
    ASSERT_FALSE(e.ok()) << k;
    EXPECT_EQ(e.error().code, Errc::invalid_argument) << k << ": " << e.error().to_string();
  }
  // TLS to a server that does not speak it: the handshake fails at once and says so.
  const auto t0 = Clock::now();
  auto plain = create_connector("StoreConnector", store_extra(srv.port(), Value::Map{{"tls", Value(true)}}));
  ASSERT_FALSE(plain.ok());
  EXPECT_EQ(plain.error().code, Errc::io) << plain.error().to_string();
  EXPECT_NE(plain.error().message.find("TLS"), std::string::npos) << plain.error().message;
  EXPECT_LT(since(t0), 3.0);
}

// A connector without the server's password fails when it is made (NOAUTH), not at its first put;
// a URL's userinfo is percent-decoded (a password holding '@', ':' or '/').
TEST(Store, MissingPasswordFailsAtCreationAndUrlPasswordsArePercentDecoded) {
  NEED_REDIS();
  RedisServer srv({"--requirepass", "p@ss:w/rd%"});
  auto none = create_connector("StoreConnector", store_extra(srv.port()));
  ASSERT_FALSE(none.ok()) << "made a connector that cannot put";
  EXPECT_EQ(none.error().code, Errc::invalid_argument);
  EXPECT_NE(none.error().message.find("NOAUTH"), std::string::npos) << none.error().message;
  Value::Map url;
  url.emplace_back("url", "redis://:p%40ss%3Aw%2Frd%25@127.0.0.1:" + std::to_string(srv.port()));
  auto ok = create_connector("StoreConnector", Value(std::move(url)));
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  auto d = pattern(100, 3);
  ASSERT_TRUE(ok.value()->put("0", "1", "k", payload_of(d)).ok());
  Value::Map bad;
  bad.emplace_back("url", "redis://:p%4@127.0.0.1:" + std::to_string(srv.port()));
  auto b = create_connector("StoreConnector", Value(std::move(bad)));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().code, Errc::invalid_argument);
  EXPECT_NE(b.error().message.find("'%'"), std::string::npos) << b.error().message;
}

namespace {
// A self-signed certificate for 127.0.0.1 and localhost in `dir` (cert.pem, key.pem), made by the
// openssl command; false when there is none.
bool make_cert(const std::string& dir, const std::string& name) {
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -keyout " + dir + "/" + name + "-key.pem -out " +
                          dir + "/" + name + ".pem -days 1 -subj /CN=localhost -addext "
                          "subjectAltName=IP:127.0.0.1,DNS:localhost >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}
}  // namespace

TEST(Store, TlsRoundTripsLargeAndSmallWakesAWaiterAndRefusesAStranger) {
  NEED_REDIS();
  char tmpl[] = "/tmp/sl-tls-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  struct Rm {
    std::string d;
    ~Rm() { std::filesystem::remove_all(d); }
  } rm{dir};
  if (!make_cert(dir, "server") || !make_cert(dir, "stranger")) GTEST_SKIP() << "no openssl command";
  const int tls_port = testing_util::free_port();
  RedisServer srv({"--tls-port", std::to_string(tls_port), "--tls-cert-file", dir + "/server.pem", "--tls-key-file",
                   dir + "/server-key.pem", "--tls-ca-cert-file", dir + "/server.pem", "--tls-auth-clients", "no"});
  auto tls_extra = [&](const std::string& ca, bool verify = true) {
    return store_extra(tls_port, Value::Map{{"tls", Value(Value::Map{{"ca_file", Value(ca)}, {"verify", Value(verify)}})},
                                            {"chunk_bytes", Value(uint64_t(1) << 20)}});
  };
  auto c = create_connector("StoreConnector", tls_extra(dir + "/server.pem"));
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  for (size_t n : {size_t(10), size_t(3u << 20) + 7}) {  // one inline chunk; four raw chunks
    const auto data = pattern(n, uint8_t(n));
    ASSERT_TRUE(c.value()->put("0", "1", "k", payload_of(data)).ok());
    auto g = c.value()->get("0", "1", "k", nullptr, deadline_after(5), {});
    ASSERT_TRUE(g.ok()) << g.error().to_string();
    ASSERT_EQ(g->payload.tensors.size(), 1u);
    EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(data)) << n;
  }
  // A get blocked over TLS is woken by a put over TLS.
  auto w = create_connector("StoreConnector", tls_extra(dir + "/server.pem"));
  ASSERT_TRUE(w.ok());
  std::thread waiter([&] {
    auto g = w.value()->get("0", "1", "late", nullptr, deadline_after(10), {});
    EXPECT_TRUE(g.ok()) << g.error().to_string();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_TRUE(c.value()->put("0", "1", "late", payload_of(pattern(5000, 3))).ok());
  waiter.join();
  EXPECT_EQ(store::integer(admin(srv.port(), {"DBSIZE"})), 0);
  // A server whose certificate another CA vouches for is refused, not talked to; without
  // verification it is reached.
  auto stranger = create_connector("StoreConnector", tls_extra(dir + "/stranger.pem"));
  ASSERT_FALSE(stranger.ok());
  EXPECT_EQ(stranger.error().code, Errc::invalid_argument);
  EXPECT_NE(stranger.error().message.find("certificate"), std::string::npos) << stranger.error().message;
  EXPECT_TRUE(create_connector("StoreConnector", tls_extra(dir + "/stranger.pem", false)).ok());
  // rediss:// turns TLS on; a client in the clear on the TLS port gets an error, not a hang.
  Value::Map u{{"url", Value("rediss://127.0.0.1:" + std::to_string(tls_port))},
               {"tls", Value(Value::Map{{"ca_file", Value(dir + "/server.pem")}})}};
  auto viaurl = create_connector("StoreConnector", Value(std::move(u)));
  ASSERT_TRUE(viaurl.ok()) << viaurl.error().to_string();
  EXPECT_TRUE(viaurl.value()->put("0", "1", "u", payload_of(pattern(10, 1))).ok());
  auto clear = create_connector("StoreConnector", store_extra(tls_port, Value::Map{{"timeout_ms", Value(1000.0)}}));
  if (clear.ok()) {
    const auto t0 = Clock::now();
    auto p = clear.value()->put("0", "1", "x", payload_of(pattern(10, 1)));
    EXPECT_FALSE(p.ok());
    EXPECT_LT(since(t0), 5.0);
  }
}

TEST(Store, ServerDownAtStartKilledAndRestartedMidRun) {
  NEED_REDIS();
  const int port = testing_util::free_port();
  const auto t0 = Clock::now();
  auto down = create_connector("StoreConnector", store_extra(port));
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.error().code, Errc::io);
  EXPECT_NE(down.error().message.find(std::to_string(port)), std::string::npos) << down.error().message;
  EXPECT_LT(since(t0), 3.0);
  RedisServer srv({}, port);
  auto c = store_conn(port);
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->put("0", "1", "a", payload_of(pattern(1000, 1))).ok());
  srv.stop();
  const auto t1 = Clock::now();
  auto g = c->get("0", "1", "a", nullptr, deadline_after(1), {});
  ASSERT_FALSE(g.ok());
  EXPECT_TRUE(g.error().code == Errc::io || g.error().code == Errc::timeout) << g.error().to_string();
  EXPECT_LT(since(t1), 4.0);
  srv.start();  // the same port: the connector reconnects
  ASSERT_TRUE(c->put("0", "1", "b", payload_of(pattern(1000, 2))).ok());
  auto g2 = c->get("0", "1", "b", nullptr, kNoWait, {});
  ASSERT_TRUE(g2.ok()) << g2.error().to_string();
}

TEST(Store, PayloadOverTheServersMemoryIsRefusedBeforeAnythingIsWritten) {
  NEED_REDIS();
  RedisServer srv({"--maxmemory", "8mb"});
  auto c = store_conn(srv.port());
  auto pr = c->put("0", "1", "big", payload_of(pattern(12u << 20, 1)));
  ASSERT_FALSE(pr.ok());
  EXPECT_EQ(pr.error().code, Errc::exhausted) << pr.error().to_string();
  EXPECT_EQ(dbsize(srv.port()), 0);
}

// A 3-node Redis Cluster on loopback: payloads of keys in different slots, routed by the slot
// map read from a single seed node; a slot moved to another node afterwards is followed (MOVED).
TEST(Store, RedisClusterRoutesBySlotAndFollowsMoved) {
  NEED_REDIS();
  std::vector<std::unique_ptr<RedisServer>> nodes;
  std::string create = "redis-cli --cluster create";
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(std::make_unique<RedisServer>(std::vector<std::string>{"--cluster-enabled", "yes",
                                                                          "--cluster-config-file", "nodes.conf"},
                                                 testing_util::free_cluster_port()));
    create += " 127.0.0.1:" + std::to_string(nodes.back()->port());
  }
  ASSERT_EQ(std::system((create + " --cluster-replicas 0 --cluster-yes >/tmp/sl-cluster-create.log 2>&1").c_str()), 0);
  for (auto& n : nodes)  // every node sees the cluster up
    for (int i = 0; i < 300; ++i) {
      auto info = admin(n->port(), {"CLUSTER", "INFO"});
      if (std::string(store::str(info)).find("cluster_state:ok") != std::string::npos) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  Value::Map m;
  m.emplace_back("cluster", Value(Value::List{Value("127.0.0.1:" + std::to_string(nodes[1]->port()))}));
  auto c = store_conn(nodes[1]->port(), std::move(m));
  ASSERT_TRUE(c);
  for (int k = 0; k < 12; ++k) {
    const auto d = pattern(k == 5 ? (9u << 20) : 1000u + k, k);
    auto pr = c->put("0", "1", "ck" + std::to_string(k), payload_of(d));
    ASSERT_TRUE(pr.ok()) << k << ": " << pr.error().to_string();
    auto g = c->get("0", "1", "ck" + std::to_string(k), nullptr, kNoWait, {});
    ASSERT_TRUE(g.ok()) << k << ": " << g.error().to_string();
    EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
  }
  long long total = 0, used = 0;
  for (auto& n : nodes) {
    const long long s = dbsize(n->port());
    total += s;
    used += s == 0 ? 0 : 1;
  }
  EXPECT_EQ(total, 0);
  // Keys spread: put without reading, count nodes holding some.
  for (int k = 0; k < 12; ++k) ASSERT_TRUE(c->put("0", "1", "spread" + std::to_string(k), payload_of(pattern(10, k))).ok());
  for (auto& n : nodes) used += dbsize(n->port()) > 0 ? 1 : 0;
  EXPECT_GE(used, 2);
  for (int k = 0; k < 12; ++k) EXPECT_EQ(c->cleanup("spread" + std::to_string(k)), 1u);
  // Move the slot of one key to another node behind the connector's back: it follows MOVED.
  const std::string key = "moving@0_1";
  const unsigned slot = store::key_slot("sl:{" + key + "}");
  int src = -1, dst = -1;
  std::string src_id, dst_id;
  for (int i = 0; i < 3; ++i) {
    const std::string id(store::str(admin(nodes[i]->port(), {"CLUSTER", "MYID"})));
    auto r = admin(nodes[i]->port(), {"CLUSTER", "NODES"});
    const std::string text(store::str(r));
    // "myself" line carries its slot ranges.
    const size_t me = text.find("myself");
    const std::string line = text.substr(me, text.find('\n', me) - me);
    bool owns = false;
    for (size_t p = 0; (p = line.find(' ', p)) != std::string::npos; ++p) {
      unsigned a = 0, b = 0;
      if (std::sscanf(line.c_str() + p + 1, "%u-%u", &a, &b) == 2 && slot >= a && slot <= b) owns = true;
    }
    if (owns) {
      src = i;
      src_id = id;
    } else if (dst < 0) {
      dst = i;
      dst_id = id;
    }
  }
  ASSERT_GE(src, 0);
  ASSERT_GE(dst, 0);
  for (int i = 0; i < 3; ++i)  // the slot is empty: it may be handed over at once
    admin(nodes[i]->port(), {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", dst_id});
  const auto d = pattern(70000, 77);
  auto pr = c->put("0", "1", "moving", payload_of(d));
  ASSERT_TRUE(pr.ok()) << pr.error().to_string();
  EXPECT_GT(dbsize(nodes[dst]->port()), 0);  // it went to the slot's new owner
  auto g = c->get("0", "1", "moving", nullptr, kNoWait, {});
  ASSERT_TRUE(g.ok()) << g.error().to_string();
  EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
}

// abandon_get wakes a get blocked on its key at once (cancelled); close() wakes every blocked get
// and later calls say closed; the connector keeps working for other keys after an abandon.
TEST(Store, AbandonGetAndCloseWakeBlockedGets) {
  NEED_REDIS();
  RedisServer srv;
  auto c = store_conn(srv.port());
  ASSERT_TRUE(c);
  Result<GetResult> got = make_error(Errc::io, "not run");
  std::thread waiter([&] { got = c->get("0", "1", "slow", nullptr, deadline_after(10), {}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = Clock::now();
  EXPECT_EQ(c->capability<WaitingGets>()->abandon_get("slow"), 1u);
  waiter.join();
  EXPECT_LT(since(t0), 1.0);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().code, Errc::cancelled) << got.error().to_string();
  EXPECT_EQ(c->capability<WaitingGets>()->abandon_get("nobody"), 0u);
  ASSERT_TRUE(c->put("0", "1", "after", payload_of(pattern(100, 1))).ok());
  ASSERT_TRUE(c->get("0", "1", "after", nullptr, kNoWait, {}).ok());
  std::thread waiter2([&] { got = c->get("0", "1", "slow2", nullptr, deadline_after(10), {}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t1 = Clock::now();
  c->close();
  waiter2.join();
  EXPECT_LT(since(t1), 1.0);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().code, Errc::cancelled);
  auto late = c->put("0", "1", "x", payload_of(pattern(10, 1)));
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.error().code, Errc::closed);
  EXPECT_EQ(c->health().find("status")->as<std::string>(), "closed");
}

// GetOptions::keep_waiting ends a get waiting on the store (Ctrl-C from Python); a get without a
// deadline (Deadline::max()) waits until the put, asked or not.
TEST_F(StorePair, KeepWaitingEndsAWaitAndAGetWithoutDeadlineWaits) {
  Connector *c = rcv.get(), *p = snd.get();
  int asked = 0;
  GetOptions stop_third;
  stop_third.keep_waiting = [&] { return ++asked < 3; };
  auto t0 = Clock::now();
  auto got = c->get("0", "1", "never", nullptr, Deadline::max(), stop_third);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().code, Errc::cancelled) << got.error().to_string();
  EXPECT_EQ(asked, 3);
  EXPECT_LT(since(t0), 3.0);
  const auto d = pattern(5000, 3);
  for (bool checked : {false, true}) {
    GetOptions go;
    if (checked) go.keep_waiting = [] { return true; };
    t0 = Clock::now();
    LateGet g = get_put_later(*p, *c, checked ? "b" : "a", d, 500, Deadline::max(), go);
    ASSERT_TRUE(g.got.ok()) << g.got.error().to_string();
    EXPECT_EQ(checksum(g.got->payload.tensors[0].data), checksum(d));
    EXPECT_GE(since(t0), 0.4);
  }
  auto counter = [&](const char* k) { return c->health().find(k)->as<uint64_t>(); };
  const uint64_t timeouts = counter("timeouts"), waits = counter("waits");
  GetOptions wait_on;
  wait_on.keep_waiting = [] { return true; };
  auto late = c->get("0", "1", "never", nullptr, deadline_after(0.7), wait_on);  // 4 stretches
  EXPECT_EQ(late.error().code, Errc::timeout);
  EXPECT_EQ(counter("timeouts"), timeouts + 1);
  EXPECT_EQ(counter("waits"), waits + 1);  // one get that waited
}

// Small chunks (chunk 0 comes with the claim, the rest from the socket), one reader and two.
TEST(Store, SmallChunksWithTheFirstInTheClaimOneReaderAndTwo) {
  NEED_REDIS();
  RedisServer srv;
  Value::Map m;
  m.emplace_back("chunk_bytes", uint64_t(4096));
  auto c = store_conn(srv.port(), std::move(m));
  ASSERT_TRUE(c);
  for (uint32_t readers : {1u, 2u}) {
    const auto d = pattern(50000 + readers, readers);
    PutOptions po;
    po.readers = readers;
    auto pr = c->put("0", "1", "small", payload_of(d), po);
    ASSERT_TRUE(pr.ok()) << pr.error().to_string();
    for (uint32_t r = 0; r < readers; ++r) {
      auto g = c->get("0", "1", "small", nullptr, kNoWait, {});
      ASSERT_TRUE(g.ok()) << readers << "/" << r << ": " << g.error().to_string();
      EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(d));
    }
    EXPECT_EQ(c->get("0", "1", "small", nullptr, kNoWait, {}).error().code, Errc::not_found);
    EXPECT_EQ(dbsize(srv.port()), 0) << readers;
  }
}

// A large frame's checksum is taken chunk by chunk as the chunks go out and as they land (one
// connection), or whole (several): a byte flipped in the first, a middle or the last chunk is
// caught either way, and a clean put of the same frame reads back intact.
TEST(Store, ChecksumTakenChunkByChunkCatchesAFlipInAnyChunk) {
  NEED_REDIS();
  RedisServer srv;
  for (int conns : {1, 2}) {
    auto c = store_conn(srv.port(), {{"chunk_bytes", 256 * 1024}, {"connections", conns}});
    ASSERT_TRUE(c);
    const auto data = pattern(1000000, 7 + conns);  // 4 chunks of 256 KiB (the last shorter)
    ASSERT_TRUE(c->put("0", "1", "whole", payload_of(data)).ok());
    auto g = c->get("0", "1", "whole", nullptr, kNoWait, {});
    ASSERT_TRUE(g.ok()) << g.error().to_string();
    ASSERT_EQ(g->payload.tensors.size(), 1u);
    EXPECT_EQ(std::memcmp(g->payload.tensors[0].data.data(), data.data(), data.size()), 0);
    for (const char* which : {"0", "1", "3"}) {
      const std::string key = std::string("flip") + which + "_" + std::to_string(conns);
      ASSERT_TRUE(c->put("0", "1", key, payload_of(data)).ok());
      auto keys = admin(srv.port(), {"KEYS", "sl:{" + key + "@0_1}:c:*:" + which});
      ASSERT_EQ(store::elements(keys), 1u) << key;
      admin(srv.port(), {"SETRANGE", std::string(store::str(store::element(keys, 0))), "1000", "X"});
      g = c->get("0", "1", key, nullptr, kNoWait, {});
      ASSERT_FALSE(g.ok()) << key;
      EXPECT_EQ(g.error().code, Errc::corrupt) << key << ": " << g.error().to_string();
    }
  }
}

// A consumer killed in the middle of a get (its claim taken, its chunks half read) loses nothing:
// every read of a payload that does not come whole in the claim's reply is held under a lease
// that only a completed read ends, so when the lease lapses a retry takes the read over and gets
// the payload intact (the dead reader's claim used to count, and its last read took the payload
// away at the server: a retry got nothing). The retry waits no longer than the lease's time left.
// For one reader, and for the first of two (a non-last read: the other reader reads as usual).
TEST(Store, AReaderKilledMidGetGivesItsReadBackWhenItsLeaseLapses) {
  NEED_REDIS();
  for (uint32_t readers : {1u, 2u}) {
    SCOPED_TRACE(std::to_string(readers) + " readers");
    RedisServer srv;
    Value::Map fast;
    fast.emplace_back("timeout_ms", uint64_t(500));  // a lease of 2 s plus the payload at 100 MB/s
    auto c = store_conn(srv.port(), fast);
    ASSERT_TRUE(c);
    const auto big = pattern(96u << 20, 4);
    PutOptions po;
    po.readers = readers;
    ASSERT_TRUE(c->put("0", "1", "k", payload_of(big), po).ok());
    pid_t pid = fork();
    if (pid == 0) {
      Value::Map f2;
      f2.emplace_back("timeout_ms", uint64_t(500));
      auto cc = create_connector("StoreConnector", store_extra(srv.port(), f2));
      (void)cc.value()->get("0", "1", "k", nullptr, deadline_after(30));  // killed during this
      _exit(0);
    }
    const auto t_wait = Clock::now();
    while (store::integer(admin(srv.port(), {"ZCARD", "sl:{k@0_1}:l"})) == 0 && since(t_wait) < 20)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    const bool leased = since(t_wait) < 20;
    kill(pid, SIGKILL);
    testing_util::wait_child(pid);
    ASSERT_TRUE(leased) << "the reader's read was never held under a lease (its claim counted at once)";
    if (store::integer(admin(srv.port(), {"ZCARD", "sl:{k@0_1}:l"})) == 0)
      GTEST_SKIP() << "the killed reader finished its read before the kill landed";
    for (uint32_t i = 0; i < readers; ++i) {  // the other reader, if any, then the retry of the dead one's read
      const auto t0 = Clock::now();
      auto g = c->get("0", "1", "k", nullptr, deadline_after(20));
      ASSERT_TRUE(g.ok()) << "read " << i << " got nothing: " << g.error().to_string();
      EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(big));
      EXPECT_LT(since(t0), 6.0) << "read " << i << " waited past the lease";
    }
    EXPECT_FALSE(c->get("0", "1", "k", nullptr, kNoWait).ok());  // every read done
    EXPECT_EQ(dbsize(srv.port()), 0) << "the put was not taken away after its last read";
  }
}
