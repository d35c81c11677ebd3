// Control-plane messages: every type round-trips; malformed bytes are errors, never crashes.
#include <gtest/gtest.h>

#include <random>

#include "stagelink/control.hpp"

using namespace stagelink;

namespace {
ControlMessage sample(ControlType t) {
  ControlMessage m;
  m.type = t;
  m.request_id = "req-42";
  m.from_stage = "thinker";
  m.to_stage = "talker";
  Value::Map md;
  md.emplace_back("entry", uint64_t(7));
  md.emplace_back("gen", uint64_t(3));
  m.metadata = Value(std::move(md));
  if (t == ControlType::stream) m.chunk_id = 17;
  if (t == ControlType::stream) m.is_done = true;
  if (t == ControlType::complete) m.error = "Traceback (most recent call last): ...";
  if (t == ControlType::submit) m.body.assign(100, std::byte{9});
  return m;
}
}  // namespace

TEST(Control, EveryTypeRoundTrips) {
  for (int i = 0; i < kControlTypeCount; ++i) {
    const ControlMessage m = sample(static_cast<ControlType>(i));
    auto bytes = encode_control(m);
    ASSERT_TRUE(bytes.ok()) << bytes.error().message;
    auto back = decode_control(bytes.value());
    ASSERT_TRUE(back.ok()) << control_type_name(m.type) << ": " << back.error().message;
    EXPECT_EQ(back.value(), m) << control_type_name(m.type);
    auto named = control_type_from_name(control_type_name(m.type));
    ASSERT_TRUE(named.ok());
    EXPECT_EQ(named.value(), m.type);
  }
  ControlMessage stop;
  stop.type = ControlType::shutdown;  // the one message without a request
  auto b = encode_control(stop);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(decode_control(b.value()).value(), stop);
}

TEST(Control, EncoderRefusesWhatADecoderWould) {
  ControlMessage m = sample(ControlType::data_ready);
  m.request_id.clear();
  EXPECT_EQ(encode_control(m).error().code, Errc::invalid_argument);
  m.request_id = std::string(kControlMaxId + 1, 'r');
  EXPECT_EQ(encode_control(m).error().code, Errc::invalid_argument);
  EXPECT_EQ(control_type_from_name("resubmit").error().code, Errc::invalid_argument);
}

TEST(Control, MalformedBytesAreCorruptNeverACrash) {
  const auto good = encode_control(sample(ControlType::stream)).value();
  // Every truncation.
  for (size_t n = 0; n < good.size(); ++n) {
    auto r = decode_control(std::span<const std::byte>(good.data(), n));
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.error().code, Errc::corrupt);
  }
  // Random bit flips: a result or a corrupt error, nothing else.
  std::mt19937 g(7);
  for (int i = 0; i < 20000; ++i) {
    auto b = good;
    for (int k = 0; k < 1 + int(g() % 4); ++k) b[g() % b.size()] ^= std::byte(1u << (g() % 8));
    auto r = decode_control(b);
    if (!r.ok()) EXPECT_EQ(r.error().code, Errc::corrupt);
  }
  // Right shape, wrong types and values.
  auto enc = [](Value::Map m) { return value_to_msgpack(Value(std::move(m))); };
  struct Case { Value::Map m; const char* want; };
  auto base = [](const char* t) {
    Value::Map m;
    m.emplace_back("v", uint64_t(1));
    m.emplace_back("t", t);
    return m;
  };
  std::vector<Case> cases;
  cases.push_back({base("data_ready"), "without a request_id"});
  { auto m = base("bogus"); m.emplace_back("rid", "r"); cases.push_back({m, "unknown control message type"}); }
  { auto m = base("stream"); m.emplace_back("rid", uint64_t(5)); cases.push_back({m, "'rid' is not a string"}); }
  { auto m = base("stream"); m.emplace_back("rid", "r"); m.emplace_back("chunk", int64_t(-1)); cases.push_back({m, "'chunk'"}); }
  { auto m = base("stream"); m.emplace_back("rid", "r"); m.emplace_back("done", uint64_t(1)); cases.push_back({m, "'done'"}); }
  { auto m = base("stream"); m.emplace_back("rid", std::string(kControlMaxId + 1, 'x')); cases.push_back({m, "at most"}); }
  { auto m = base("complete"); m.emplace_back("rid", "r"); m.emplace_back("body", "text"); cases.push_back({m, "'body'"}); }
  { Value::Map m; m.emplace_back("t", "submit"); m.emplace_back("rid", "r"); cases.push_back({m, "no version"}); }
  { auto m = base("abort"); m.emplace_back("rid", std::string("r\xc3\x28", 3)); cases.push_back({m, "UTF-8"}); }
  { auto m = base("abort"); m.emplace_back("rid", std::string("\xed\xa0\x80", 3)); cases.push_back({m, "UTF-8"}); }  // a surrogate
  { auto m = base("abort"); m.emplace_back("rid", std::string("\xc0\xaf", 2)); cases.push_back({m, "UTF-8"}); }  // overlong
  { Value::Map m; m.emplace_back("v", uint64_t(2)); m.emplace_back("t", "submit"); cases.push_back({m, "version"}); }
  for (auto& c : cases) {
    auto r = decode_control(enc(c.m));
    ASSERT_FALSE(r.ok()) << c.want;
    EXPECT_EQ(r.error().code, Errc::corrupt);
    EXPECT_NE(r.error().message.find(c.want), std::string::npos) << r.error().message;
  }
  EXPECT_FALSE(decode_control(value_to_msgpack(Value("a string"))).ok());
}
