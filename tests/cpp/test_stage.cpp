// C++ stages: the C entry point STAGELINK_STAGE exports, called as a stage process calls it.
#include <gtest/gtest.h>

#include <cstdio>
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
// Reads its stream to the end: the tensor bytes of every chunk, added up.
Result<Payload> drain(const Payload&, StageContext& ctx) {
  uint64_t n = 0, bytes = 0;
  while (true) {
    SL_ASSIGN(std::optional<Payload> chunk, ctx.next_chunk(0.5));
    if (!chunk) break;
    ++n;
    for (const auto& t : chunk->tensors) bytes += t.nbytes();
  }
  Payload out;
  Value::Map m;
  m.emplace_back("chunks", n);
  m.emplace_back("bytes", bytes);
  out.tree = Value(std::move(m));
  return out;
}
}  // namespace

STAGELINK_STAGE(test_echo_twice, echo_twice)
STAGELINK_STAGE(test_throws, throws)
STAGELINK_STAGE(test_drain, drain)

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
  v.abi_version = 3;
  EXPECT_EQ(test_echo_twice(&v), -1);
}

namespace {
struct Incoming {
  std::vector<std::vector<std::byte>> frames;
  size_t next = 0;
  int end_rc = 1;       // what the host answers after the last frame
  double timeout = 0;   // the timeout the stage asked for
  stagelink_stage_call_v1* call = nullptr;
};
int on_chunk(void* opaque, double timeout_s, const uint8_t** f, size_t* n) {
  auto* in = static_cast<Incoming*>(opaque);
  in->timeout = timeout_s;
  if (in->next < in->frames.size()) {
    *f = reinterpret_cast<const uint8_t*>(in->frames[in->next].data());
    *n = in->frames[in->next++].size();
    return 0;
  }
  if (in->end_rc != 1) std::snprintf(in->call->error, sizeof in->call->error, "upstream 'enc' failed");
  return in->end_rc;
}
// A version-2 call whose stream the host serves from `inc` (the caller keeps both alive).
stagelink_stage_call_v2 v2_for(const std::vector<std::byte>& in, Streamed& s, Incoming& inc) {
  stagelink_stage_call_v2 c{};
  c.v1 = call_for(in, s);
  c.v1.abi_version = 2;
  c.next_chunk = on_chunk;
  c.chunk_opaque = &inc;
  return c;
}
}  // namespace

TEST(CppStage, ReadsItsStreamInOrderToTheEnd) {
  const auto in = sample_frame();
  Streamed s;
  Incoming inc;
  for (int i = 0; i < 3; ++i) inc.frames.push_back(sample_frame());
  auto c = v2_for(in, s, inc);
  inc.call = &c.v1;
  ASSERT_EQ(test_drain(&c.v1), 0) << c.v1.error;
  auto out = decode_frame(std::span<const std::byte>(reinterpret_cast<const std::byte*>(c.v1.output), c.v1.output_len));
  ASSERT_TRUE(out.ok());
  uint64_t chunks = 0, bytes = 0;
  ASSERT_TRUE(out->tree.find("chunks")->get_u64(chunks));
  ASSERT_TRUE(out->tree.find("bytes")->get_u64(bytes));
  EXPECT_EQ(chunks, 3u);
  EXPECT_EQ(bytes, 3000u);
  EXPECT_DOUBLE_EQ(inc.timeout, 0.5);
  std::free(c.v1.output);
}

TEST(CppStage, StreamFailuresReachTheStageAsErrors) {
  const auto in = sample_frame();
  Streamed s;
  for (int rc : {-1, -2}) {
    Incoming inc;
    inc.frames.push_back(sample_frame());
    inc.end_rc = rc;
    auto c = v2_for(in, s, inc);
    inc.call = &c.v1;
    EXPECT_EQ(test_drain(&c.v1), -1);
    const std::string err = c.v1.error;
    EXPECT_NE(err.find(rc == -2 ? "timeout" : "cancelled"), std::string::npos) << err;
    EXPECT_NE(err.find("upstream 'enc' failed"), std::string::npos) << err;
  }
  Incoming bad;  // a host passing bytes that are no frame
  bad.frames.push_back(std::vector<std::byte>(12, std::byte{3}));
  auto c = v2_for(in, s, bad);
  bad.call = &c.v1;
  EXPECT_EQ(test_drain(&c.v1), -1);
  EXPECT_NE(std::string(c.v1.error).find("chunk"), std::string::npos) << c.v1.error;
  auto v1 = call_for(in, s);  // a version-1 host: no stream to read
  EXPECT_EQ(test_drain(&v1), -1);
  EXPECT_NE(std::string(v1.error).find("unsupported"), std::string::npos) << v1.error;
}
