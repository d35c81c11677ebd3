// C++ stages: the C entry point STAGELINK_STAGE exports, called as a stage process calls it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "stagelink/stage.hpp"

using namespace stagelink;

namespace {
Result<Payload> echo_twice(const Payload& in, StageContext& ctx) {
  SL_TRY(ctx.stream(in));
  SL_TRY(ctx.stream(in));
  Payload out;
  Value::Map m;
  m.emplace_back("request", std::string(ctx.request_id));
  m.emplace_back("tensors", uint64_t(in.tensors.size()));
  out.tree = Value(std::move(m));
  return out;
}
Result<Payload> throws(const Payload&, StageContext&) { throw std::runtime_error("kaboom"); }
}  // namespace

STAGELINK_STAGE(test_echo_twice, echo_twice)
STAGELINK_STAGE(test_throws, throws)

namespace {
struct Streamed {
  std::vector<std::vector<std::byte>> frames;
  int refuse_after = 100;
};
int on_stream(void* opaque, const uint8_t* f, size_t n) {
  auto* s = static_cast<Streamed*>(opaque);
  if (int(s->frames.size()) >= s->refuse_after) return -1;
  s->frames.emplace_back(reinterpret_cast<const std::byte*>(f), reinterpret_cast<const std::byte*>(f) + n);
  return 0;
}
stagelink_stage_call_v1 call_for(const std::vector<std::byte>& in, Streamed& s) {
  stagelink_stage_call_v1 c{};
  c.abi_version = 1;
  c.request_id = "req-9";
  c.stage = "echo";
  c.input = reinterpret_cast<const uint8_t*>(in.data());
  c.input_len = in.size();
  c.stream = on_stream;
  c.stream_opaque = &s;
  return c;
}
std::vector<std::byte> sample_frame() {
  std::vector<std::byte> data(1000, std::byte{7});
  Payload p;
  p.tensors.push_back(Tensor::view_of(data));
  Value::Map m;
  m.emplace_back("x", TensorRef{0});
  p.tree = Value(std::move(m));
  return encode_frame(p).value();
}
}  // namespace

TEST(CppStage, FramesInChunksStreamedResultOut) {
  const auto in = sample_frame();
  Streamed s;
  auto c = call_for(in, s);
  ASSERT_EQ(test_echo_twice(&c), 0) << c.error;
  ASSERT_EQ(s.frames.size(), 2u);
  auto chunk = decode_frame(s.frames[1]);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->tensors[0].nbytes(), 1000u);
  auto out = decode_frame(std::span<const std::byte>(reinterpret_cast<const std::byte*>(c.output), c.output_len));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->tree.find("request")->as<std::string>(), "req-9");
  std::free(c.output);
}

TEST(CppStage, FailuresAreErrorsNeverCrashes) {
  const auto in = sample_frame();
  Streamed s;
  s.refuse_after = 1;  // the host refuses the second chunk (an aborted request)
  auto c = call_for(in, s);
  EXPECT_EQ(test_echo_twice(&c), -1);
  EXPECT_NE(std::string(c.error).find("cancelled"), std::string::npos) << c.error;
  EXPECT_EQ(c.output, nullptr);
  auto t = call_for(in, s);
  EXPECT_EQ(test_throws(&t), -1);
  EXPECT_NE(std::string(t.error).find("kaboom"), std::string::npos);
  std::vector<std::byte> junk(10, std::byte{1});
  auto j = call_for(junk, s);
  EXPECT_EQ(test_echo_twice(&j), -1);
  EXPECT_NE(std::string(j.error).find("input"), std::string::npos);
  auto v = call_for(in, s);
  v.abi_version = 2;
  EXPECT_EQ(test_echo_twice(&v), -1);
}
