#include "stagelink/frame.hpp"

#include "core/host_pool.hpp"
#include "core/msgpack_io.hpp"

#include <cstring>

namespace stagelink {
namespace {
constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Lays out a frame for n tensors; spec(i) yields (dtype, shape, nbytes, device) of tensor i.
// The header is packed once, straight from the tree: each region offset is written as a
// fixed-width uint64 placeholder and patched once the header's length is known.
// Fills `plan`, reusing its vectors' capacity (a caller that keeps one plan allocates nothing).
template <class SpecAt>
Status plan_impl(FramePlan& plan, const Value& tree, std::span<const std::byte> packed_tree, const Value& ext,
                 std::span<const std::byte> packed_ext, size_t n, SpecAt spec) {
  if (n > kFrameMaxTensors)
    return make_error(Errc::invalid_argument, "payload has " + std::to_string(n) +
                                                  " tensors; the frame holds at most 65536");
  plan.head.resize(kFrameHeaderBytes + 128 + 40 * n + packed_tree.size() + packed_ext.size());  // room for a typical header; grows if not
  plan.offsets.resize(n);
  plan.lengths.resize(n);
  detail::ByteSink sink(&plan.head, kFrameHeaderBytes);
  detail::Packer pk(sink);
  // The tree goes last: a reader that builds its own objects from the packed tree takes the rest
  // of the header as it is, without a pass to find its end.
  const bool has_ext = !packed_ext.empty() || !ext.is_nil();
  pk.pack_map(has_ext ? 3 : 2);
  if (has_ext) {
    pk.pack_str(1);
    pk.pack_str_body("p", 1);
    if (packed_ext.empty()) detail::pack_value(pk, ext);
    else sink.write(reinterpret_cast<const char*>(packed_ext.data()), packed_ext.size());
  }
  pk.pack_str(1);
  pk.pack_str_body("x", 1);
  pk.pack_array(uint32_t(n));
  for (size_t i = 0; i < n; ++i) {
    const auto [dtype, shape, nbytes, device] = spec(i);
    const bool gpu = device != "cpu";
    pk.pack_array(gpu ? 5 : 4);
    pk.pack_uint8(static_cast<uint8_t>(dtype));
    if (shape.empty()) {
      pk.pack_array(1);
      pk.pack_int64(int64_t(nbytes / dtype_size(dtype)));
    } else {
      pk.pack_array(uint32_t(shape.size()));
      for (auto d : shape) {
        if (d < 0) return make_error(Errc::invalid_argument, "negative tensor dimension");
        pk.pack_int64(d);
      }
    }
    pk.pack_fix_uint64(0);
    plan.offsets[i] = sink.len - 8;  // where to patch the real offset in, below
    pk.pack_uint64(nbytes);
    if (gpu) {
      pk.pack_str(uint32_t(device.size()));
      pk.pack_str_body(device.data(), uint32_t(device.size()));
    }
    plan.lengths[i] = nbytes;
  }
  pk.pack_str(1);
  pk.pack_str_body("t", 1);
  if (packed_tree.empty()) detail::pack_value(pk, tree);
  else sink.write(reinterpret_cast<const char*>(packed_tree.data()), packed_tree.size());
  sink.finish();
  const size_t mp_len = plan.head.size() - kFrameHeaderBytes;
  if (mp_len > kFrameMaxHeader)
    return make_error(Errc::invalid_argument, "frame header of " + std::to_string(mp_len) +
                                                  " bytes exceeds the 64 MiB limit");
  size_t off = align_up(plan.head.size(), kFrameAlign);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t be = __builtin_bswap64(uint64_t(off));
    std::memcpy(plan.head.data() + plan.offsets[i], &be, 8);
    plan.offsets[i] = off;
    off = align_up(off + plan.lengths[i], kFrameAlign);
  }
  plan.total = n == 0 ? plan.head.size() : plan.offsets[n - 1] + plan.lengths[n - 1];
  FrameHeader fh{};
  fh.magic = kFrameMagic;
  fh.version = kFrameVersion;
  fh.flags = 0;
  fh.header_len = uint32_t(mp_len);
  fh.n_tensors = uint32_t(n);
  fh.total_len = plan.total;
  std::memcpy(plan.head.data(), &fh, sizeof fh);
  return {};
}

struct SpecView {
  DType dtype;
  std::span<const int64_t> shape;
  size_t nbytes;
  std::string_view device;
};
}  // namespace

Result<FramePlan> plan_frame(const Value& tree, std::span<const TensorSpec> specs) {
  FramePlan plan;
  SL_TRY(plan_impl(plan, tree, {}, Value(), {}, specs.size(), [&](size_t i) {
    auto& s = specs[i];
    return SpecView{s.dtype, s.shape, s.nbytes, s.device};
  }));
  return plan;
}

Result<FramePlan> plan_frame(const Payload& p) {
  FramePlan plan;
  SL_TRY(plan_frame_into(plan, p));
  return plan;
}

Status plan_frame_into(FramePlan& plan, const Payload& p) {
  const bool single = p.tensors.size() == 1 && p.packed_tree.empty() && p.tree.is<TensorRef>() &&
                      p.tree.as<TensorRef>().index == 0;
  if (single) {
    const Tensor& t = p.tensors[0];
    const FramePlan::Single& s = plan.single;
    if (s.valid && s.dtype == t.dtype && s.nbytes == t.nbytes() && s.shape == t.shape && s.device == t.device &&
        (s.ext.is_nil() ? p.ext.is_nil() : s.ext == p.ext) && s.packed_ext.size() == p.packed_ext.size() &&
        (p.packed_ext.empty() || std::memcmp(s.packed_ext.data(), p.packed_ext.data(), p.packed_ext.size()) == 0))
      return {};  // this layout was checked and planned last time
  }
  plan.single.valid = false;
  for (auto& t : p.tensors) {
    if (t.shape.empty()) continue;
    size_t n = dtype_size(t.dtype);
    for (auto d : t.shape) {
      if (d < 0) return make_error(Errc::invalid_argument, "negative tensor dimension");
      n *= size_t(d);
    }
    if (n != t.nbytes())
      return make_error(Errc::invalid_argument, "tensor shape holds " + std::to_string(n) +
                                                    " bytes but data has " + std::to_string(t.nbytes()));
  }
  SL_TRY(plan_impl(plan, p.tree, p.packed_tree, p.ext, p.packed_ext, p.tensors.size(), [&](size_t i) {
    auto& t = p.tensors[i];
    return SpecView{t.dtype, t.shape, t.nbytes(), t.device};
  }));
  if (single) {
    const Tensor& t = p.tensors[0];
    FramePlan::Single& s = plan.single;
    s.dtype = t.dtype;
    s.shape.assign(t.shape.begin(), t.shape.end());
    s.nbytes = t.nbytes();
    s.device.assign(t.device);
    if (!(s.ext.is_nil() && p.ext.is_nil())) s.ext = p.ext;
    s.packed_ext.assign(p.packed_ext.begin(), p.packed_ext.end());
    s.valid = true;
  }
  return {};
}

void write_frame_head(const FramePlan& plan, std::byte* dst) {
  std::memcpy(dst, plan.head.data(), plan.head.size());
  // Zero the padding so frames are deterministic (a few bytes per region).
  size_t pos = plan.head.size();
  for (size_t i = 0; i < plan.offsets.size(); ++i) {
    if (plan.offsets[i] > pos) std::memset(dst + pos, 0, plan.offsets[i] - pos);
    pos = plan.offsets[i] + plan.lengths[i];
  }
}

void write_frame(const FramePlan& plan, std::span<const Tensor> tensors, std::byte* dst, bool split) {
  write_frame_head(plan, dst);
  for (size_t i = 0; i < tensors.size() && i < plan.offsets.size(); ++i) {
    const size_t n = tensors[i].nbytes();
    if (split)
      host_pool::copy_split(dst + plan.offsets[i], tensors[i].data.data(), n);  // 2 threads from 16 MiB
    else if (n)
      std::memcpy(dst + plan.offsets[i], tensors[i].data.data(), n);
  }
}

Result<std::vector<std::byte>> encode_frame(const Payload& p) {
  SL_ASSIGN(FramePlan plan, plan_frame(p));
  std::vector<std::byte> out(plan.total);
  write_frame(plan, p.tensors, out.data());
  return out;
}

namespace {
Status check_refs(const Value& v, size_t n, int depth) {
  if (depth > 64) return make_error(Errc::corrupt, "payload tree deeper than 64");
  if (v.is<TensorRef>()) {
    if (v.as<TensorRef>().index >= n)
      return make_error(Errc::corrupt, "tree references tensor " +
                                           std::to_string(v.as<TensorRef>().index) + " of " +
                                           std::to_string(n));
  } else if (v.is<Value::List>()) {
    for (auto& e : v.as<Value::List>()) SL_TRY(check_refs(e, n, depth + 1));
  } else if (v.is<Value::Map>()) {
    for (auto& [k, e] : v.as<Value::Map>()) SL_TRY(check_refs(e, n, depth + 1));
  }
  return {};
}
}  // namespace

Result<Payload> decode_frame(std::span<const std::byte> buf, std::shared_ptr<const void> keepalive) {
  Payload p;
  SL_TRY(decode_frame_into(buf, std::move(keepalive), p));
  return p;
}

Result<Payload> decode_frame_copy(std::span<const std::byte> buf) {
  Payload p;
  SL_TRY(decode_frame_copy_into(buf, p));
  return p;
}

Status decode_frame_copy_into(std::span<const std::byte> buf, Payload& p) {
  SL_TRY(decode_frame_into(buf, nullptr, p));
  for (auto& t : p.tensors) {
    // Large ones reuse already-mapped pages, or map fresh ones ahead of the copy.
    std::shared_ptr<std::byte> store = host_pool::copy_of(t.data);
    if (!store)
      return make_error(Errc::exhausted, "no memory for a copy of " + std::to_string(t.data.size()) + " bytes");
    t.data = std::span<const std::byte>(store.get(), t.data.size());
    t.keepalive = std::move(store);
  }
  return {};
}

Status decode_frame_into(std::span<const std::byte> buf, std::shared_ptr<const void> keepalive, Payload& p,
                         bool build_tree) {
  p.tree = Value();
  if (!p.ext.is_nil()) p.ext = Value();
  p.packed_tree = {};
  p.packed_ext = {};
  p.tensors.clear();
  if (buf.size() < kFrameHeaderBytes)
    return make_error(Errc::corrupt, "frame of " + std::to_string(buf.size()) +
                                         " bytes is shorter than its 64-byte header");
  FrameHeader fh;
  std::memcpy(&fh, buf.data(), sizeof fh);
  if (fh.magic != kFrameMagic) return make_error(Errc::corrupt, "bad frame magic");
  if (fh.version != kFrameVersion)
    return make_error(Errc::corrupt, "frame version " + std::to_string(fh.version) +
                                         " is not supported (expected 1)");
  if (fh.total_len > buf.size())
    return make_error(Errc::corrupt, "frame says " + std::to_string(fh.total_len) +
                                         " bytes but buffer has " + std::to_string(buf.size()));
  // Shorter than its own header: `total_len - kFrameHeaderBytes` below would wrap around and let
  // any header length through (found by tests/fuzz/fuzz_frame).
  if (fh.total_len < kFrameHeaderBytes)
    return make_error(Errc::corrupt, "frame says " + std::to_string(fh.total_len) +
                                         " bytes, less than its 64-byte header");
  if (fh.header_len > fh.total_len - kFrameHeaderBytes || fh.header_len > kFrameMaxHeader)
    return make_error(Errc::corrupt, "frame header length " + std::to_string(fh.header_len) +
                                         " runs past the frame");
  // The msgpack header is read in place: the tree into a Value, the tensor table straight into
  // Tensors (no intermediate Value per row).
  detail::MpReader rd(buf.data() + kFrameHeaderBytes, fh.header_len);
  auto bad_header = [&]() { return make_error(Errc::corrupt, "frame header: " + rd.error); };
  uint32_t nkeys;
  if (!rd.read_map(nkeys)) return bad_header();
  bool have_tree = false, have_table = false;
  const size_t data_start = kFrameHeaderBytes + fh.header_len;
  for (uint32_t k = 0; k < nkeys; ++k) {
    std::string_view key;
    if (!rd.read_str(key)) return bad_header();
    if (key == "t") {
      const size_t at = rd.pos();
      if (!build_tree && k + 1 == nkeys) {
        // Last (as stagelink writes it): the rest of the header; the caller's reader checks it.
        p.packed_tree = buf.subspan(kFrameHeaderBytes + at, rd.left());
        rd.skip_rest();
      } else {
        if (!(build_tree ? rd.read_value(p.tree) : rd.skip())) return bad_header();
        if (!build_tree) p.packed_tree = buf.subspan(kFrameHeaderBytes + at, rd.pos() - at);
      }
      have_tree = true;
      continue;
    }
    if (key == "p") {
      if (build_tree) {
        if (!rd.read_value(p.ext)) return bad_header();
      } else {  // left packed, as the tree: the binding reads what it needs from the bytes
        const size_t at = rd.pos();
        if (!rd.skip()) return bad_header();
        p.packed_ext = buf.subspan(kFrameHeaderBytes + at, rd.pos() - at);
      }
      continue;
    }
    if (key != "x") {
      if (!rd.skip()) return bad_header();
      continue;
    }
    uint32_t rows;
    if (!rd.read_array(rows)) return bad_header();
    if (rows != fh.n_tensors)
      return make_error(Errc::corrupt, "tensor table has " + std::to_string(rows) +
                                           " rows, header says " + std::to_string(fh.n_tensors));
    have_table = true;
    p.tensors.reserve(rows);
    for (uint32_t i = 0; i < rows; ++i) {
      auto bad = [&](const std::string& why) {
        return make_error(Errc::corrupt, "tensor " + std::to_string(i) + ": " + why);
      };
      uint32_t cols, ndim;
      uint64_t dt, off, len;
      if (!rd.read_array(cols) || cols < 4 || !rd.read_u64(dt) || !rd.read_array(ndim))
        return bad("malformed row" + (rd.error.empty() ? std::string() : ": " + rd.error));
      if (dt >= uint64_t(kDTypeCount)) return bad("unknown dtype " + std::to_string(dt));
      Tensor& t = p.tensors.emplace_back();
      t.dtype = static_cast<DType>(dt);
      t.shape.resize(ndim);
      uint64_t elems = 1;
      for (auto& x : t.shape) {
        if (!rd.read_i64(x) || x < 0) return bad("bad dimension");
        if (x != 0 && elems > UINT64_MAX / uint64_t(x)) return bad("shape overflows");
        elems *= uint64_t(x);
      }
      if (!rd.read_u64(off) || !rd.read_u64(len))
        return bad("malformed row" + (rd.error.empty() ? std::string() : ": " + rd.error));
      if (off < data_start || off > fh.total_len || len > fh.total_len - off)
        return bad("region [" + std::to_string(off) + ", +" + std::to_string(len) +
                   ") lies outside the frame of " + std::to_string(fh.total_len) + " bytes");
      if (elems > UINT64_MAX / dtype_size(t.dtype) || elems * dtype_size(t.dtype) != len)
        return bad("shape does not match region length " + std::to_string(len));
      if (cols > 4) {
        std::string_view dev;
        if (!rd.read_str(dev)) return bad("malformed device");
        t.device.assign(dev);
      }
      for (uint32_t c = 5; c < cols; ++c)
        if (!rd.skip()) return bad_header();
      t.data = buf.subspan(off, len);
      t.keepalive = keepalive;
    }
  }
  if (!rd.at_end())
    return make_error(Errc::corrupt, "frame header: " + std::to_string(rd.left()) + " trailing bytes");
  if (!have_tree || !have_table) return make_error(Errc::corrupt, "frame header lacks tree or tensor table");
  if (build_tree) SL_TRY(check_refs(p.tree, p.tensors.size(), 0));
  return {};
}

}  // namespace stagelink
