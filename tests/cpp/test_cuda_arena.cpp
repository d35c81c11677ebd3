// The bookkeeping of CUDA tensors left on their GPU (src/cuda/device_ref.*, issue 54), which runs
// without a GPU: the record a frame carries (checked field by field: it comes from another
// process), where a reader maps it, the slots and events of the producer's arenas, and the
// shared-memory connector keeping a put's device slots until every reader released its entry.
// What needs a GPU is in tests/python/test_cuda_ipc.py (skipped without one).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <set>

#include "connectors/capabilities.hpp"
#include "cuda/device_ref.hpp"
#include "shm_test_util.hpp"
#include "stagelink/shm.hpp"
#include "util.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using namespace stagelink::cuda;
using namespace shm_test;

namespace {
DeviceRef sample_ref() {
  DeviceRef r;
  r.dtype = DType::bf16;
  r.shape = {3, 5, 7};
  r.pid = 4242;
  r.start_time = 123456789;
  r.arena_id = 9;
  r.arena_bytes = 1 << 20;
  r.offset = 4096;
  r.nbytes = 3 * 5 * 7 * 2;
  r.event_id = 17;
  for (int i = 0; i < 16; ++i) r.gpu.bytes[i] = uint8_t(i * 11);
  for (int i = 0; i < 64; ++i) r.mem.reserved[i] = char(i), r.event.reserved[i] = char(255 - i);
  return r;
}
}  // namespace

TEST(CudaRecord, RoundTripsEveryField) {
  const DeviceRef r = sample_ref();
  const auto b = encode_ref(r);
  EXPECT_EQ(b.size(), kDeviceRefFixed + 3 * 8);
  auto d = decode_ref(b);
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d->dtype, r.dtype);
  EXPECT_EQ(d->shape, r.shape);
  EXPECT_EQ(d->pid, r.pid);
  EXPECT_EQ(d->start_time, r.start_time);
  EXPECT_EQ(d->arena_id, r.arena_id);
  EXPECT_EQ(d->arena_bytes, r.arena_bytes);
  EXPECT_EQ(d->offset, r.offset);
  EXPECT_EQ(d->nbytes, r.nbytes);
  EXPECT_EQ(d->event_id, r.event_id);
  EXPECT_EQ(0, std::memcmp(d->gpu.bytes, r.gpu.bytes, 16));
  EXPECT_EQ(0, std::memcmp(d->mem.reserved, r.mem.reserved, 64));
  EXPECT_EQ(0, std::memcmp(d->event.reserved, r.event.reserved, 64));
  DeviceRef empty = r;  // a 0-d tensor, and an empty one
  empty.shape = {};
  empty.nbytes = 2;
  ASSERT_TRUE(decode_ref(encode_ref(empty)).ok());
  empty.shape = {0, 4};
  empty.nbytes = 0;
  ASSERT_TRUE(decode_ref(encode_ref(empty)).ok());
}

TEST(CudaRecord, RefusesEveryMalformedRecord) {
  auto refused = [](std::vector<std::byte> b, const char* why) {
    auto d = decode_ref(b);
    ASSERT_FALSE(d.ok()) << why;
    EXPECT_EQ(d.error().code, Errc::corrupt) << why;
  };
  const auto good = encode_ref(sample_ref());
  refused({}, "empty");
  refused(std::vector<std::byte>(good.begin(), good.end() - 1), "one byte short");
  auto longer = good;
  longer.push_back(std::byte{0});
  refused(longer, "one byte long");
  auto b = good;
  b[0] = std::byte{0};
  refused(b, "magic");
  b = good;
  b[4] = std::byte{2};
  refused(b, "version");
  b = good;
  b[6] = std::byte{uint8_t(kDTypeCount)};
  refused(b, "dtype");
  auto with = [&](auto&& change) {
    DeviceRef r = sample_ref();
    change(r);
    return encode_ref(r);
  };
  refused(with([](DeviceRef& r) { r.nbytes += 2; }), "shape and bytes disagree");
  refused(with([](DeviceRef& r) { r.shape[1] = -5, r.nbytes = 0; }), "negative dimension");
  refused(with([](DeviceRef& r) { r.shape = {int64_t(1) << 40, int64_t(1) << 40}, r.nbytes = 0; }), "overflow");
  refused(with([](DeviceRef& r) { r.offset = r.arena_bytes - 8; }), "slot past the arena");
  refused(with([](DeviceRef& r) { r.offset = ~uint64_t(0) - 4; }), "offset wraps");
  refused(with([](DeviceRef& r) { r.pid = 0; }), "no producer");
  refused(with([](DeviceRef& r) { r.shape.assign(33, 1), r.nbytes = 2; }), "33 dimensions");
}

TEST(CudaRecord, RandomDamageIsRefusedOrConsistent) {
  const auto good = encode_ref(sample_ref());
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    auto b = good;
    for (int k = 0, n = 1 + int(rng() % 4); k < n; ++k) b[rng() % b.size()] = std::byte(uint8_t(rng()));
    if (rng() % 8 == 0) b.resize(rng() % (b.size() + 8));
    auto d = decode_ref(b);
    if (!d.ok()) {
      EXPECT_EQ(d.error().code, Errc::corrupt);
      continue;
    }
    EXPECT_LE(d->offset + d->nbytes, d->arena_bytes);  // whatever it says fits its arena
    size_t n = dtype_size(d->dtype);
    for (auto x : d->shape) n *= size_t(x);
    EXPECT_EQ(n, d->nbytes);
  }
}

TEST(CudaReach, MapsOnlyAGpuThisProcessSees) {
  CUuuid a{}, b{}, c{};
  a.bytes[0] = 1, b.bytes[0] = 2, c.bytes[0] = 3;
  const std::vector<CUuuid> local{a, b};
  auto none = [](int, int) { return false; };
  auto all = [](int, int) { return true; };
  EXPECT_EQ(reachability(c, local, -1, all).how, Reach::unreachable);  // another host's, or hidden
  EXPECT_EQ(reachability(a, {}, -1, all).how, Reach::unreachable);     // no GPU here
  auto r = reachability(b, local, -1, none);
  EXPECT_EQ(r.how, Reach::same_device);
  EXPECT_EQ(r.ordinal, 1);
  r = reachability(b, local, 0, all);  // wanted on device 0, which reaches device 1's memory
  EXPECT_EQ(r.how, Reach::peer);
  EXPECT_EQ(r.ordinal, 0);
  r = reachability(b, local, 0, none);  // no peer access: read where it lies
  EXPECT_EQ(r.how, Reach::same_device);
  EXPECT_EQ(r.ordinal, 1);
}

TEST(CudaSlots, ArenasAreAddedAsPutsOutgrowThemAndEventsReusedOnlyAfterTheirSlot) {
  SlotBook book(1 << 20);
  EXPECT_FALSE(book.take(100).has_value());  // no arena yet: the caller adds one
  EXPECT_EQ(book.arena_size_for(100), size_t(1) << 20);
  EXPECT_EQ(book.arena_size_for(3 << 20), size_t(3) << 20);  // a larger tensor: an arena of its size
  book.add_arena(1, book.arena_size_for(100));
  std::vector<SlotBook::Slot> held;
  std::set<uint32_t> events;
  for (int i = 0; i < 4; ++i) {
    auto s = book.take(256 << 10);
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(s->arena_id, 1u);
    EXPECT_TRUE(events.insert(s->event_id).second) << "an event of a slot in flight handed out again";
    held.push_back(*s);
  }
  EXPECT_FALSE(book.take(1).has_value());  // full
  EXPECT_EQ(book.slots_in_flight(), 4u);
  ASSERT_TRUE(book.give_back(held[2]).ok());
  auto again = book.take(256 << 10);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->offset, held[2].offset);
  EXPECT_EQ(again->event_id, held[2].event_id);  // its slot was freed: the event may be re-recorded
  book.add_arena(2, 1 << 20);
  auto second = book.take(4096);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->arena_id, 2u);
  EXPECT_EQ(book.events_made(), 5u);
  EXPECT_TRUE(book.drop_idle_arenas().empty());  // arena 2 holds a slot
  ASSERT_TRUE(book.give_back(*second).ok());
  EXPECT_EQ(book.drop_idle_arenas(), std::vector<uint64_t>{2});
  EXPECT_EQ(book.arenas(), 1u);
  SlotBook::Slot bogus{77, 0, 10, 0};
  EXPECT_EQ(book.give_back(bogus).error().code, Errc::corrupt);
  for (int i : {0, 1, 3}) ASSERT_TRUE(book.give_back(held[size_t(i)]).ok());
  ASSERT_TRUE(book.give_back(*again).ok());
  EXPECT_EQ(book.used(), 0u);
  EXPECT_EQ(book.slots_in_flight(), 0u);
}

// PutHooks::hold: what keeps a put's device slots. Kept with the entry until every reader
// released it (a copying get releases at once; the producer drops it when it reclaims the entry),
// and a held put never travels inline (its readers must claim the entry).
TEST(CudaSlots, TheSharedMemoryConnectorKeepsAHoldUntilItsEntryIsReleased) {
  const std::string ns = unique_ns("hold");
  auto c = make(extra(ns));
  auto* bf = c->capability<BindingFields>();
  ASSERT_NE(bf, nullptr);
  EXPECT_EQ(bf->device_slots(), size_t(256) << 20);
  auto* rel = c->capability<ReleaseTracking>();
  ASSERT_NE(rel, nullptr);
  auto held = std::make_shared<int>(1);
  std::weak_ptr<int> watch = held;
  std::vector<std::byte> data(100);
  {
    PutHooks ph;
    ph.hold = std::move(held);
    PutOptions po;
    po.hooks = &ph;
    auto r = c->put("0", "1", "k", payload_of(data, 5), po);
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(r->metadata.find("inline"), nullptr);  // small, yet not inline
  }
  EXPECT_FALSE(watch.expired());
  {
    auto g = c->get("0", "1", "k", nullptr, deadline_after(5), GetOptions{true});  // a view holds the claim
    ASSERT_TRUE(g.ok());
    rel->reap_consumed();
    EXPECT_FALSE(watch.expired()) << "dropped while a reader held its entry";
  }
  rel->reap_consumed();
  EXPECT_TRUE(watch.expired()) << "kept after every reader released it";
  // An unread put's hold goes with cleanup().
  auto h2 = std::make_shared<int>(2);
  std::weak_ptr<int> w2 = h2;
  PutHooks ph;
  ph.hold = std::move(h2);
  PutOptions po;
  po.hooks = &ph;
  ASSERT_TRUE(c->put("0", "1", "req-1", payload_of(data, 6), po).ok());
  ph.hold.reset();
  EXPECT_FALSE(w2.expired());
  c->cleanup("req-1");
  rel->reap_consumed();
  EXPECT_TRUE(w2.expired());
  auto off = make(with(extra(unique_ns("nohold")), "cuda_ipc", false));
  EXPECT_EQ(off->capability<BindingFields>()->device_slots(), 0u);
  c->close();
  off->close();
  EXPECT_EQ(files_with(ns), 0u);
}

// The CUDA driver leaves /dev/shm/cuda.shm.<uid>.<pid in hex>.<n> behind a killed process that
// used CUDA IPC (found on the GPU machine: one per killed test process). `stagelink shm reap`
// removes it only when its process is gone and no live process maps it.
TEST(CudaSlots, ReapRemovesTheDriverFileOfADeadProcessOnly) {
  char tmpl[] = "/tmp/slcudareapXXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_EQ(testing_util::wait_child(dead), 0);
  auto name = [](pid_t pid) {
    char b[64];
    std::snprintf(b, sizeof b, "cuda.shm.%u.%x.1", unsigned(getuid()), unsigned(pid));
    return std::string(b);
  };
  auto make_file = [&](const std::string& n) {
    FILE* f = std::fopen((dir + "/" + n).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("x", f);
    std::fclose(f);
  };
  auto exists = [&](const std::string& n) { return access((dir + "/" + n).c_str(), F_OK) == 0; };
  const std::string of_dead = name(dead), of_me = name(getpid()), odd = "cuda.shm.x.y";
  make_file(of_dead);
  make_file(of_me);
  make_file(odd);
  // A dead process's file that a live one still maps stays.
  int fd = open((dir + "/" + of_dead).c_str(), O_RDONLY);
  void* m = mmap(nullptr, 1, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  shm::reap(dir);
  EXPECT_TRUE(exists(of_dead));
  munmap(m, 1);
  close(fd);
  const auto removed = shm::reap(dir);
  EXPECT_FALSE(exists(of_dead));
  EXPECT_TRUE(exists(of_me));  // alive
  EXPECT_TRUE(exists(odd));    // not the driver's pattern
  EXPECT_EQ(removed.size(), 1u);
  for (auto& n : {of_me, odd}) unlink((dir + "/" + n).c_str());
  rmdir(dir.c_str());
}

// The relay over the shared-memory connector keeps a put's device slots the same way, returns its
// credit only once they were released, and says in the metadata that the payload stayed on a GPU
// (with the data's size, not its records', in transfer_info.size, as SGLang-Omni's receivers size
// their buffers by it).
TEST(CudaSlots, TheRelayKeepsAPutsDeviceSlotsUntilItWasRead) {
  Value::Map extra;
  extra.emplace_back("namespace", unique_ns("relayhold"));
  Value::Map cfg;
  cfg.emplace_back("credits", uint64_t(1));
  cfg.emplace_back("timeout_s", 0.2);
  cfg.emplace_back("extra", Value(extra));
  auto relay = Relay::create(RelayConfig::from_value(Value(cfg)).value());
  ASSERT_TRUE(relay.ok()) << relay.error().message;
  EXPECT_EQ((*relay)->device_slots(), size_t(256) << 20);
  std::vector<std::byte> rec(240);
  auto held = std::make_shared<int>(1);
  std::weak_ptr<int> watch = held;
  RelayPutOptions o;
  o.hold = std::move(held);
  o.data_bytes = 64u << 20;
  auto put = (*relay)->put_async(payload_of(rec, 0), o);
  ASSERT_TRUE(put.ok()) << put.error().message;
  const Value& md = put->metadata();
  ASSERT_NE(md.find("cuda_ipc"), nullptr);
  uint64_t size = 0;
  ASSERT_TRUE(md.find("transfer_info")->find("size")->get_u64(size));
  EXPECT_EQ(size, uint64_t(64) << 20);
  EXPECT_EQ(md.find("inline"), nullptr);
  o.hold.reset();
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ((*relay)->put_async(payload_of(rec, 1), RelayPutOptions{}).error().code, Errc::exhausted);  // one credit
  {
    RelayGetOptions g;
    g.zero_copy = true;
    auto got = (*relay)->get_async(md, g);
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_FALSE(put->done()) << "released while the reader still held it";
  }
  ASSERT_TRUE(put->wait(5).ok());
  auto again = (*relay)->put_async(payload_of(rec, 2), RelayPutOptions{});  // reclaims the first
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(watch.expired()) << "the slot outlived its put";
  (*relay)->close();
  // Device slots need a connector that keeps them.
  Value::Map off = extra;
  off.emplace_back("cuda_ipc", false);
  cfg.back() = {"extra", Value(off)};
  auto r2 = Relay::create(RelayConfig::from_value(Value(cfg)).value());
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ((*r2)->device_slots(), 0u);
  RelayPutOptions o2;
  o2.hold = std::make_shared<int>(2);
  EXPECT_EQ((*r2)->put_async(payload_of(rec, 3), o2).error().code, Errc::invalid_argument);
  (*r2)->close();
}
