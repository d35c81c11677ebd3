// The frame: the one wire format of a payload.
//
//   [FrameHeader: 64 bytes][msgpack header: {"t": tree, "x": tensor table[, "p": ext]}][pad][region 0]...
//
// "p" (optional) is Payload::ext: binding annotations that readers without a use for them skip.
//
// Every tensor region starts at an offset aligned to kFrameAlign from the frame start. The tensor
// table lists, per tensor, [dtype, shape, offset, length, device]. Decoding checks every length and
// offset against the buffer and never reads past it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "stagelink/payload.hpp"

namespace stagelink {

inline constexpr uint32_t kFrameMagic = 0x52464c53;  // "SLFR" little endian
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameAlign = 64;
inline constexpr size_t kFrameHeaderBytes = 64;
inline constexpr size_t kFrameMaxTensors = 1u << 16;
inline constexpr size_t kFrameMaxHeader = 64u << 20;

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;
  uint32_t header_len;  // msgpack header bytes following this struct
  uint32_t n_tensors;
  uint64_t total_len;   // whole frame, header to end of last region
  uint64_t reserved[5];
};
static_assert(sizeof(FrameHeader) == kFrameHeaderBytes);

// What a tensor region will hold, before its bytes exist (used by loans).
struct TensorSpec {
  DType dtype = DType::u8;
  std::vector<int64_t> shape;  // empty: 1-D of nbytes/itemsize
  size_t nbytes = 0;
  std::string device = "cpu";
};

// A frame laid out but not yet written: header bytes and region offsets.
struct FramePlan {
  std::vector<std::byte> head;       // FrameHeader + msgpack header
  std::vector<size_t> offsets;       // region offsets from frame start
  std::vector<size_t> lengths;
  size_t total = 0;
  // The layout this plan was made for when the payload is one tensor that is the whole tree (a
  // numpy array, a single hidden state): plan_frame_into keeps the plan when the next payload
  // has the same dtype, shape, size and device, as a stream of same-shaped tensors does.
  struct Single {
    bool valid = false;
    DType dtype = DType::u8;
    std::vector<int64_t> shape;
    size_t nbytes = 0;
    std::string device;
    Value ext;
    std::vector<std::byte> packed_ext;
  } single;
};

Result<FramePlan> plan_frame(const Value& tree, std::span<const TensorSpec> specs);
Result<FramePlan> plan_frame(const Payload& p);
// As plan_frame, into an existing plan whose vectors keep their capacity (hot paths keep one);
// a plan of the same single-tensor layout is kept as it is.
Status plan_frame_into(FramePlan& plan, const Payload& p);
// Writes head and padding into dst (plan.total bytes); copies `tensors` (may be empty to leave
// regions for the caller to fill, as a loan does).
void write_frame_head(const FramePlan& plan, std::byte* dst);
// `split`: tensors of 16 MiB and more are copied in two threads (a one-off copy whose caller waits
// for it: a connector's put). A stream of them (the queue's writer, beside its reader on a small
// host) measured faster in one.
void write_frame(const FramePlan& plan, std::span<const Tensor> tensors, std::byte* dst, bool split = false);
Result<std::vector<std::byte>> encode_frame(const Payload& p);

// Decode: tensors view into `buf` and share `keepalive`. Errors: corrupt.
Result<Payload> decode_frame(std::span<const std::byte> buf,
                             std::shared_ptr<const void> keepalive = nullptr);
// Decode and copy every region out of `buf` (the result owns its bytes).
Result<Payload> decode_frame_copy(std::span<const std::byte> buf);
// As decode_frame / decode_frame_copy, into `out` (replaced; on error its contents are
// unspecified): no Payload moves on hot paths.
// build_tree false: the tree is left nil and Payload::packed_tree views its msgpack bytes in `buf`
// (tensor references are then unchecked: the caller bounds them by tensors.size()).
Status decode_frame_into(std::span<const std::byte> buf, std::shared_ptr<const void> keepalive, Payload& out,
                         bool build_tree = true);
Status decode_frame_copy_into(std::span<const std::byte> buf, Payload& out);

}  // namespace stagelink
