#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>

#include <cstring>
#include <random>

#include "core/host_pool.hpp"
#include "core/msgpack_io.hpp"
#include "util.hpp"
#include "core/proc.hpp"
#include "cuda/driver.hpp"
#include "connectors/names.hpp"
#include "core/options.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;

TEST(Allocator, AlignsFirstFitAndMerges) {
  BufferAllocator a(1 << 20, 4096);
  auto x = a.allocate(1);
  auto y = a.allocate(5000);
  auto z = a.allocate(4096);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  EXPECT_EQ(x.value(), 0u);
  EXPECT_EQ(y.value(), 4096u);
  EXPECT_EQ(z.value(), 4096u * 3);
  ASSERT_TRUE(a.free(y.value(), 5000).ok());
  auto w = a.allocate(4096);  // first fit reuses the hole
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w.value(), 4096u);
  ASSERT_TRUE(a.free(w.value(), 4096).ok());
  ASSERT_TRUE(a.free(x.value(), 1).ok());
  ASSERT_TRUE(a.free(z.value(), 4096).ok());
  EXPECT_EQ(a.free_blocks(), 1u);  // every neighbour merged back into one block
  EXPECT_EQ(a.free_bytes(), a.capacity());
}

TEST(Allocator, DoubleFreeIgnoredPartialOverlapIsCorruption) {
  BufferAllocator a(64 << 10, 4096);
  auto x = a.allocate(8192);
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(a.free(x.value(), 8192).ok());
  EXPECT_TRUE(a.free(x.value(), 8192).ok());      // exact double free: logged, ignored
  EXPECT_TRUE(a.free(x.value(), 4096).ok());      // contained: ignored
  EXPECT_EQ(a.free_bytes(), a.capacity());
  auto y = a.allocate(8192);
  ASSERT_TRUE(y.ok());
  auto st = a.free(y.value() + 4096, 8192);       // straddles allocated and free space
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, Errc::corrupt);
  EXPECT_EQ(a.free(1, 10).error().code, Errc::corrupt);  // misaligned
  EXPECT_EQ(a.allocate(1 << 20).error().code, Errc::exhausted);
}

// Corrupts copies of `base` `rounds` times (1..max_flips random bytes within its first `span`
// bytes each) and returns how many copies `rejects` refused. Seeded: the same bytes every run.
template <class Rejects>
static int rejected_of_random_flips(const std::vector<std::byte>& base, size_t span, int max_flips, uint32_t seed,
                                    Rejects rejects, int rounds = 20000) {
  std::mt19937 rng(seed);
  int rejected = 0;
  for (int it = 0; it < rounds; ++it) {
    auto c = base;
    const int flips = 1 + int(rng() % uint32_t(max_flips));
    for (int k = 0; k < flips; ++k) c[rng() % std::min(c.size(), span)] = std::byte(rng());
    if (rejects(c)) ++rejected;
  }
  return rejected;
}

static Payload sample_payload(std::vector<std::byte>& a, std::vector<std::byte>& b) {
  Payload p;
  Value::Map m;
  m.emplace_back("name", "hidden");
  m.emplace_back("step", int64_t(-3));
  m.emplace_back("h", TensorRef{0});
  m.emplace_back("codes", Value::List{TensorRef{1}, Value(3.5), Value(nullptr)});
  p.tree = Value(std::move(m));
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(a), DType::f32, {int64_t(a.size() / 8), 2}));
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(b), DType::u8));
  return p;
}

TEST(Frame, RoundTripAlignsRegions) {
  std::vector<std::byte> a(800), b(77);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::byte(i * 7);
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::byte(255 - i);
  Payload p = sample_payload(a, b);
  auto f = encode_frame(p);
  ASSERT_TRUE(f.ok());
  auto d = decode_frame(f.value());
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_TRUE(d->tree == p.tree);
  ASSERT_EQ(d->tensors.size(), 2u);
  for (auto& t : d->tensors) EXPECT_EQ((t.data.data() - f->data()) % kFrameAlign, 0);
  EXPECT_EQ(d->tensors[0].dtype, DType::f32);
  EXPECT_EQ(d->tensors[0].shape, (std::vector<int64_t>{100, 2}));
  EXPECT_EQ(std::memcmp(d->tensors[0].data.data(), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(d->tensors[1].data.data(), b.data(), b.size()), 0);
}

// Every dtype, FP8/FP4 and complex32 included (FP8 KV caches cross stages natively): its name
// round trips, and a frame of it keeps dtype, shape and bytes; a code past the last is corrupt.
TEST(Frame, EveryDTypeRoundTripsAndAnUnknownOneIsCorrupt) {
  for (int i = 0; i < kDTypeCount; ++i) {
    const DType dt = DType(i);
    auto byname = dtype_from_name(dtype_name(dt));
    ASSERT_TRUE(byname.ok()) << dtype_name(dt);
    EXPECT_EQ(*byname, dt);
    std::vector<std::byte> d(dtype_size(dt) * 6);
    for (size_t k = 0; k < d.size(); ++k) d[k] = std::byte(k * 13 + i);
    Payload p;
    p.tree = Value(TensorRef{0});
    p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(d), dt, {2, 3}));
    auto f = encode_frame(p);
    ASSERT_TRUE(f.ok()) << dtype_name(dt);
    auto back = decode_frame(f.value());
    ASSERT_TRUE(back.ok()) << dtype_name(dt) << ": " << back.error().message;
    EXPECT_EQ(back->tensors[0].dtype, dt);
    EXPECT_EQ(back->tensors[0].shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(std::memcmp(back->tensors[0].data.data(), d.data(), d.size()), 0);
  }
  EXPECT_EQ(dtype_size(DType::f8e4m3fn), 1u);
  EXPECT_EQ(dtype_size(DType::c32), 4u);
  EXPECT_STREQ(dtype_name(DType::f8e5m2), "float8_e5m2");
  std::vector<std::byte> d(8);
  Payload p;
  p.tree = Value(TensorRef{0});
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(d), DType(kDTypeCount)));
  auto f = encode_frame(p);
  if (f.ok()) {  // the encoder does not judge dtypes; the decoder must
    auto back = decode_frame(f.value());
    ASSERT_FALSE(back.ok());
    EXPECT_EQ(back.error().code, Errc::corrupt);
  }
}

// One plan reused across payloads (as put's scratch plan is): a kept plan must be exactly the
// fresh plan of the new payload, whatever changed between two puts.
TEST(Frame, ReusedPlanMatchesAFreshPlanForEveryLayoutChange) {
  std::vector<std::byte> data(4096);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i * 13);
  auto single = [&](DType dt, std::vector<int64_t> shape, size_t nbytes, std::string device = "cpu") {
    Payload p;
    p.tree = Value(TensorRef{0});
    Tensor t = Tensor::view_of(std::span<const std::byte>(data.data(), nbytes), dt, std::move(shape));
    t.device = std::move(device);
    p.tensors.push_back(std::move(t));
    return p;
  };
  std::vector<Payload> seq;
  seq.push_back(single(DType::f32, {16, 16}, 1024));
  seq.push_back(single(DType::f32, {16, 16}, 1024));  // same layout: kept
  seq.push_back(single(DType::f32, {256}, 1024));      // same bytes, other shape
  seq.push_back(single(DType::i32, {256}, 1024));      // other dtype
  seq.push_back(single(DType::i32, {256}, 1024, "cuda:0"));
  seq.push_back(single(DType::i32, {512}, 2048));
  seq.push_back(single(DType::u8, {}, 100));           // shape left to the size
  seq.push_back(single(DType::u8, {}, 101));
  std::vector<std::byte> two_a(800), two_b(3);
  seq.push_back(sample_payload(two_a, two_b));  // two tensors: planned afresh
  seq.push_back(single(DType::u8, {}, 101));
  // A packed ext (as the Python binding writes it) is part of the layout: kept only when equal.
  const auto ext_a = value_to_msgpack(Value(Value::Map{{"tk", Value::List{Value(int64_t(1))}}}));
  const auto ext_b = value_to_msgpack(Value(Value::Map{{"tk", Value::List{Value(int64_t(9))}}}));
  for (const auto* e : {&ext_a, &ext_a, &ext_b, &ext_a}) {
    seq.push_back(single(DType::u8, {}, 101));
    seq.back().packed_ext = *e;
  }
  seq.push_back(single(DType::u8, {}, 101));  // and none again
  FramePlan kept;
  for (size_t i = 0; i < seq.size(); ++i) {
    ASSERT_TRUE(plan_frame_into(kept, seq[i]).ok()) << i;
    auto fresh = plan_frame(seq[i]);
    ASSERT_TRUE(fresh.ok()) << i;
    EXPECT_EQ(kept.head, fresh->head) << i;
    EXPECT_EQ(kept.offsets, fresh->offsets) << i;
    EXPECT_EQ(kept.lengths, fresh->lengths) << i;
    EXPECT_EQ(kept.total, fresh->total) << i;
    std::vector<std::byte> frame(kept.total);
    write_frame(kept, seq[i].tensors, frame.data());
    auto d = decode_frame(frame);
    ASSERT_TRUE(d.ok()) << i << ": " << d.error().message;
    ASSERT_EQ(d->tensors.size(), seq[i].tensors.size());
    EXPECT_EQ(d->tensors[0].dtype, seq[i].tensors[0].dtype) << i;
    EXPECT_EQ(d->tensors[0].device, seq[i].tensors[0].device) << i;
    EXPECT_EQ(d->tensors[0].nbytes(), seq[i].tensors[0].nbytes()) << i;
    // The ext reads back the same whether the decode builds it or leaves it packed.
    Payload raw;
    ASSERT_TRUE(decode_frame_into(frame, nullptr, raw, false).ok()) << i;
    const bool has = !seq[i].packed_ext.empty();
    EXPECT_EQ(raw.packed_ext.empty(), !has) << i;
    EXPECT_TRUE(raw.ext.is_nil()) << i;
    EXPECT_EQ(d->ext_has("tk"), has) << i;
    EXPECT_EQ(raw.ext_has("tk"), has) << i;
    if (has) {
      EXPECT_TRUE(std::equal(raw.packed_ext.begin(), raw.packed_ext.end(), seq[i].packed_ext.begin(),
                             seq[i].packed_ext.end())) << i;
      EXPECT_EQ(value_to_msgpack(d->ext), std::vector<std::byte>(raw.packed_ext.begin(), raw.packed_ext.end())) << i;
    }
  }
  // A payload that fails to plan leaves nothing to keep.
  Payload bad = single(DType::f32, {3}, 1024);
  EXPECT_FALSE(plan_frame_into(kept, bad).ok());
  EXPECT_FALSE(plan_frame_into(kept, bad).ok());
}

TEST(Frame, RejectsShapeMismatchOnEncode) {
  std::vector<std::byte> a(10);
  Payload p;
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(a), DType::f32, {3}));
  EXPECT_EQ(encode_frame(p).error().code, Errc::invalid_argument);
}

// A damaged frame decodes to `corrupt`, or to tensors whose regions lie inside the buffer and whose
// shape holds exactly their bytes: never a crash or an out-of-bounds view. Returns whether it decoded.
static bool expect_corrupt_or_in_bounds(const std::vector<std::byte>& f) {
  auto d = decode_frame(f);
  if (!d.ok()) {
    EXPECT_EQ(d.error().code, Errc::corrupt);
    return false;
  }
  for (auto& t : d->tensors) {
    EXPECT_GE(t.data.data(), f.data());
    EXPECT_LE(t.data.data() + t.data.size(), f.data() + f.size());
    size_t n = dtype_size(t.dtype);
    for (auto x : t.shape) n *= size_t(x);
    EXPECT_EQ(n, t.nbytes());
  }
  return true;
}

// Every truncation and many random corruptions of a valid frame.
TEST(Frame, TruncatedAndCorruptFramesAreRejected) {
  std::vector<std::byte> a(256), b(64);
  auto f = encode_frame(sample_payload(a, b)).value();
  for (size_t n = 0; n < f.size(); ++n) {
    auto d = decode_frame(std::span<const std::byte>(f.data(), n));
    EXPECT_FALSE(d.ok()) << "truncated to " << n;
    if (!d.ok()) EXPECT_EQ(d.error().code, Errc::corrupt);
  }
  EXPECT_GT(rejected_of_random_flips(f, 400, 4, 42, [](auto& g) { return !expect_corrupt_or_in_bounds(g); }), 0);
}

TEST(Frame, HeaderLengthPastEndIsCorrupt) {
  std::vector<std::byte> a(16), b(16);
  auto f = encode_frame(sample_payload(a, b)).value();
  FrameHeader h;
  std::memcpy(&h, f.data(), sizeof h);
  h.header_len = 0xFFFFFFF0u;
  std::memcpy(f.data(), &h, sizeof h);
  auto d = decode_frame(f);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("header length"), std::string::npos);
}

// Found by tests/fuzz/fuzz_frame: a frame whose total_len is under its own 64-byte header made
// `total_len - 64` wrap around, so any header length passed and the msgpack reader ran past the
// buffer (ASan: heap-buffer-overflow). The fuzzer's input, as it found it.
TEST(Frame, TotalLengthShorterThanTheHeaderIsCorrupt) {
  const uint8_t crash[] = {0x53, 0x4c, 0x46, 0x52, 0x01, 0, 0, 0, 0, 0, 0x82, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0,
                           0, 0, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0x82, 0xa1, 0x78, 0x90, 0xa6, 0xa1, 0x74, 0x2a};
  std::vector<std::byte> f(sizeof crash);
  std::memcpy(f.data(), crash, sizeof crash);
  auto d = decode_frame(f);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error().code, Errc::corrupt);
  EXPECT_NE(d.error().message.find("less than its 64-byte header"), std::string::npos) << d.error().message;
  // And any total_len under 64 with a header length that fits what the buffer holds.
  std::vector<std::byte> a(16), b(16);
  auto g = encode_frame(sample_payload(a, b)).value();
  FrameHeader h;
  std::memcpy(&h, g.data(), sizeof h);
  h.total_len = 10;
  std::memcpy(g.data(), &h, sizeof h);
  EXPECT_FALSE(decode_frame(g).ok());
}

TEST(Msgpack, DeepNestingAndGarbageAreErrors) {
  std::vector<std::byte> deep(200, std::byte{0x91});  // 200 nested one-element arrays
  deep.push_back(std::byte{0xc0});
  EXPECT_FALSE(value_from_msgpack(deep).ok());
  std::vector<std::byte> garbage{std::byte{0xc1}};
  EXPECT_FALSE(value_from_msgpack(garbage).ok());
  std::vector<std::byte> str_too_long{std::byte{0xdb}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff}};
  EXPECT_FALSE(value_from_msgpack(str_too_long).ok());
}

// A Value exercising every msgpack width our reader decodes (fix/8/16/32/64-bit integers of both
// signs, str8/16/32, bin8/16/32, float32/64, fixarray/array16, fixmap/map16, ext TensorRef).
static Value every_width() {
  Value::List ints;
  for (uint64_t u : std::initializer_list<uint64_t>{0, 127, 128, 255, 256, 65535, 65536, 4294967295ull,
                     4294967296ull, 18446744073709551615ull})
    ints.emplace_back(u);
  for (int64_t i : std::initializer_list<int64_t>{-1, -32, -33, -128, -129, -32768, -32769, -2147483648ll,
                    -2147483649ll, INT64_MIN})
    ints.emplace_back(i);
  Value::List strs, bins, many;
  for (size_t n : {0, 31, 32, 255, 256, 65535, 65536}) {
    strs.emplace_back(std::string(n, 's'));
    bins.emplace_back(Value::Bytes(n, std::byte{0xab}));
  }
  for (int i = 0; i < 20; ++i) many.emplace_back(uint64_t(i));  // array16
  Value::Map big;
  for (int i = 0; i < 17; ++i) big.emplace_back("k" + std::to_string(i), Value(i % 2 == 0));  // map16
  Value::Map m;
  m.emplace_back("ints", Value(std::move(ints)));
  m.emplace_back("strs", Value(std::move(strs)));
  m.emplace_back("bins", Value(std::move(bins)));
  m.emplace_back("many", Value(std::move(many)));
  m.emplace_back("big", Value(std::move(big)));
  m.emplace_back("f", Value(-2.5));
  m.emplace_back("nil", Value());
  m.emplace_back("ref", Value(TensorRef{70000}));
  return Value(std::move(m));
}

TEST(Msgpack, EveryWidthRoundTrips) {
  const Value v = every_width();
  auto enc = value_to_msgpack(v);
  auto dec = value_from_msgpack(enc);
  ASSERT_TRUE(dec.ok()) << dec.error().to_string();
  // Non-negative integers come back as uint64, so compare through a second encoding.
  EXPECT_EQ(value_to_msgpack(dec.value()), enc);
  EXPECT_EQ(dec->find("ref")->as<TensorRef>().index, 70000u);
  EXPECT_EQ(dec->find("f")->as<double>(), -2.5);
  EXPECT_EQ(dec->find("ints")->as<Value::List>().back().as<int64_t>(), INT64_MIN);
  EXPECT_EQ(dec->find("ints")->as<Value::List>()[9].as<uint64_t>(), UINT64_MAX);
  EXPECT_EQ(dec->find("strs")->as<Value::List>()[6].as<std::string>().size(), 65536u);
  // float32 (msgpack-c packs doubles as float64, so hand-write one) and integer map keys.
  const std::vector<std::byte> f32{std::byte{0x82}, std::byte{0x01}, std::byte{0xca}, std::byte{0x3f},
                                   std::byte{0xc0}, std::byte{0},    std::byte{0},    std::byte{0xff},
                                   std::byte{0xc3}};
  auto m = value_from_msgpack(f32);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->find("1")->as<double>(), 1.5);
  EXPECT_EQ(m->find("-1")->as<bool>(), true);
}

// Lists of ids as the Python layer writes them (msgpack ext type 2: a width byte, then the values
// little-endian, signed where the width byte has 0x80): a C++ reader gets the same list of
// integers an array gives, in every width; a bad width, a body that is not whole values, or a
// truncated one is an error, never a list.
TEST(Msgpack, IdListsReadAsListsOfIntegersAndBadOnesAreErrors) {
  auto id_list = [](uint8_t width, const std::vector<uint32_t>& vals, int cut = 0) {
    std::vector<std::byte> b;
    const uint32_t bytes = width & 0xf, body = 1 + uint32_t(vals.size()) * bytes;
    for (uint8_t x : {uint8_t(0xc9), uint8_t(body >> 24), uint8_t(body >> 16), uint8_t(body >> 8), uint8_t(body),
                      uint8_t(2), width})
      b.push_back(std::byte{x});
    for (uint32_t v : vals)
      for (uint32_t i = 0; i < bytes; ++i) b.push_back(std::byte(uint8_t(v >> (8 * i))));
    b.erase(b.end() - cut, b.end());  // (resize: a false -Wstringop-overflow in gcc 12)
    return b;
  };
  const std::pair<uint8_t, std::vector<uint32_t>> cases[] = {
      {1, {0, 1, 127, 128, 255}}, {2, {0, 256, 65535, 300}}, {4, {0, 65536, 151645, 4294967295u}}, {1, {}}};
  for (const auto& [w, vals] : cases) {
    auto dec = value_from_msgpack(id_list(w, vals));
    ASSERT_TRUE(dec.ok()) << dec.error().to_string();
    const auto& l = dec->as<Value::List>();
    ASSERT_EQ(l.size(), vals.size());
    size_t i = 0;
    for (uint32_t v : vals) EXPECT_EQ(l[i++].as<uint64_t>(), v) << "width " << int(w);
  }
  // Signed (width | 0x80): negatives come back as int64, the rest as uint64, as an array gives them.
  for (uint8_t w : {uint8_t(0x81), uint8_t(0x82), uint8_t(0x84)}) {
    const uint32_t bits = 8 * (w & 0xf);
    const int64_t lo = -(int64_t(1) << (bits - 1)), hi = (int64_t(1) << (bits - 1)) - 1;
    auto dec = value_from_msgpack(id_list(w, {uint32_t(lo), uint32_t(-1), 0, uint32_t(hi)}));
    ASSERT_TRUE(dec.ok()) << dec.error().to_string();
    const auto& l = dec->as<Value::List>();
    ASSERT_EQ(l.size(), 4u);
    EXPECT_EQ(l[0].as<int64_t>(), lo) << int(w);
    EXPECT_EQ(l[1].as<int64_t>(), -1) << int(w);
    EXPECT_EQ(l[2].as<uint64_t>(), 0u) << int(w);
    EXPECT_EQ(l[3].as<uint64_t>(), uint64_t(hi)) << int(w);
  }
  EXPECT_FALSE(value_from_msgpack(id_list(0x83, {1})).ok());       // no such signed width
  EXPECT_FALSE(value_from_msgpack(id_list(3, {1, 2})).ok());        // no such width
  EXPECT_FALSE(value_from_msgpack(id_list(0, {})).ok());            // nor this one
  EXPECT_FALSE(value_from_msgpack(id_list(2, {1, 2}, 1)).ok());     // truncated
  auto ragged = id_list(4, {7, 8});                                 // 9 bytes of body: not whole
  ragged[4] = std::byte{8};
  ragged.pop_back();
  EXPECT_FALSE(value_from_msgpack(ragged).ok());
}

// The Python writer's in-place narrowing of an id list (4-byte values to 1 or 2 bytes each): every
// value's low bytes land at its place, unsigned and signed, at every length around the vector
// steps (8 and 16 values) and their tails, and nothing past n * w is needed to read them back.
TEST(Msgpack, NarrowedIdListsKeepEveryValueInPlace) {
  std::mt19937 rng(7);
  for (uint32_t w : {1u, 2u})
    for (bool sign : {false, true})
      for (size_t n = 0; n <= 70; ++n) {
        const uint32_t bits = 8 * w;
        std::uniform_int_distribution<int64_t> pick(sign ? -(int64_t(1) << (bits - 1)) : 0,
                                                    sign ? (int64_t(1) << (bits - 1)) - 1 : (int64_t(1) << bits) - 1);
        std::vector<int64_t> want(n);
        std::vector<uint8_t> d(4 * n + 1, 0xee);
        for (size_t i = 0; i < n; ++i) {
          // the extremes first, then random values
          want[i] = i == 0 ? pick.min() : i == 1 ? pick.max() : pick(rng);
          const uint32_t u = uint32_t(want[i]);
          for (int b = 0; b < 4; ++b) d[4 * i + size_t(b)] = uint8_t(u >> (8 * b));
        }
        detail::narrow_ids(d.data(), n, w);
        EXPECT_EQ(d[4 * n], 0xee) << "wrote past the values";
        for (size_t i = 0; i < n; ++i) {
          const int64_t got = sign ? int64_t(detail::signed_id_at(d.data(), w, i)) : int64_t(detail::id_at(d.data(), w, i));
          ASSERT_EQ(got, want[i]) << "w " << w << " signed " << sign << " n " << n << " i " << i;
        }
      }
}

// The id-list writer's width pass: the narrowest width (and signedness) that holds every value,
// wherever in the list (the vector steps or the tail) the value that decides it sits.
TEST(Msgpack, IdListWidthIsTheNarrowestThatHoldsEveryValue) {
  struct Case {
    int64_t v;
    uint8_t want;
  };
  const uint8_t S = detail::kIdListSigned;
  const Case cases[] = {{0, 1},         {255, 1},         {256, 2},           {65535, 2},       {65536, 4},
                        {(1 << 30) - 1, 4}, {-1, uint8_t(1 | S)}, {-128, uint8_t(1 | S)}, {-129, uint8_t(2 | S)},
                        {-32768, uint8_t(2 | S)}, {-32769, uint8_t(4 | S)}, {-(1 << 30), uint8_t(4 | S)}};
  auto put = [](std::vector<uint8_t>& d, size_t i, int64_t v) {
    const uint32_t u = uint32_t(v);
    for (int b = 0; b < 4; ++b) d[4 * i + size_t(b)] = uint8_t(u >> (8 * b));
  };
  for (size_t n = 1; n <= 19; ++n)
    for (size_t at = 0; at < n; ++at)
      for (const Case& c : cases) {
        // Small values everywhere (127 fits every width and sign) and the deciding one at `at`.
        std::vector<uint8_t> d(4 * n);
        for (size_t i = 0; i < n; ++i) put(d, i, 127);
        put(d, at, c.v);
        ASSERT_EQ(detail::id_list_width(d.data(), n), c.want) << "v " << c.v << " n " << n << " at " << at;
        // Beside a negative small value, an unsigned-only width turns signed and may widen.
        if (c.v >= 0 && n > 1) {
          put(d, (at + 1) % n, -1);
          const uint8_t w = c.v < 0x80 ? 1 : c.v < 0x8000 ? 2 : 4;
          ASSERT_EQ(detail::id_list_width(d.data(), n), uint8_t(w | S)) << "v " << c.v << " n " << n << " at " << at;
        }
      }
  EXPECT_EQ(detail::id_list_width(nullptr, 0), 1);  // nothing to hold
}

// Lists of floats as the Python layer writes them (msgpack ext type 3: 8-byte little-endian
// doubles): a C++ reader gets a list of doubles, every bit kept; a body that is not whole doubles
// is an error.
TEST(Msgpack, FloatListsReadAsListsOfDoublesAndRaggedOnesAreErrors) {
  const std::vector<double> vals{1.5, -0.0, std::numeric_limits<double>::infinity(), -2.25e300, 0.1};
  std::vector<std::byte> b;
  const uint32_t body = 8 * uint32_t(vals.size());
  for (uint8_t x : {uint8_t(0xc9), uint8_t(body >> 24), uint8_t(body >> 16), uint8_t(body >> 8), uint8_t(body), uint8_t(3)})
    b.push_back(std::byte{x});
  for (double v : vals) {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    for (int i = 0; i < 8; ++i) b.push_back(std::byte(uint8_t(bits >> (8 * i))));
  }
  auto dec = value_from_msgpack(b);
  ASSERT_TRUE(dec.ok()) << dec.error().to_string();
  const auto& l = dec->as<Value::List>();
  ASSERT_EQ(l.size(), vals.size());
  for (size_t i = 0; i < vals.size(); ++i) {
    EXPECT_EQ(l[i].as<double>(), vals[i]);
    EXPECT_EQ(std::signbit(l[i].as<double>()), std::signbit(vals[i]));
  }
  auto ragged = b;  // 39 bytes of body: not whole doubles
  ragged[4] = std::byte{39};
  ragged.pop_back();
  EXPECT_FALSE(value_from_msgpack(ragged).ok());
  b.pop_back();  // truncated
  EXPECT_FALSE(value_from_msgpack(b).ok());
}

// Regression: msgpack-c 4 packs a double holding a whole number as an int, so 2.0 came back as
// the integer 2 (and -0.0 as 0): a float must stay a float, with its sign.
TEST(Msgpack, WholeNumberDoublesStayDoubles) {
  for (double d : {2.0, 0.0, -0.0, -1.0, 9007199254740992.0, 1e300, 0.5}) {
    auto dec = value_from_msgpack(value_to_msgpack(Value(Value::List{Value(d)})));
    ASSERT_TRUE(dec.ok()) << dec.error().to_string();
    const Value& x = dec->as<Value::List>()[0];
    ASSERT_TRUE(x.is<double>()) << d;
    EXPECT_EQ(x.as<double>(), d);
    EXPECT_EQ(std::signbit(x.as<double>()), std::signbit(d)) << d;
  }
}

// Regression: a timeout of 1e300 s, infinity or NaN overflowed its nanoseconds (undefined
// behaviour); they mean "no deadline", as a negative one does.
TEST(Deadlines, InfiniteNaNAndAbsurdTimeoutsHaveNoDeadline) {
  for (double t : {-1.0, std::numeric_limits<double>::infinity(), std::nan(""), 1e300, 1e9})
    EXPECT_EQ(deadline_ns(t, 1000), 0u) << t;
  EXPECT_EQ(deadline_ns(0, 1000), 1000u);
  EXPECT_EQ(deadline_ns(2.5, 1000), 1000u + 2'500'000'000u);
  EXPECT_EQ(deadline_after(1e300), Deadline::max());
  EXPECT_EQ(deadline_after(std::numeric_limits<double>::infinity()), Deadline::max());
  const Deadline past = deadline_after(-3);
  EXPECT_LE(past, Clock::now());
  const Deadline soon = deadline_after(5);
  EXPECT_GT(soon, Clock::now() + std::chrono::seconds(4));
}

TEST(Msgpack, EveryTruncationAndRandomCorruptionIsAnErrorNotACrash) {
  auto enc = value_to_msgpack(every_width());
  for (size_t n = 0; n < enc.size(); n += (n < 4096 ? 1 : 97)) {
    auto d = value_from_msgpack(std::span<const std::byte>(enc.data(), n));
    ASSERT_FALSE(d.ok()) << "prefix of " << n << " bytes decoded";
    EXPECT_EQ(d.error().code, Errc::corrupt);
  }
  // Random byte flips: any outcome but a crash or a read out of bounds (ASan/valgrind-clean).
  std::vector<std::byte> small = value_to_msgpack(Value(Value::List{Value("ab"), Value(TensorRef{1}),
                                                                     Value(Value::Map{{"x", Value(1.0)}})}));
  EXPECT_GT(rejected_of_random_flips(small, small.size(), 3, 7, [](auto& c) { return !value_from_msgpack(c).ok(); }), 0);
}

// What Python's strict decoder takes, nothing more: strings that leave C++ for Python are checked
// with it, so a damaged one is an error of ours, not a UnicodeDecodeError from deep inside.
TEST(Utf8, AcceptsWellFormedAndRejectsEveryIllFormedKind) {
  for (const char* ok : {"", "plain", "caf\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xed\x9f\xbf",
                         "\xf4\x8f\xbf\xbf", "\xee\x80\x80"})
    EXPECT_TRUE(is_utf8(ok)) << ok;
  for (const char* bad : {"\x80", "\xbf", "\xc0\xaf", "\xc1\xbf",  // stray continuation; overlong 2-byte
                          "\xc3", "\xe2\x82", "\xf0\x9f\x98",            // truncated
                          "\xe0\x80\xaf", "\xf0\x80\x80\xaf",           // overlong 3- and 4-byte
                          "\xed\xa0\x80", "\xed\xbf\xbf",               // surrogates
                          "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xff",  // past U+10FFFF; never a lead
                          "ok\xc3(", "\xe2\x28\xa1"})                     // a bad continuation
    EXPECT_FALSE(is_utf8(bad)) << bad;
}

TEST(Frame, CorruptTensorTablesAreRejectedByTheInPlaceReader) {
  std::vector<std::byte> a(64), b(16);
  auto good = encode_frame(sample_payload(a, b)).value();
  FrameHeader h;
  std::memcpy(&h, good.data(), sizeof h);
  // Every byte of the msgpack header set to each of a few telling values (zero, 0xff, the unused
  // tag 0xc1, an array32 tag, the largest fixint), one at a time.
  int rejected = 0;
  for (size_t i = kFrameHeaderBytes; i < kFrameHeaderBytes + h.header_len; ++i) {
    for (uint8_t x : {0x00, 0xff, 0xc1, 0xdd, 0x7f}) {
      auto f = good;
      f[i] = std::byte{x};
      if (!expect_corrupt_or_in_bounds(f)) ++rejected;
    }
  }
  EXPECT_GT(rejected, int(h.header_len));  // most single-byte damage is caught, not decoded
}

TEST(Names, ValidatesOutsideInput) {
  EXPECT_TRUE(validate_name("key", "req-1_chunk.3", 160).ok());
  EXPECT_FALSE(validate_name("key", "", 160).ok());
  EXPECT_FALSE(validate_name("key", "a/b", 160).ok());
  EXPECT_FALSE(validate_name("key", "a..b", 160).ok());
  EXPECT_FALSE(validate_name("key", std::string(161, 'x'), 160).ok());
  EXPECT_FALSE(validate_name("key", std::string("a\0b", 3), 160).ok());
  EXPECT_EQ(make_internal_key("k", "0", "1"), "k@0_1");
  // The table-driven check against the rule written out, on every 1-, 2- and 3-byte pattern of
  // interesting bytes.
  auto reference = [](const std::string& n) {
    if (n.find("..") != std::string::npos) return false;
    for (unsigned char c : n)
      if (c < 0x20 || c == 0x7f || c == '/') return false;
    return true;
  };
  std::string bytes;
  for (int c = 0; c < 256; ++c) bytes += char(c);
  for (char a : bytes) {
    for (char b : bytes) {
      const std::string two{a, b};
      ASSERT_EQ(name_is_valid(two, 160), reference(two)) << int((unsigned char)a) << "," << int((unsigned char)b);
    }
    for (const char* mid : {".", "x", "/"}) {
      const std::string three = std::string(1, a) + mid + ".";
      ASSERT_EQ(name_is_valid(three, 160), reference(three)) << three;
    }
  }
}

TEST(Factory, UnknownConnectorsAndTheMooncakeStoreFromCpp) {
  auto r = create_connector("NoSuchConnector", Value());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::not_found);
  EXPECT_NE(r.error().message.find("SharedMemoryConnector"), std::string::npos);
  auto m = create_connector("MooncakeStoreConnector", Value());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code, Errc::unsupported);
  EXPECT_NE(m.error().message.find("Python"), std::string::npos) << m.error().message;  // it drives Mooncake's Python client
  EXPECT_NE(m.error().message.find("StoreConnector"), std::string::npos);
  // vLLM-Omni's other name for it: known, and the same answer.
  auto alias = create_connector("MooncakeConnector", Value());
  ASSERT_FALSE(alias.ok());
  EXPECT_EQ(alias.error().code, Errc::unsupported) << alias.error().message;
}

namespace {
class EchoConnector : public Connector {
 public:
  const std::string& name() const override { return n_; }
  Result<PutResult> do_put(const std::string&, const std::string&, const std::string&, const Payload&, const PutOptions&) override {
    return PutResult{42, Value()};
  }
  Result<GetResult> do_get(const std::string&, const std::string&, const std::string&, const Value*, Deadline, const GetOptions&) override {
    return make_error(Errc::not_found, "empty");
  }
  size_t do_cleanup(const std::string&) override { return 0; }
  Value health() override { return Value(); }
  void close() override {}
  std::string n_ = "EchoConnector";
};
}  // namespace

TEST(Factory, UserRegisteredConnector) {
  register_connector("EchoConnector", [](const Value&) -> Result<std::unique_ptr<Connector>> {
    return std::unique_ptr<Connector>(new EchoConnector());
  });
  auto c = create_connector("EchoConnector", Value());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c.value()->put("0", "1", "k", Payload{})->size, 42u);
  // Registered by name alone: no traits (its data treated as crossing hosts), no option check.
  auto d = find_connector("EchoConnector");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->traits, 0u);
  EXPECT_TRUE(check_connector_options("EchoConnector", Value(Value::Map{{"anything", Value(1.5)}})).ok());
}

TEST(Factory, DescriptorsAreTheOneSourceOfWhatAConnectorIs) {
  // Issue 62: names, aliases, schema, traits and factory in one descriptor per connector.
  auto shm = find_connector("SharedMemoryConnector");
  ASSERT_TRUE(shm.has_value());
  EXPECT_TRUE(shm->has(ConnectorTrait::host_local));
  EXPECT_TRUE(shm->has(ConnectorTrait::pickle_default));
  EXPECT_TRUE(shm->has(ConnectorTrait::lookup_gets));
  EXPECT_FALSE(shm->has(ConnectorTrait::side_channel));
  ASSERT_NE(shm->schema, nullptr);
  // The common keys are nested once and found through every connector's schema.
  ASSERT_NE(shm->schema->find("allow_pickle"), nullptr);
  ASSERT_NE(shm->schema->find("stage_id"), nullptr);
  auto te = find_connector("MooncakeTransferEngineConnector");  // an alias finds its descriptor
  ASSERT_TRUE(te.has_value());
  EXPECT_EQ(te->name, "TransferEngineConnector");
  EXPECT_TRUE(te->has(ConnectorTrait::side_channel));
  EXPECT_FALSE(te->has(ConnectorTrait::host_local));
  EXPECT_FALSE(te->has(ConnectorTrait::pickle_default));
  // The TE's own `role` (a choice) shadows the common one (a string).
  EXPECT_EQ(te->schema->find("role")->type, options::Type::choice);
  auto bad_role = check_connector_options("TransferEngineConnector", Value(Value::Map{{"role", Value("boss")}}));
  ASSERT_FALSE(bad_role.ok());
  EXPECT_NE(bad_role.error().message.find("extra.role must be one of"), std::string::npos) << bad_role.error().message;
  auto bad_strict = check_connector_options("StoreConnector", Value(Value::Map{{"strict", Value("yes")}}));
  ASSERT_FALSE(bad_strict.ok());
  EXPECT_NE(bad_strict.error().message.find("StoreConnector: extra.strict must be true or false"), std::string::npos)
      << bad_strict.error().message;
  auto ms = find_connector("MooncakeConnector");
  ASSERT_TRUE(ms.has_value());
  EXPECT_TRUE(ms->has(ConnectorTrait::python_made));
  EXPECT_FALSE(ms->python.empty());
  // Every name and alias is listed once.
  const auto names = registered_connectors();
  for (const char* n : {"SharedMemoryConnector", "TransferEngineConnector", "MooncakeTransferEngineConnector",
                        "StoreConnector", "MooncakeStoreConnector", "MooncakeConnector"})
    EXPECT_EQ(std::count(names.begin(), names.end(), n), 1) << n;
  // A descriptor registered with a schema and no reader of its own is checked by the schema.
  static constexpr options::Key kKeys[] = {{"depth", options::Type::integer, "1", "how deep", 1, 4}};
  static constexpr options::Schema kSchema{"DeepConnector", "extra.", kKeys, false, options::kCommonConnectorKeys};
  ConnectorDescriptor deep;
  deep.name = "DeepConnector";
  deep.aliases = {"Deep"};
  deep.schema = &kSchema;
  deep.factory = [](const std::string& as, const Value&) -> Result<std::unique_ptr<Connector>> {
    auto c = std::make_unique<EchoConnector>();
    c->n_ = as;
    return std::unique_ptr<Connector>(std::move(c));
  };
  register_connector(deep);
  auto made = create_connector("Deep", Value());
  ASSERT_TRUE(made.ok());
  EXPECT_EQ(made.value()->name(), "Deep");  // made under the name it was asked for
  EXPECT_TRUE(check_connector_options("Deep", Value(Value::Map{{"depth", Value(int64_t(3))}})).ok());
  auto deeper = check_connector_options("DeepConnector", Value(Value::Map{{"depth", Value(int64_t(9))}}));
  ASSERT_FALSE(deeper.ok());
  EXPECT_NE(deeper.error().message.find("DeepConnector: extra.depth must be an integer in [1, 4], got 9"),
            std::string::npos) << deeper.error().message;
  EXPECT_FALSE(check_connector_options("DeepConnector", Value(Value::Map{{"strict", Value(int64_t(2))}})).ok());
}

TEST(Factory, RelayBackendsSayWhereTheirDataGoes) {
  std::vector<std::string> names;
  for (const RelayBackend& b : relay_backends()) names.emplace_back(b.name);
  EXPECT_EQ(names, (std::vector<std::string>{"shm", "ucx", "local", "connector"}));
  auto cfg = [](Value::Map m) { return RelayConfig::from_value(Value(std::move(m))).value(); };
  EXPECT_TRUE(cfg({{"backend", Value("shm")}}).host_local());
  EXPECT_EQ(cfg({{"backend", Value("shm")}}).connector_name(), "SharedMemoryConnector");
  EXPECT_TRUE(cfg({{"backend", Value("local")}}).host_local());
  EXPECT_EQ(cfg({{"backend", Value("local")}}).connector_name(), "");
  EXPECT_FALSE(cfg({{"backend", Value("ucx")}}).host_local());
  EXPECT_EQ(cfg({{"backend", Value("ucx")}}).connector_name(), "TransferEngineConnector");
  // A connector backend takes its connector's trait, alias or not.
  EXPECT_TRUE(cfg({{"backend", Value("connector")}, {"connector", Value("SharedMemoryConnector")}}).host_local());
  EXPECT_FALSE(cfg({{"backend", Value("connector")}, {"connector", Value("StoreConnector")}}).host_local());
  EXPECT_FALSE(cfg({{"backend", Value("connector")}, {"connector", Value("NoSuchConnector")}}).host_local());
}

TEST(HostPool, DroppedLargeBuffersAreReusedAndBounded) {
  host_pool::trim();
  const auto before = host_pool::stats();
  const std::byte* first = nullptr;
  {
    auto a = host_pool::allocate(3u << 20);
    ASSERT_TRUE(a);
    first = a.get();
    std::memset(a.get(), 1, 3u << 20);  // faulted in now; the next user of this buffer is not
  }
  EXPECT_EQ(host_pool::stats().cached_buffers, 1u);
  {
    auto b = host_pool::allocate((3u << 20) - 100);  // same 2 MiB-rounded size: the same buffer
    EXPECT_EQ(b.get(), first);
    auto c = host_pool::allocate(64u << 20);  // nothing idle that large: a fresh mapping
    EXPECT_NE(c.get(), first);
    auto small = host_pool::allocate(100);  // below the pooled minimum: plain heap memory
    ASSERT_TRUE(small);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.get()) % 16, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(c.get()) % (2u << 20), 0u);
  }
  const auto after = host_pool::stats();
  EXPECT_EQ(after.hits - before.hits, 1u);
  EXPECT_EQ(after.misses - before.misses, 2u);
  EXPECT_LE(after.cached_bytes, after.limit_bytes);
  // The idle 64 MiB buffer does not serve 16 MiB (it would pin four times what is asked for).
  auto d = host_pool::allocate(16u << 20);
  EXPECT_EQ(host_pool::stats().misses - before.misses, 3u);
  d.reset();
  host_pool::trim();
  EXPECT_EQ(host_pool::stats().cached_bytes, 0u);
}

// copy_of and copy_into_fresh map fresh pages ahead of the copy (from 8 MiB) and copy two halves
// in two threads (fresh from 64 MiB, pooled from 16 MiB): every byte lands where it belongs, at
// sizes and offsets that are not whole pages, fresh buffers and pooled ones alike.
TEST(HostPool, CopiesIntoFreshAndPooledMemoryAreExact) {
  host_pool::trim();
  for (size_t n : {size_t(0), size_t(100), (size_t(1) << 20) + 3, (size_t(9) << 20) + 5, (size_t(17) << 20) + 9,
                   (size_t(70) << 20) + 7}) {
    const auto src = testing_util::pattern(n, uint32_t(n));
    for (int round = 0; round < 2; ++round) {  // the second: a pooled buffer (n >= 1 MiB)
      auto c = host_pool::copy_of(src);
      ASSERT_TRUE(c || n == 0) << n;
      if (n) EXPECT_EQ(std::memcmp(c.get(), src.data(), n), 0) << n << " round " << round;
    }
  }
  // Into malloc's memory at an odd offset (what a new Python bytes is).
  const size_t n = (size_t(66) << 20) + 11;
  const auto src = testing_util::pattern(n, 66);
  std::unique_ptr<std::byte[]> raw(new std::byte[n + 3]);
  host_pool::copy_into_fresh(raw.get() + 3, src.data(), n);
  EXPECT_EQ(std::memcmp(raw.get() + 3, src.data(), n), 0);
  host_pool::trim();
}

// The CUDA driver is loaded at run time: where there is none (CI, this machine) every answer is
// "unsupported" with the reason, never a crash; where there is one, its devices have UUIDs.
TEST(Cuda, DriverLoadsOrSaysWhy) {
  auto d = cuda::driver();
  const Value st = cuda::status();
  const Value* avail = st.find("available");
  ASSERT_TRUE(avail && avail->is<bool>());
  EXPECT_EQ(avail->as<bool>(), d.ok());
  if (!d.ok()) {
    EXPECT_EQ(d.error().code, Errc::unsupported);
    EXPECT_FALSE(d.error().message.empty());
    const Value* why = st.find("reason");
    ASSERT_TRUE(why && why->is<std::string>());
    EXPECT_EQ(why->as<std::string>(), d.error().message);
    EXPECT_TRUE(cuda::devices().empty());
    auto again = cuda::driver();  // the same answer, without loading again
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.error().message, d.error().message);
    GTEST_SKIP() << "no GPU here: " << d.error().message;
  }
  EXPECT_GT((*d)->device_count, 0);
  EXPECT_GT((*d)->version, 0);
  const auto devs = cuda::devices();
  ASSERT_EQ(int(devs.size()), (*d)->device_count);
  for (auto& i : devs) {
    EXPECT_EQ(i.uuid.rfind("GPU-", 0), 0u) << i.uuid;
    EXPECT_EQ(i.uuid.size(), 40u) << i.uuid;
    EXPECT_GT(i.total_bytes, 0u);
  }
  EXPECT_TRUE(cuda::check(cuda::kSuccess, "nothing").ok());
  const Status oom = cuda::check(2, "cuMemAlloc of 1 PiB");
  ASSERT_FALSE(oom.ok());
  EXPECT_EQ(oom.error().code, Errc::exhausted);
  EXPECT_NE(oom.error().message.find("CUDA_ERROR_OUT_OF_MEMORY"), std::string::npos) << oom.error().message;
}
