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
#include "shm_test_util.hpp"
#include "util.hpp"
#include "connectors/capabilities.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using testing_util::checksum;
using testing_util::wait_child;

using namespace shm_test;

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
  // Released, the segment stays as the spare (extra.spare_bytes) for the next frame of its size
  EXPECT_EQ(files_with(ns + ".x"), 1u);
  EXPECT_GE(c->health().find("spare_held_bytes")->as<uint64_t>(), big.size());
  c->close();
  EXPECT_EQ(files_with(ns), 0u);  // the spare goes at close
}

// A frame larger than the arena gets a segment of its own; once every reader released it, the
// producer keeps it (one, up to extra.spare_bytes) for its next frame of about that size instead
// of making a new one (the kernel's zeroing and a fault per page: a 256 MiB put took 173-190 ms
// in a new segment against 15 ms in the arena). The reused segment carries the new frame whole,
// a reader holding a view keeps it from reuse, and spare_bytes 0 keeps none.
TEST(Shm, ReleasedSegmentOfItsOwnIsReusedForTheNextLargePut) {
  const std::string ns = unique_ns("spare");
  auto c = make(extra(ns, 1u << 20));
  auto rd = make(extra(ns));
  // segments made: puts given a segment of their own, less those that went into the spare
  auto made = [&] {
    Value h = c->health();
    return h.find("dedicated_segments")->as<uint64_t>() - h.find("dedicated_reused")->as<uint64_t>();
  };
  std::vector<std::byte> big(3u << 20);
  auto put_get = [&](const std::string& key, std::byte fill) {
    std::fill(big.begin(), big.end(), fill);
    auto r = c->put("0", "1", key, payload_of(big, 0));
    EXPECT_TRUE(r.ok()) << r.error().message;
    auto g = rd->get("0", "1", key, &r->metadata);
    EXPECT_TRUE(g.ok()) << g.error().message;
    const auto& t = g->payload.tensors.at(0).data;
    EXPECT_EQ(t.size(), big.size());
    EXPECT_TRUE(std::all_of(t.begin(), t.end(), [&](std::byte b) { return b == fill; }));
  };
  put_get("a", std::byte{1});
  EXPECT_GE(c->health().find("spare_held_bytes")->as<uint64_t>(), big.size());
  put_get("b", std::byte{2});  // into the spare: no new segment
  put_get("c", std::byte{3});
  Value h = c->health();
  EXPECT_EQ(h.find("dedicated_segments")->as<uint64_t>(), 3u);
  EXPECT_EQ(h.find("dedicated_reused")->as<uint64_t>(), 2u);
  EXPECT_EQ(files_with(ns + ".x"), 1u);
  // Unreleased, it is not the spare: the next put makes a segment of its own
  auto held = c->put("0", "1", "held", payload_of(big, 0));
  ASSERT_TRUE(held.ok());
  auto other = c->put("0", "1", "other", payload_of(big, 0));
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(made(), 2u);
  EXPECT_EQ(files_with(ns + ".x"), 2u);
  EXPECT_TRUE(rd->get("0", "1", "held", &held->metadata).ok());
  EXPECT_TRUE(rd->get("0", "1", "other", &other->metadata).ok());
  EXPECT_EQ(c->health().find("outstanding")->as<uint64_t>(), 0u);
  EXPECT_EQ(files_with(ns + ".x"), 1u);  // one spare at most
  // A reader's zero-copy view holds its segment: the next put gets a new one, and the view's
  // bytes stay the ones it read
  std::fill(big.begin(), big.end(), std::byte{7});
  auto viewed = c->put("0", "1", "viewed", payload_of(big, 0));  // into the spare
  ASSERT_TRUE(viewed.ok());
  GetOptions zc;
  zc.zero_copy = true;
  Result<PutResult> next = make_error(Errc::closed, "not put");
  {
    auto view = rd->get("0", "1", "viewed", &viewed->metadata, kNoWait, zc);
    ASSERT_TRUE(view.ok()) << view.error().message;
    std::fill(big.begin(), big.end(), std::byte{8});
    next = c->put("0", "1", "next", payload_of(big, 0));
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(made(), 3u);
    const auto& seen = view->payload.tensors.at(0).data;
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](std::byte b) { return b == std::byte{7}; }));
  }  // the view goes: its segment becomes the spare
  EXPECT_TRUE(rd->get("0", "1", "next", &next->metadata).ok());
  EXPECT_EQ(c->health().find("outstanding")->as<uint64_t>(), 0u);
  // A frame much smaller than the spare does not take it (readers would map the whole of it)
  std::vector<std::byte> mid(3u << 19);
  auto m = c->put("0", "1", "mid", payload_of(mid, 0));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(made(), 4u);
  EXPECT_TRUE(rd->get("0", "1", "mid", &m->metadata).ok());
  c->close();
  rd->close();
  EXPECT_EQ(files_with(ns), 0u);
  // spare_bytes 0: none kept
  const std::string ns2 = unique_ns("nospare");
  auto c2 = make(with(extra(ns2, 1u << 20), "spare_bytes", Value(uint64_t(0))));
  auto r2 = c2->put("0", "1", "a", payload_of(big, 0));
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(c2->get("0", "1", "a", &r2->metadata).ok());
  EXPECT_EQ(c2->health().find("outstanding")->as<uint64_t>(), 0u);
  EXPECT_EQ(files_with(ns2 + ".x"), 0u);
  c2->close();
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
