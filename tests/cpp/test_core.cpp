#include <gtest/gtest.h>

#include <cstring>
#include <random>

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

TEST(Frame, RejectsShapeMismatchOnEncode) {
  std::vector<std::byte> a(10);
  Payload p;
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(a), DType::f32, {3}));
  EXPECT_EQ(encode_frame(p).error().code, Errc::invalid_argument);
}

// Every truncation and many random corruptions of a valid frame: an error or a valid decode whose
// regions lie inside the buffer, never a crash or an out-of-bounds view.
TEST(Frame, TruncatedAndCorruptFramesAreRejected) {
  std::vector<std::byte> a(256), b(64);
  auto f = encode_frame(sample_payload(a, b)).value();
  for (size_t n = 0; n < f.size(); ++n) {
    auto d = decode_frame(std::span<const std::byte>(f.data(), n));
    EXPECT_FALSE(d.ok()) << "truncated to " << n;
    if (!d.ok()) EXPECT_EQ(d.error().code, Errc::corrupt);
  }
  std::mt19937 rng(42);
  int rejected = 0;
  for (int it = 0; it < 20000; ++it) {
    auto g = f;
    int flips = 1 + rng() % 4;
    for (int k = 0; k < flips; ++k) g[rng() % std::min<size_t>(g.size(), 400)] = std::byte(rng());
    auto d = decode_frame(g);
    if (!d.ok()) { ++rejected; continue; }
    for (auto& t : d->tensors) {
      ASSERT_GE(t.data.data(), g.data());
      ASSERT_LE(t.data.data() + t.data.size(), g.data() + g.size());
    }
  }
  EXPECT_GT(rejected, 0);
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

TEST(Msgpack, DeepNestingAndGarbageAreErrors) {
  std::vector<std::byte> deep(200, std::byte{0x91});  // 200 nested one-element arrays
  deep.push_back(std::byte{0xc0});
  EXPECT_FALSE(value_from_msgpack(deep).ok());
  std::vector<std::byte> garbage{std::byte{0xc1}};
  EXPECT_FALSE(value_from_msgpack(garbage).ok());
  std::vector<std::byte> str_too_long{std::byte{0xdb}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff}};
  EXPECT_FALSE(value_from_msgpack(str_too_long).ok());
}

TEST(Names, ValidatesOutsideInput) {
  EXPECT_TRUE(validate_name("key", "req-1_chunk.3", 160).ok());
  EXPECT_FALSE(validate_name("key", "", 160).ok());
  EXPECT_FALSE(validate_name("key", "a/b", 160).ok());
  EXPECT_FALSE(validate_name("key", "a..b", 160).ok());
  EXPECT_FALSE(validate_name("key", std::string(161, 'x'), 160).ok());
  EXPECT_FALSE(validate_name("key", std::string("a\0b", 3), 160).ok());
  EXPECT_EQ(make_internal_key("k", "0", "1"), "k@0_1");
}

TEST(Factory, UnknownAndNotYetBuiltConnectors) {
  auto r = create_connector("NoSuchConnector", Value());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Errc::not_found);
  EXPECT_NE(r.error().message.find("SharedMemoryConnector"), std::string::npos);
  auto m = create_connector("MooncakeTransferEngineConnector", Value());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code, Errc::unsupported);
  EXPECT_NE(m.error().message.find("not built yet"), std::string::npos);
}

namespace {
class EchoConnector : public Connector {
 public:
  const std::string& name() const override { return n_; }
  Result<PutResult> put(const std::string&, const std::string&, const std::string&, const Payload&, const PutOptions&) override {
    return PutResult{42, Value()};
  }
  Result<GetResult> get(const std::string&, const std::string&, const std::string&, const Value*, Deadline, const GetOptions&) override {
    return make_error(Errc::not_found, "empty");
  }
  size_t cleanup(const std::string&) override { return 0; }
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
}
