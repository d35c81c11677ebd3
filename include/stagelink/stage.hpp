// C++ pipeline stages. A stage is a function from a payload to a payload; it may stream chunks.
//
//   #include "stagelink/stage.hpp"
//   stagelink::Result<stagelink::Payload> scale(const stagelink::Payload& in, stagelink::StageContext& ctx) {
//     ...                                   // in.tree, in.tensors (views valid during the call)
//     while (true) {                        // a stage fed by a stream: its chunks, in order
//       SL_ASSIGN(auto chunk, ctx.next_chunk());
//       if (!chunk) break;                  // every source has ended
//     }
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
#include <optional>
#include <string_view>

#include "stagelink/frame.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

extern "C" {
// The C interface a stage library exports (version 1). The host fills the inputs; the stage
// fills `output` (malloc'd; the host frees it with free()) or `error`, and returns 0 or -1.
typedef int (*stagelink_stream_fn)(void* opaque, const uint8_t* frame, size_t len);
// Take the next chunk streamed to the stage (a frame, valid until the next call or the end of the
// stage call), waiting at most timeout_s (negative: the pipeline's request_timeout_s). Returns 0
// with *frame/*len set, 1 once every source has ended, -1 the request was aborted or an upstream
// stage failed, -2 timed out (for -1/-2 the host writes why into `error`).
typedef int (*stagelink_chunk_fn)(void* opaque, double timeout_s, const uint8_t** frame, size_t* len);
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
// Version 2 (what stage processes pass): version 1's fields, then the stage's incoming stream. The
// entry point still takes a stagelink_stage_call_v1*; abi_version says which it points to.
struct stagelink_stage_call_v2 {
  stagelink_stage_call_v1 v1;  // abi_version 2
  stagelink_chunk_fn next_chunk;
  void* chunk_opaque;
};
}

namespace stagelink {

struct StageContext {
  std::string_view request_id, stage;
  // Stream `chunk` to the stage's stream_to targets (a terminal stage's go to the coordinator).
  // Errors: cancelled (the request was aborted), invalid_argument.
  std::function<Status(const Payload&)> stream;
  // The next chunk streamed to this stage (stream_to names it), in order across its sources; an
  // empty optional once every source has ended. The chunk's tensors view memory valid until the
  // next call or the end of the stage call: copy what you keep. timeout_s < 0: the pipeline's
  // request_timeout_s. Errors: timeout; cancelled (the request was aborted, or a stage streaming
  // to this one failed; the message says which); unsupported (a host of stage ABI 1).
  Result<std::optional<Payload>> next_chunk(double timeout_s = -1) const {
    if (!next_chunk_fn) return make_error(Errc::unsupported, "this host passes no stream (stage ABI 1)");
    return next_chunk_fn(timeout_s);
  }
  std::function<Result<std::optional<Payload>>(double)> next_chunk_fn;
};

using StageFn = Result<Payload> (*)(const Payload& input, StageContext& ctx);

namespace detail {
inline int stage_fail(stagelink_stage_call_v1* c, const std::string& msg) {
  std::snprintf(c->error, sizeof c->error, "%s", msg.c_str());
  return -1;
}
// The body of an exported entry point: frame in, fn, frame out. Exceptions become errors.
inline int run_stage(stagelink_stage_call_v1* c, StageFn fn) {
  if (!c || c->abi_version < 1 || c->abi_version > 2)
    return c ? stage_fail(c, "stagelink stage ABI version mismatch (want 1 or 2)") : -1;
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
    if (c->abi_version >= 2) {
      auto* c2 = reinterpret_cast<stagelink_stage_call_v2*>(c);
      ctx.next_chunk_fn = [c2](double timeout_s) -> Result<std::optional<Payload>> {
        stagelink_stage_call_v1* c1 = &c2->v1;
        if (!c2->next_chunk) return make_error(Errc::unsupported, "this host passes no stream");
        const uint8_t* f = nullptr;
        size_t n = 0;
        c1->error[0] = '\0';
        const int rc = c2->next_chunk(c2->chunk_opaque, timeout_s, &f, &n);
        if (rc == 1) return std::optional<Payload>{};
        if (rc == -2) return make_error(Errc::timeout, c1->error);
        if (rc != 0) return make_error(Errc::cancelled, c1->error[0] ? c1->error : "stream refused");
        if (!f && n) return make_error(Errc::corrupt, "the host passed a chunk without bytes");
        auto p = decode_frame(std::span<const std::byte>(reinterpret_cast<const std::byte*>(f), n));
        if (!p.ok()) return make_error(p.error().code, "chunk: " + p.error().message);
        return std::optional<Payload>(std::move(p).value());
      };
    }
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
