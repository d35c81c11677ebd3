// Control-plane messages of the pipeline runtime (SGLang-Omni's design, seed 001): what the
// coordinator and stages tell each other beside the data plane. One small msgpack map per message;
// decoding checks every field's presence, type and size (a malformed message is an error, never a
// crash or a half-filled message).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink {

enum class ControlType : uint8_t {
  submit = 0,    // coordinator -> entry stage: a new request (its payload in `body` or by relay)
  data_ready,    // stage -> stage: a payload (or a stream chunk) is in the relay; `metadata` locates it
  data_ack,      // receiver -> sender: the transfer named by `metadata` was read (credit returns)
  complete,      // terminal stage -> coordinator: the request's result (`body`) or its `error`
  stream,        // stage -> stage or coordinator: a stream chunk (`chunk_id`), or its end (`is_done`)
  shutdown,      // coordinator -> stage: stop after in-flight work
  abort,         // coordinator -> every stage: drop everything of `request_id`
  abort_ack,     // stage -> coordinator: the abort of `request_id` is done here
};
inline constexpr int kControlTypeCount = 8;
const char* control_type_name(ControlType t) noexcept;
Result<ControlType> control_type_from_name(std::string_view name);

struct ControlMessage {
  ControlType type = ControlType::submit;
  std::string request_id;             // required except for shutdown
  std::string from_stage, to_stage;   // empty: not applicable
  Value metadata;                     // relay metadata (data_ready, data_ack, stream); nil: none
  std::optional<uint64_t> chunk_id;   // stream chunks: their number per (request, target)
  bool is_done = false;               // stream: the last signal of the stream
  std::string error;                  // empty: none; else what failed (complete, stream)
  std::vector<std::byte> body;        // small inline payload (a frame), e.g. submit and complete

  bool operator==(const ControlMessage&) const = default;
};

// Limits a decoder enforces (and an encoder refuses to exceed).
inline constexpr size_t kControlMaxId = 256;          // request and stage ids
inline constexpr size_t kControlMaxError = 64u << 10; // error text (a traceback)
inline constexpr size_t kControlMaxBody = 64u << 20;  // inline body

// Errors: invalid_argument (a field out of its limits, a missing request id).
Result<std::vector<std::byte>> encode_control(const ControlMessage& m);
// Errors: corrupt, naming the field and what was wrong with it.
Result<ControlMessage> decode_control(std::span<const std::byte> bytes);

}  // namespace stagelink
