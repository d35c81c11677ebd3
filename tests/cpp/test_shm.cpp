// SharedMemoryConnector across real processes (fork).
#include <gtest/gtest.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include <random>

#include "shm/directory.hpp"
#include "util.hpp"
#include "connectors/capabilities.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::wait_child;

namespace {
std::string unique_ns(const char* tag) {
  static int n = 0;
  return std::string("t") + tag + std::to_string(getpid()) + "x" + std::to_string(n++);
}
Value extra(const std::string& ns, size_t arena = 64u << 20, double put_timeout = 5.0,
            const std::string& dir = "/dev/shm") {
  Value::Map m;
  m.emplace_back("namespace", ns);
  m.emplace_back("arena_bytes", uint64_t(arena));
  m.emplace_back("put_timeout_s", put_timeout);
  m.emplace_back("shm_dir", dir);
  return Value(std::move(m));
}
std::unique_ptr<Connector> make(const Value& e) {
  auto c = create_connector("SharedMemoryConnector", e);
  EXPECT_TRUE(c.ok()) << (c.ok() ? "" : c.error().message);
  return c.ok() ? std::move(c).value() : nullptr;
}
std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) { x ^= x << 13; x ^= x >> 17; x ^= x << 5; v[i] = std::byte(x); }
  return v;
}
Payload payload_of(const std::vector<std::byte>& data, uint64_t sum) {
  Payload p;
  Value::Map m;
  m.emplace_back("sum", sum);
  m.emplace_back("t", TensorRef{0});
  p.tree = Value(std::move(m));
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(data)));
  return p;
}
size_t files_with(const std::string& needle) {
  size_t n = 0;
  DIR* d = opendir("/dev/shm");
  while (dirent* e = readdir(d)) if (std::string(e->d_name).find(needle) != std::string::npos) ++n;
  closedir(d);
  return n;
}
}  // namespace

class CrossProcess : public ::testing::TestWithParam<size_t> {};

// Producer in this process, consumer in a child that gets by key (no metadata), verifies the
// checksum and exits 0.
TEST_P(CrossProcess, RoundTripWithChecksum) {
  const size_t size = GetParam();
  const std::string ns = unique_ns("rt");
  auto prod = make(extra(ns, 300u << 20));
  pid_t pid = fork();
  if (pid == 0) {
    auto cons = create_connector("SharedMemoryConnector", extra(ns));
    if (!cons.ok()) _exit(10);
    for (bool view : {false, true}) {
      auto g = cons.value()->get("0", "1", view ? "kv" : "k", nullptr, deadline_after(30), GetOptions{view});
      if (!g.ok()) _exit(11);
      uint64_t sum = 0;
      if (!g->payload.tree.find("sum")->get_u64(sum)) _exit(12);
      if (g->payload.tensors.size() != 1 || g->payload.tensors[0].nbytes() != size) _exit(13);
      if (checksum(g->payload.tensors[0].data) != sum) _exit(14);
    }
    cons.value()->close();
    _exit(0);
  }
  auto data = pattern(size, uint32_t(size));
  uint64_t sum = checksum(data);
  auto r = prod->put("0", "1", "k", payload_of(data, sum));
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->metadata.find("inline") != nullptr, r->size <= 65536);
  ASSERT_TRUE(prod->put("0", "1", "kv", payload_of(data, sum)).ok());
  EXPECT_EQ(wait_child(pid), 0);
  prod->close();
  EXPECT_EQ(files_with(ns), 0u);
}

// Frame overhead is 64 B header + msgpack: pick payload sizes whose frames are threshold-1,
// threshold, threshold+1 (computed from the plan) as well as the fixed sizes.
static std::vector<size_t> sizes() {
  std::vector<size_t> s = {0, 1, 1u << 20, 256u << 20};
  auto overhead = [](size_t n) {
    std::vector<std::byte> d(n);
    return plan_frame(payload_of(d, ~0ull)).value().total - n;
  };
  size_t o = overhead(65000);
  for (long d : {-1, 0, 1}) s.push_back(size_t(65536 + d) - o);
  return s;
}
INSTANTIATE_TEST_SUITE_P(Sizes, CrossProcess, ::testing::ValuesIn(sizes()));

TEST(Shm, ThresholdBoundaryIsExact) {
  auto c = make(extra(unique_ns("thr")));
  for (size_t n = 65000; n < 65600; n += 1) {
    std::vector<std::byte> d(n);
    auto r = c->put("0", "1", "k" + std::to_string(n), payload_of(d, ~0ull));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->metadata.find("inline") != nullptr, r->size <= 65536) << r->size;
    ASSERT_TRUE(c->get("0", "1", "k" + std::to_string(n), &r->metadata).ok());
  }
}

// PutOptions::inline_sink and GetOptions::metadata_inline: the inline frame handed beside the
// metadata instead of inside it (as the Python binding does, making the metadata's bytes straight
// from the frame at put and reading them in place at get) is the frame the metadata would hold,
// and reads as if it were there, in copying and in viewing gets; the entry's reader accounting
// still runs. A put too large to travel inline never calls the sink.
TEST(Shm, InlineFrameHandedBesideTheMetadata) {
  auto c = make(extra(unique_ns("inlside")));
  for (bool view : {false, true}) {
    const std::string key = view ? "kv" : "kc";
    const auto d = pattern(3000, view ? 7 : 8);
    auto plain = c->put("0", "1", key + "p", payload_of(d, testing_util::checksum(d)));
    ASSERT_TRUE(plain.ok());
    const Value* inl = plain->metadata.find("inline");
    ASSERT_TRUE(inl && inl->is<Value::Bytes>());
    std::vector<std::byte> frame;  // the caller's copy
    int calls = 0;
    PutHooks ph;
    ph.inline_sink = [&](std::span<const std::byte> f) { frame.assign(f.begin(), f.end()), ++calls; };
    PutOptions po;
    po.hooks = &ph;
    auto r = c->put("0", "1", key, payload_of(d, testing_util::checksum(d)), po);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(r->metadata.find("inline"), nullptr) << "the sink took the frame: not in the metadata too";
    EXPECT_EQ(frame, inl->as<Value::Bytes>()) << "the sink's frame is the one the metadata would hold";
    GetHooks gh;
    gh.view_metadata = view;
    gh.metadata_inline = frame;
    GetOptions go;
    go.zero_copy = true;
    go.hooks = &gh;
    auto g = c->get("0", "1", key, &r->metadata, kNoWait, go);
    ASSERT_OK(g);
    ASSERT_EQ(g->payload.tensors.size(), 1u);
    EXPECT_EQ(testing_util::checksum(g->payload.tensors[0].data), testing_util::checksum(d));
    if (view)
      EXPECT_TRUE(g->payload.tensors[0].data.data() > frame.data() &&
                  g->payload.tensors[0].data.data() < frame.data() + frame.size())
          << "a viewing get of an inline frame views the caller's bytes";
    // The get released the entry: another get by key finds nothing.
    EXPECT_FALSE(c->get("0", "1", key, nullptr, kNoWait).ok());
  }
  int calls = 0;
  PutHooks ph;
  ph.inline_sink = [&](std::span<const std::byte>) { ++calls; };
  PutOptions po;
  po.hooks = &ph;
  const auto big = pattern(70000, 9);  // above the 64 KiB threshold
  auto r = c->put("0", "1", "big", payload_of(big, 0), po);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(calls, 0);
  EXPECT_NE(r->metadata.find("shm"), nullptr);
}

TEST(Shm, FanOutToThreeReaders) {
  const std::string ns = unique_ns("fan");
  auto prod = make(extra(ns));
  auto data = pattern(1 << 20, 5);
  auto r = prod->put("0", "1", "fan", payload_of(data, checksum(data)), PutOptions{3});
  ASSERT_TRUE(r.ok());
  std::vector<pid_t> kids;
  for (int i = 0; i < 3; ++i) {
    pid_t pid = fork();
    if (pid == 0) {
      auto c = create_connector("SharedMemoryConnector", extra(ns));
      auto g = c.value()->get("0", "1", "fan", &r->metadata);
      _exit(g.ok() && checksum(g->payload.tensors[0].data) == checksum(data) ? 0 : 1);
    }
    kids.push_back(pid);
  }
  for (auto k : kids) EXPECT_EQ(wait_child(k), 0);
  // A fourth read finds nothing: the slot was freed after the third.
  auto c = make(extra(ns));
  auto g4 = c->get("0", "1", "fan", &r->metadata);
  ASSERT_FALSE(g4.ok());
  EXPECT_EQ(g4.error().code, Errc::not_found);
  // The last release freed the slot: nothing of the put is held any more.
  auto h = prod->health();
  EXPECT_EQ(h.find("outstanding")->as<uint64_t>(), 0u);
  EXPECT_EQ(h.find("arena_used")->as<uint64_t>(), 0u);
}

// The AVX2 probe and the portable loop must agree on every window: wrapping or not, with
// matches, empty slots and other hashes mixed, at every start position.
TEST(Shm, ProbeWindowSimdAgreesWithThePortableLoop) {
  constexpr uint32_t n = 256;
  std::vector<std::atomic<uint64_t>> words(n);
  std::mt19937_64 rng(7);
  const uint64_t want = 0x9e3779b97f4a7c15ull;
  for (int round = 0; round < 50; ++round) {
    for (auto& w : words) {
      const uint64_t r = rng() % 4;
      w.store(r == 0 ? 0 : r == 1 ? want : r == 2 ? (want ^ (1ull << (rng() % 64))) : rng());
    }
    uint64_t seen = 0;
    for (uint32_t start = 0; start < 2 * n; ++start) {
      const auto simd = shm::probe_window(words.data(), n - 1, start, want, true);
      const auto loop = shm::probe_window(words.data(), n - 1, start, want, false);
      ASSERT_EQ(simd.match, loop.match) << "start " << start;
      ASSERT_EQ(simd.empty, loop.empty) << "start " << start;
      for (uint32_t i = 0; i < shm::kProbe; ++i) {  // and the loop is right: bit i is slot start+i
        const uint64_t w = words[(start + i) % n].load();
        ASSERT_EQ((loop.match >> i) & 1, uint64_t(w == want));
        ASSERT_EQ((loop.empty >> i) & 1, uint64_t(w == 0));
      }
      seen |= simd.match;
    }
    ASSERT_NE(seen, 0u);
  }
}

Value with(Value e, const char* k, Value v) {
  e.as<Value::Map>().emplace_back(k, std::move(v));
  return e;
}

TEST(Shm, KeyReuseBeforeReadIsAnErrorWhenAskedFor) {
  auto c = make(with(extra(unique_ns("reuse")), "on_existing_key", "error"));
  ASSERT_TRUE(c->put("0", "1", "k", Payload{}).ok());
  auto again = c->put("0", "1", "k", Payload{});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().code, Errc::exists);
  EXPECT_NE(again.error().message.find("k@0_1"), std::string::npos);
  ASSERT_TRUE(c->get("0", "1", "k", nullptr).ok());
  EXPECT_TRUE(c->put("0", "1", "k", Payload{}).ok());  // reusable once read
}

// Regression: a directory full of entries that every reader had released refused the next put
// with `exhausted`, because the producer reclaimed its finished entries only after reserving.
TEST(Shm, DirectoryFullOfReadEntriesIsReusable) {
  Value e = extra(unique_ns("dirfull"));
  e.as<Value::Map>().emplace_back("max_entries", uint64_t(64));
  auto prod = make(e);
  auto cons = make(e);
  int put = 0;
  for (; put < 200; ++put)
    if (!prod->put("0", "1", "k" + std::to_string(put), Payload{}).ok()) break;
  ASSERT_GT(put, 0);
  ASSERT_LT(put, 200);  // the directory filled up
  for (int i = 0; i < put; ++i) ASSERT_TRUE(cons->get("0", "1", "k" + std::to_string(i), nullptr).ok());
  for (int i = 0; i < 200; ++i) {
    auto r = prod->put("0", "1", "again" + std::to_string(i), Payload{});
    ASSERT_TRUE(r.ok()) << i << ": " << r.error().message;
    ASSERT_TRUE(cons->get("0", "1", "again" + std::to_string(i), &r->metadata).ok());
  }
}

TEST(Shm, GetIntoCopiesIntoTheCallersBufferAndReleasesTheSlot) {
  const std::string ns = unique_ns("into");
  auto prod = make(extra(ns, 4u << 20, 0.2));
  auto cons = make(extra(ns));
  std::vector<std::byte> out(3u << 20);
  for (uint32_t i = 0; i < 3; ++i) {  // the arena holds one payload: get_into must release it
    auto data = pattern(3u << 20, i);
    auto r = prod->put("0", "1", "k" + std::to_string(i), payload_of(data, 0));
    ASSERT_TRUE(r.ok()) << r.error().message;
    auto n = get_into(*cons, "0", "1", "k" + std::to_string(i), &r->metadata, kNoWait, out);
    ASSERT_TRUE(n.ok()) << n.error().message;
    EXPECT_EQ(*n, data.size());
    EXPECT_EQ(checksum(std::span<const std::byte>(out.data(), *n)), checksum(data));
  }
  auto data = pattern(1000, 9);
  auto r = prod->put("0", "1", "small", payload_of(data, 0));
  ASSERT_TRUE(r.ok());
  std::vector<std::byte> tiny(10);
  auto n = get_into(*cons, "0", "1", "small", &r->metadata, kNoWait, tiny);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.error().code, Errc::invalid_argument);
  EXPECT_FALSE(get_into(*cons, "0", "1", "absent", nullptr, kNoWait, out).ok());
}

TEST(Shm, KeylessGetBlocksUntilPublishedAndTimesOut) {
  const std::string ns = unique_ns("wait");
  auto c = make(extra(ns));
  auto t0 = Clock::now();
  auto g = c->get("0", "1", "never", nullptr, deadline_after(0.2));
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code, Errc::timeout);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(190));
  EXPECT_EQ(c->get("0", "1", "never", nullptr).error().code, Errc::not_found);  // single attempt
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto p = make(extra(ns));
    ASSERT_TRUE(p->put("0", "1", "later", Payload{}).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  });
  auto got = c->get("0", "1", "later", nullptr, deadline_after(5));
  EXPECT_TRUE(got.ok());
  producer.join();
}

TEST(Shm, CleanupAndCloseFreeEverything) {
  const std::string ns = unique_ns("clean");
  auto c = make(extra(ns));
  std::vector<std::byte> d(100000);
  PutOptions tied;
  tied.request_id = "req1";
  for (auto k : {"req1_c1", "chunk-7"}) ASSERT_TRUE(c->put("0", "1", k, payload_of(d, 0), tied).ok());
  for (auto k : {"req1", "req1_1_0_0", "req1_suffix_0_0", "req1-c2", "req10", "req2"})
    ASSERT_TRUE(c->put("0", "1", k, payload_of(d, 0)).ok());
  // Exact: the key equal to the id and the puts tied to it. Regression: every key starting with
  // "req1" and a separator was freed, losing other requests' data.
  EXPECT_EQ(c->cleanup("req1"), 3u);  // req1, req1_c1 and chunk-7 (tied)
  EXPECT_FALSE(c->get("0", "1", "req1_c1", nullptr).ok());
  EXPECT_FALSE(c->get("0", "1", "chunk-7", nullptr).ok());
  for (auto k : {"req1_1_0_0", "req1_suffix_0_0", "req1-c2", "req10"}) EXPECT_TRUE(c->get("0", "1", k, nullptr).ok()) << k;
  EXPECT_EQ(c->cleanup("req1_c1"), 0u);  // already gone
  EXPECT_EQ(c->health().find("outstanding")->as<uint64_t>(), 1u);  // req2
  EXPECT_GT(files_with(ns), 0u);
  c->close();
  c->close();  // idempotent
  EXPECT_EQ(c->put("0", "1", "x", Payload{}).error().code, Errc::closed);
  EXPECT_EQ(files_with(ns), 0u);
}

TEST(Shm, LoansWriteInPlaceAndMayOutliveTheirConnector) {
  const std::string ns = unique_ns("loan");
  auto c = make(extra(ns, 1u << 20));
  auto other = make(extra(ns + "o", 1u << 20));
  TensorSpec spec;
  spec.dtype = DType::f32;
  spec.shape = {1024};
  spec.nbytes = 4096;
  auto l = c->capability<Lending>()->loan(Value(TensorRef{0}), std::span<const TensorSpec>(&spec, 1));
  ASSERT_TRUE(l.ok()) << l.error().message;
  auto bytes = pattern(4096, 9);
  std::memcpy(l->region(0).data(), bytes.data(), bytes.size());
  EXPECT_EQ(other->capability<Lending>()->put_loan("0", "1", "k", std::move(*l)).error().code, Errc::invalid_argument);
  auto r = c->capability<Lending>()->put_loan("0", "1", "k", std::move(*l));
  ASSERT_TRUE(r.ok()) << r.error().message;
  auto g = c->get("0", "1", "k", &r->metadata);
  ASSERT_TRUE(g.ok());
  ASSERT_EQ(g->payload.tensors[0].nbytes(), 4096u);
  EXPECT_EQ(std::memcmp(g->payload.tensors[0].data.data(), bytes.data(), 4096), 0);
  EXPECT_EQ(g->payload.tensors[0].dtype, DType::f32);

  // One loan in the arena, one larger than the arena (a segment of its own); then the connector
  // goes away first. Writing to the loans stays valid, dropping them frees, nothing is left.
  auto in_arena = c->capability<Lending>()->loan(Value(TensorRef{0}), std::span<const TensorSpec>(&spec, 1));
  TensorSpec big = spec;
  big.shape = {1 << 20};
  big.nbytes = 4u << 20;
  auto own = c->capability<Lending>()->loan(Value(TensorRef{0}), std::span<const TensorSpec>(&big, 1));
  ASSERT_TRUE(in_arena.ok() && own.ok());
  EXPECT_EQ(files_with(ns + ".x"), 1u);
  c.reset();
  std::memset(in_arena->region(0).data(), 1, 4096);
  std::memset(own->region(0).data(), 2, 4u << 20);
  *in_arena = Loan();
  *own = Loan();
  other->close();
  EXPECT_EQ(files_with(ns), 0u);
}

TEST(Shm, BadMetadataIsCorruptNotACrash) {
  auto c = make(extra(unique_ns("meta")));
  std::vector<std::byte> d(200000);
  auto r = c->put("0", "1", "k", payload_of(d, 0));
  ASSERT_TRUE(r.ok());
  Value::Map md;
  md.emplace_back("entry", uint64_t(1) << 30);
  md.emplace_back("gen", uint64_t(1));
  const Value out_of_range(md), not_a_map("nonsense");
  EXPECT_EQ(c->get("0", "1", "k", &out_of_range).error().code, Errc::corrupt);
  // Metadata of key k used to get another key: the entry holds a different key.
  auto r2 = c->put("0", "1", "other", payload_of(d, 0));
  EXPECT_EQ(c->get("0", "1", "other", &r->metadata).error().code, Errc::corrupt);
  // Our metadata naming a generation the entry never had: corrupt, not the payload it holds.
  for (int64_t delta : {1, -1}) {
    Value::Map g = r->metadata.as<Value::Map>();
    for (auto& [key, v] : g)
      if (key == "gen") v = Value(uint64_t(int64_t(v.as<uint64_t>()) + delta));
    const Value wrong_gen(g);
    EXPECT_EQ(c->get("0", "1", "k", &wrong_gen).error().code, Errc::corrupt) << delta;
  }
  Value::Map no_gen = r->metadata.as<Value::Map>();
  std::erase_if(no_gen, [](auto& kv) { return kv.first == "gen"; });
  const Value half(no_gen);
  EXPECT_EQ(c->get("0", "1", "k", &half).error().code, Errc::corrupt);  // ours, incomplete
  (void)not_a_map;
  // Corrupt inline bytes.
  Value::Map bad = r2->metadata.as<Value::Map>();
  bad.emplace_back("inline", Value(Value::Bytes(10, std::byte{1})));
  const Value bad_inline(bad);
  EXPECT_EQ(c->get("0", "1", "other", &bad_inline).error().code, Errc::corrupt);
  // Regression: inline metadata of one key used to get another returned the first key's payload.
  std::vector<std::byte> small(100, std::byte{5});
  auto s1 = c->put("0", "1", "small1", payload_of(small, 0));
  ASSERT_TRUE(s1.ok() && s1->metadata.find("inline"));
  ASSERT_TRUE(c->put("0", "1", "small2", payload_of(small, 0)).ok());
  auto wrong = c->get("0", "1", "small2", &s1->metadata);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.error().code, Errc::corrupt);
  ASSERT_TRUE(c->get("0", "1", "small1", &s1->metadata).ok());
  ASSERT_TRUE(c->get("0", "1", "small2", nullptr).ok());
  // Regression: the failed decode kept its reader slot, so "other" was never freed.
  uint64_t outstanding = 0;
  ASSERT_TRUE(c->health().find("outstanding")->get_u64(outstanding));
  EXPECT_EQ(outstanding, 1u);  // only "k", never read
  EXPECT_EQ(c->put("0", "1", "../etc", Payload{}).error().code, Errc::invalid_argument);
  // Regression: each part within its limit, together longer than an entry's key field (232
  // bytes): the put wrote past it into the next entry of the shared directory.
  const std::string stage(64, 's'), long_key(160, 'k');
  auto too_long = c->put(stage, stage, long_key, Payload{});
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.error().code, Errc::invalid_argument);
  EXPECT_NE(too_long.error().message.find("directory entry"), std::string::npos) << too_long.error().message;
  // The same bound counts the request id a put is tied to (stored beside the key).
  PutOptions tied;
  const std::string rid(100, 'r');
  tied.request_id = rid;
  EXPECT_EQ(c->put(stage, "1", std::string(130, 'k'), Payload{}, tied).error().code, Errc::invalid_argument);
  tied.request_id = "../x";
  EXPECT_EQ(c->put("0", "1", "k3", Payload{}, tied).error().code, Errc::invalid_argument);
  EXPECT_TRUE(c->put(stage, "1", std::string(160, 'k'), Payload{}).ok());  // 227 bytes: fits
  EXPECT_EQ(c->put("0/x", "1", "k2", Payload{}).error().code, Errc::invalid_argument);
}

TEST(Shm, FullArenaWaitsThenFailsAndLargePayloadGetsOwnSegment) {
  const std::string ns = unique_ns("full");
  auto c = make(extra(ns, 1u << 20, 0.5));
  std::vector<std::byte> d(600000);
  ASSERT_TRUE(c->put("0", "1", "a", payload_of(d, 0)).ok());
  auto t0 = Clock::now();
  auto full = c->put("0", "1", "b", payload_of(d, 0));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().code, Errc::exhausted);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(490));
  // A producer waiting for room is woken by the reader's release (futex on release_seq), well
  // before its 0.5 s put timeout.
  std::thread reader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto r = make(extra(ns));
    EXPECT_TRUE(r->get("0", "1", "a", nullptr).ok());
  });
  t0 = Clock::now();
  auto waited = c->put("0", "1", "b", payload_of(d, 0));
  auto took = Clock::now() - t0;
  reader.join();
  ASSERT_TRUE(waited.ok()) << waited.error().message;
  EXPECT_GE(took, std::chrono::milliseconds(90));
  EXPECT_LT(took, std::chrono::milliseconds(450));
  std::vector<std::byte> big(3u << 20);
  auto r = c->put("0", "1", "big", payload_of(big, 0));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(c->health().find("dedicated_segments")->as<uint64_t>(), 1u);
  EXPECT_EQ(files_with(ns + ".x"), 1u);
  EXPECT_TRUE(c->get("0", "1", "big", &r->metadata).ok());
  EXPECT_EQ(c->health().find("outstanding")->as<uint64_t>(), 1u);  // only "b" left
  EXPECT_EQ(files_with(ns + ".x"), 0u);  // the dedicated segment went with its last reader
  c->close();
  EXPECT_EQ(files_with(ns), 0u);
}

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

// The arena is reserved in /dev/shm as puts reach into it, in 2 MiB steps, not whole at its
// creation: an edge whose payloads use its first slots reserves (and zeroes) only those, and a
// pool larger than /dev/shm still moves what fits. extra.preallocate_arena reserves it whole
// when the connector is made (a full /dev/shm fails there).
TEST(Shm, ArenaIsReservedAsPutsReachIntoItOrWholeWhenAsked) {
  auto allocated = [](const Value& h) {  // bytes tmpfs holds for the arena file
    struct stat st {};
    EXPECT_EQ(stat(("/dev/shm/" + h.find("arena_name")->as<std::string>()).c_str(), &st), 0);
    return size_t(st.st_blocks) * 512;
  };
  for (bool eager : {false, true}) {
    const std::string ns = unique_ns(eager ? "eager" : "lazy");
    Value e = extra(ns, 8u << 20);
    e.as<Value::Map>().emplace_back("preallocate_arena", eager);
    auto c = make(e);
    ASSERT_TRUE(c);
    EXPECT_EQ(c->health().find("arena_bytes")->as<uint64_t>(), eager ? 8u << 20 : 0u);
    EXPECT_EQ(files_with(ns), eager ? 2u : 1u);  // the directory, and the arena when eager
    if (eager) EXPECT_GE(allocated(c->health()), size_t(8u << 20));
    const auto small = pattern(100000, 1), big = pattern(3u << 20, 2);
    ASSERT_TRUE(c->put("0", "1", "small", payload_of(small, checksum(small))).ok());
    Value h = c->health();
    EXPECT_EQ(h.find("arena_bytes")->as<uint64_t>(), 8u << 20);
    EXPECT_EQ(h.find("arena_reserved")->as<uint64_t>(), eager ? 8u << 20 : 2u << 20);
    if (!eager) EXPECT_LT(allocated(h), size_t(8u << 20));
    ASSERT_TRUE(c->put("0", "1", "big", payload_of(big, checksum(big))).ok());  // reaches past 2 MiB
    EXPECT_EQ(c->health().find("arena_reserved")->as<uint64_t>(), eager ? 8u << 20 : 4u << 20);
    EXPECT_EQ(files_with(ns), 2u);
    for (auto [k, d] : {std::pair{"small", &small}, std::pair{"big", &big}}) {
      auto g = c->get("0", "1", k, nullptr);
      ASSERT_TRUE(g.ok()) << k;
      EXPECT_EQ(checksum(g->payload.tensors[0].data), checksum(*d)) << k;
    }
    c->close();
    EXPECT_EQ(files_with(ns), 0u);
  }
  Value bad = extra(unique_ns("badpre"));
  bad.as<Value::Map>().emplace_back("preallocate_arena", "yes");
  auto c = create_connector("SharedMemoryConnector", bad);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, Errc::invalid_argument);
  EXPECT_NE(c.error().message.find("preallocate_arena"), std::string::npos);
}

// vLLM-Omni: a put of a key whose payload is unread replaces it. A reader already holding a view
// keeps the old payload; its slot is freed when the view goes.
TEST(Shm, PutReplacesAnUnreadKeyAndHeldViewsKeepTheOldPayload) {
  const std::string ns = unique_ns("repl");
  auto c = make(extra(ns));
  auto r = make(extra(ns));
  const auto v1 = pattern(300000, 1), v2 = pattern(300000, 2), v3 = pattern(300000, 3);
  PutOptions two;
  two.readers = 2;
  ASSERT_TRUE(c->put("0", "1", "k", payload_of(v1, 1), two).ok());
  auto view = r->get("0", "1", "k", nullptr, kNoWait, GetOptions{true});  // 1 of 2 readers
  ASSERT_TRUE(view.ok());
  ASSERT_TRUE(c->put("0", "1", "k", payload_of(v2, 2)).ok());  // replaces the unread rest
  ASSERT_TRUE(c->put("0", "1", "k", payload_of(v3, 3)).ok());  // and again
  auto got = r->get("0", "1", "k", nullptr);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(checksum(got->payload.tensors[0].data), checksum(v3));
  EXPECT_EQ(r->get("0", "1", "k", nullptr).error().code, Errc::not_found);  // one payload, read once
  EXPECT_EQ(checksum(view->payload.tensors[0].data), checksum(v1));  // the view still reads v1
  EXPECT_EQ(c->capability<ReleaseTracking>()->reap_consumed(), 2u);  // v2 (cancelled, unread) and v3 (read); v1 is held
  EXPECT_EQ(c->health().find("outstanding")->as<uint64_t>(), 1u);
  EXPECT_EQ(c->health().find("replaced")->as<uint64_t>(), 2u);
  view = Result<GetResult>(make_error(Errc::cancelled, "dropped"));  // drop the view
  EXPECT_EQ(c->capability<ReleaseTracking>()->reap_consumed(), 1u);
  EXPECT_EQ(c->health().find("outstanding")->as<uint64_t>(), 0u);
  auto bad = create_connector("SharedMemoryConnector", with(extra(ns), "on_existing_key", "sometimes"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Errc::invalid_argument);
}

// vLLM-Omni's callers pass whatever metadata their orchestrator holds: another connector's (a
// transfer-engine dict), an empty dict, a wrapped {key: metadata}. None of it is ours to refuse.
TEST(Shm, MetadataOfAnotherConnectorFallsBackToTheKey) {
  auto c = make(extra(unique_ns("foreign")));
  Value::Map te;
  te.emplace_back("source_host", "10.0.0.2");
  te.emplace_back("source_port", uint64_t(15500));
  te.emplace_back("data_size", uint64_t(4096));
  te.emplace_back("is_fast_path", true);
  const Value foreign(te), empty(Value::Map{}), text("not a map"), nil;
  int n = 0;
  for (const Value* md : {&foreign, &empty, &text, &nil}) {
    const auto d = pattern(1000 + 70000 * (n % 2), n);
    auto put = c->put("0", "1", "k", payload_of(d, 0));
    ASSERT_TRUE(put.ok());
    auto got = c->get("0", "1", "k", md);
    ASSERT_TRUE(got.ok()) << n << ": " << got.error().message;
    EXPECT_EQ(checksum(got->payload.tensors[0].data), checksum(d));
    ++n;
  }
  EXPECT_EQ(c->get("0", "1", "k", &foreign).error().code, Errc::not_found);  // one attempt, as without
  auto t0 = Clock::now();
  EXPECT_EQ(c->get("0", "1", "k", &foreign, deadline_after(0.1)).error().code, Errc::timeout);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(90));
  for (size_t size : {1000u, 200000u}) {  // inline and in the arena
    const auto d = pattern(size, 9);
    auto put = c->put("0", "1", "w", payload_of(d, 0));
    ASSERT_TRUE(put.ok());
    Value::Map wrapped;
    wrapped.emplace_back("w", put->metadata);
    const Value w(wrapped);
    auto got = c->get("0", "1", "w", &w);
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(checksum(got->payload.tensors[0].data), checksum(d));
  }
}

TEST(Shm, AbandonGetAndCloseEndABlockedGet) {
  auto c = make(extra(unique_ns("abandon")));
  for (int round = 0; round < 2; ++round) {
    Result<GetResult> got = make_error(Errc::io, "not run");
    const auto t0 = Clock::now();
    std::thread t([&] { got = c->get("0", "1", "never", nullptr, deadline_after(20)); });
    size_t woken = 0;
    for (int i = 0; i < 200 && !woken; ++i) {  // until the get is blocked
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (round == 0) woken = c->capability<WaitingGets>()->abandon_get("never");
      else if (i == 20) { c->close(); woken = 1; }
    }
    t.join();
    EXPECT_EQ(woken, 1u);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.error().code, Errc::cancelled) << got.error().message;
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  }
  EXPECT_EQ(c->capability<WaitingGets>()->abandon_get("nobody"), 0u);
}

// GetOptions::keep_waiting (how the Python binding lets Ctrl-C end a long get): asked about every
// kWaitCheckEvery while the get waits for its key, false ends it (cancelled); a get that waits out
// its deadline so is one timeout in health(), not one per check.
TEST(Shm, KeepWaitingIsAskedWhileAGetWaitsAndCanEndIt) {
  const std::string ns = unique_ns("keepw");
  auto c = make(extra(ns));
  auto p = make(extra(ns));
  int asked = 0;
  GetOptions stop_third;
  stop_third.keep_waiting = [&] { return ++asked < 3; };
  for (const Deadline dl : {deadline_after(20), Deadline::max()}) {
    asked = 0;
    const auto t0 = Clock::now();
    auto got = c->get("0", "1", "never", nullptr, dl, stop_third);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.error().code, Errc::cancelled) << got.error().message;
    EXPECT_EQ(asked, 3);
    EXPECT_GE(Clock::now() - t0, 2 * kWaitCheckEvery);
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  }
  auto timeouts = [&] { return c->health().find("timeouts")->as<uint64_t>(); };
  const uint64_t before = timeouts();
  asked = 0;
  GetOptions wait_on;
  wait_on.keep_waiting = [&] { return ++asked > 0; };
  auto late = c->get("0", "1", "never", nullptr, deadline_after(0.7), wait_on);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.error().code, Errc::timeout);
  EXPECT_GE(asked, 2);
  EXPECT_EQ(timeouts(), before + 1);
  std::vector<std::byte> d(3000, std::byte{7});
  std::thread putter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ASSERT_TRUE(p->put("0", "1", "later", payload_of(d, 0)).ok());
  });
  auto got = c->get("0", "1", "later", nullptr, deadline_after(20), wait_on);  // found between checks
  putter.join();
  ASSERT_TRUE(got.ok()) << got.error().message;
  EXPECT_EQ(checksum(got->payload.tensors[0].data), checksum(d));
}

// vLLM-Omni's _pending_keys and arrival wake-ups (get_wakeup_generation / wait_for_change).
TEST(Shm, PendingKeysFollowReadsCleanupAndClose) {
  const std::string ns = unique_ns("pend");
  auto p = make(extra(ns));
  auto r = make(extra(ns));
  std::vector<std::byte> d(5000);
  using V = std::vector<std::string>;
  for (auto k : {"a", "b", "c"}) ASSERT_TRUE(p->put("0", "1", k, payload_of(d, 0)).ok());
  PutOptions two;
  two.readers = 2;
  ASSERT_TRUE(p->put("0", "1", "fan", payload_of(d, 0), two).ok());
  EXPECT_EQ(p->capability<ArrivalSignals>()->pending_keys().value(), (V{"a", "b", "c", "fan"}));
  ASSERT_TRUE(r->get("0", "1", "b", nullptr).ok());  // another connector reads it
  ASSERT_TRUE(r->get("0", "1", "fan", nullptr).ok());  // one of two readers: still pending
  EXPECT_EQ(p->capability<ArrivalSignals>()->pending_keys().value(), (V{"a", "c", "fan"}));
  ASSERT_TRUE(r->get("0", "1", "fan", nullptr).ok());
  EXPECT_EQ(p->cleanup("c"), 1u);
  EXPECT_EQ(p->capability<ArrivalSignals>()->pending_keys().value(), (V{"a"}));
  EXPECT_EQ(r->capability<ArrivalSignals>()->pending_keys().value(), V{});  // a reader owns no puts
  p->close();
  EXPECT_EQ(p->capability<ArrivalSignals>()->pending_keys().value(), V{});
}

TEST(Shm, ArrivalEpochWakesOnAPutAndTimesOutWithoutOne) {
  const std::string ns = unique_ns("arr");
  auto rcv = make(extra(ns));
  const uint64_t g = rcv->capability<ArrivalSignals>()->arrival_epoch().value();
  auto t0 = Clock::now();
  EXPECT_FALSE(rcv->capability<ArrivalSignals>()->wait_arrival(g, deadline_after(0.1)));
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(95));
  pid_t pid = fork();
  if (pid == 0) {  // another process puts after a while
    usleep(100000);
    auto c = create_connector("SharedMemoryConnector", extra(ns));
    const bool ok = c.ok() && (*c)->put("0", "1", "k", Payload{}).ok();
    if (c.ok()) (*c)->close();
    _exit(ok ? 0 : 1);
  }
  t0 = Clock::now();
  EXPECT_TRUE(rcv->capability<ArrivalSignals>()->wait_arrival(g, deadline_after(10)));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(wait_child(pid), 0);
  EXPECT_NE(rcv->capability<ArrivalSignals>()->arrival_epoch().value(), g);
  EXPECT_TRUE(rcv->capability<ArrivalSignals>()->wait_arrival(g, deadline_after(10)));  // already moved: at once
  rcv->close();
  EXPECT_EQ(rcv->capability<ArrivalSignals>()->arrival_epoch().error().code, Errc::closed);
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
