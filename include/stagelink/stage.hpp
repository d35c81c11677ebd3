// C++ pipeline stages. A stage is a function from a payload to a payload; it may stream chunks.
//
//   #include "stagelink/stage.hpp"
//   stagelink::Result<stagelink::Payload> scale(const stagelink::Payload& in, stagelink::StageContext& ctx) {
//     ...                                   // in.tree, in.tensors (views valid during the call)
//     SL_TRY(ctx.stream(chunk));            // to the stage's stream_to targets
//     return out;                           // to its next targets
//   }
//   STAGELINK_STAGE(scale_stage, scale)     // exports the C entry point `scale_stage`
//
// Build it into a shared library linked with libstagelink (static); a pipeline file names it
// `factory: "cpp:path/to/libmystages.so:scale_stage"` (a relative path is taken from the file's
// directory). The stage process loads the library and calls the entry point with the request's
// payload as a stagelink frame, the one wire format, so the library may be built by any compiler
// and links no Python. Payloads are what a frame holds: trees of maps, lists, strings, numbers,
// bytes and tensors (numpy arrays and torch tensors on the Python side).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string_view>

#include "stagelink/frame.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

extern "C" {
// The C interface a stage library exports (version 1). The host fills the inputs; the stage
// fills `output` (malloc'd; the host frees it with free()) or `error`, and returns 0 or -1.
typedef int (*stagelink_stream_fn)(void* opaque, const uint8_t* frame, size_t len);
struct stagelink_stage_call_v1 {
  uint32_t abi_version;      // 1
  const char* request_id;
  const char* stage;
  const uint8_t* input;      // a frame
  size_t input_len;
  stagelink_stream_fn stream;  // send a chunk (a frame); returns 0, or -1 (e.g. aborted)
  void* stream_opaque;
  uint8_t* output;           // out: a frame, malloc'd
  size_t output_len;
  char error[4096];          // out: why it failed
};
}

namespace stagelink {

struct StageContext {
  std::string_view request_id, stage;
  // Stream `chunk` to the stage's stream_to targets (a terminal stage's go to the coordinator).
  // Errors: cancelled (the request was aborted), invalid_argument.
  std::function<Status(const Payload&)> stream;
};

using StageFn = Result<Payload> (*)(const Payload& input, StageContext& ctx);

namespace detail {
inline int stage_fail(stagelink_stage_call_v1* c, const std::string& msg) {
  std::snprintf(c->error, sizeof c->error, "%s", msg.c_str());
  return -1;
}
// The body of an exported entry point: frame in, fn, frame out. Exceptions become errors.
inline int run_stage(stagelink_stage_call_v1* c, StageFn fn) {
  if (!c || c->abi_version != 1) return c ? stage_fail(c, "stagelink stage ABI version mismatch (want 1)") : -1;
  c->output = nullptr;
  c->output_len = 0;
  try {
    auto in = decode_frame(std::span<const std::byte>(reinterpret_cast<const std::byte*>(c->input), c->input_len));
    if (!in.ok()) return stage_fail(c, "input: " + in.error().to_string());
    StageContext ctx;
    ctx.request_id = c->request_id ? c->request_id : "";
    ctx.stage = c->stage ? c->stage : "";
    ctx.stream = [c](const Payload& chunk) -> Status {
      auto f = encode_frame(chunk);
      if (!f.ok()) return std::move(f).error();
      if (!c->stream || c->stream(c->stream_opaque, reinterpret_cast<const uint8_t*>(f->data()), f->size()) != 0)
        return make_error(Errc::cancelled, "stream refused (request aborted?)");
      return {};
    };
    auto out = fn(in.value(), ctx);
    if (!out.ok()) return stage_fail(c, out.error().to_string());
    auto f = encode_frame(out.value());
    if (!f.ok()) return stage_fail(c, "output: " + f.error().to_string());
    c->output = static_cast<uint8_t*>(std::malloc(f->size() ? f->size() : 1));
    if (!c->output) return stage_fail(c, "out of memory for the output frame");
    std::memcpy(c->output, f->data(), f->size());
    c->output_len = f->size();
    return 0;
  } catch (const std::exception& e) {
    return stage_fail(c, std::string("C++ exception: ") + e.what());
  } catch (...) {
    return stage_fail(c, "C++ exception of unknown type");
  }
}
}  // namespace detail
}  // namespace stagelink

// Export `fn` (a StageFn) as the C entry point `symbol`.
#define STAGELINK_STAGE(symbol, fn)                                                         \
  extern "C" __attribute__((visibility("default"))) int symbol(stagelink_stage_call_v1* c) { \
    return ::stagelink::detail::run_stage(c, fn);                                           \
  }
