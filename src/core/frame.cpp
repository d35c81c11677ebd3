#include "stagelink/frame.hpp"

#include <cstring>

namespace stagelink {
namespace {
constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

Value tensor_table(std::span<const TensorSpec> specs, const std::vector<size_t>& offsets) {
  Value::List table;
  table.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& s = specs[i];
    Value::List shape;
    if (s.shape.empty()) shape.emplace_back(int64_t(s.nbytes / dtype_size(s.dtype)));
    else for (auto d : s.shape) shape.emplace_back(int64_t(d));
    Value::List row;
    row.emplace_back(uint64_t(static_cast<uint8_t>(s.dtype)));
    row.emplace_back(std::move(shape));
    row.emplace_back(uint64_t(offsets[i]));
    row.emplace_back(uint64_t(s.nbytes));
    if (s.device != "cpu") row.emplace_back(s.device);
    table.emplace_back(std::move(row));
  }
  return Value(std::move(table));
}
}  // namespace

Result<FramePlan> plan_frame(const Value& tree, std::span<const TensorSpec> specs) {
  if (specs.size() > kFrameMaxTensors)
    return make_error(Errc::invalid_argument, "payload has " + std::to_string(specs.size()) +
                                                  " tensors; the frame holds at most 65536");
  FramePlan plan;
  // The msgpack header's size depends on the offsets, which depend on its size: lay out with
  // 64-bit offsets first (msgpack encodes small ints shorter, so we iterate until stable).
  std::vector<size_t> offsets(specs.size(), 0);
  std::vector<std::byte> mp;
  for (int iter = 0; iter < 4; ++iter) {
    Value::Map hdr;
    hdr.emplace_back("t", tree);
    hdr.emplace_back("x", tensor_table(specs, offsets));
    mp = value_to_msgpack(Value(std::move(hdr)));
    size_t off = align_up(kFrameHeaderBytes + mp.size(), kFrameAlign);
    bool changed = false;
    std::vector<size_t> next(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      next[i] = off;
      off = align_up(off + specs[i].nbytes, kFrameAlign);
    }
    plan.total = specs.empty() ? kFrameHeaderBytes + mp.size()
                               : next.back() + specs.back().nbytes;
    if (next != offsets) changed = true;
    offsets = std::move(next);
    if (!changed) break;
  }
  if (mp.size() > kFrameMaxHeader)
    return make_error(Errc::invalid_argument, "frame header of " + std::to_string(mp.size()) +
                                                  " bytes exceeds the 64 MiB limit");
  FrameHeader fh{};
  fh.magic = kFrameMagic;
  fh.version = kFrameVersion;
  fh.flags = 0;
  fh.header_len = uint32_t(mp.size());
  fh.n_tensors = uint32_t(specs.size());
  fh.total_len = plan.total;
  plan.head.resize(kFrameHeaderBytes + mp.size());
  std::memcpy(plan.head.data(), &fh, sizeof fh);
  std::memcpy(plan.head.data() + kFrameHeaderBytes, mp.data(), mp.size());
  plan.offsets = std::move(offsets);
  plan.lengths.reserve(specs.size());
  for (auto& s : specs) plan.lengths.push_back(s.nbytes);
  return plan;
}

Result<FramePlan> plan_frame(const Payload& p) {
  std::vector<TensorSpec> specs;
  specs.reserve(p.tensors.size());
  for (auto& t : p.tensors) {
    if (!t.shape.empty()) {
      size_t n = dtype_size(t.dtype);
      for (auto d : t.shape) {
        if (d < 0) return make_error(Errc::invalid_argument, "negative tensor dimension");
        n *= size_t(d);
      }
      if (n != t.nbytes())
        return make_error(Errc::invalid_argument,
                          "tensor shape holds " + std::to_string(n) + " bytes but data has " +
                              std::to_string(t.nbytes()));
    }
    specs.push_back(TensorSpec{t.dtype, t.shape, t.nbytes(), t.device});
  }
  return plan_frame(p.tree, specs);
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

void write_frame(const FramePlan& plan, std::span<const Tensor> tensors, std::byte* dst) {
  write_frame_head(plan, dst);
  for (size_t i = 0; i < tensors.size() && i < plan.offsets.size(); ++i)
    if (tensors[i].nbytes()) std::memcpy(dst + plan.offsets[i], tensors[i].data.data(), tensors[i].nbytes());
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
  if (fh.header_len > fh.total_len - kFrameHeaderBytes || fh.header_len > kFrameMaxHeader)
    return make_error(Errc::corrupt, "frame header length " + std::to_string(fh.header_len) +
                                         " runs past the frame");
  SL_ASSIGN(Value hdr, value_from_msgpack(buf.subspan(kFrameHeaderBytes, fh.header_len)));
  const Value* tree = hdr.find("t");
  const Value* table = hdr.find("x");
  if (!tree || !table || !table->is<Value::List>())
    return make_error(Errc::corrupt, "frame header lacks tree or tensor table");
  auto& rows = table->as<Value::List>();
  if (rows.size() != fh.n_tensors)
    return make_error(Errc::corrupt, "tensor table has " + std::to_string(rows.size()) +
                                         " rows, header says " + std::to_string(fh.n_tensors));
  Payload p;
  p.tensors.reserve(rows.size());
  const size_t data_start = kFrameHeaderBytes + fh.header_len;
  for (size_t i = 0; i < rows.size(); ++i) {
    auto bad = [&](const std::string& why) {
      return make_error(Errc::corrupt, "tensor " + std::to_string(i) + ": " + why);
    };
    if (!rows[i].is<Value::List>()) return bad("row is not a list");
    auto& r = rows[i].as<Value::List>();
    uint64_t dt, off, len;
    if (r.size() < 4 || !r[0].get_u64(dt) || !r[2].get_u64(off) || !r[3].get_u64(len) ||
        !r[1].is<Value::List>())
      return bad("malformed row");
    if (dt >= uint64_t(kDTypeCount)) return bad("unknown dtype " + std::to_string(dt));
    if (off < data_start || off > fh.total_len || len > fh.total_len - off)
      return bad("region [" + std::to_string(off) + ", +" + std::to_string(len) +
                 ") lies outside the frame of " + std::to_string(fh.total_len) + " bytes");
    Tensor t;
    t.dtype = static_cast<DType>(dt);
    uint64_t elems = 1;
    for (auto& d : r[1].as<Value::List>()) {
      int64_t x;
      if (!d.get_i64(x) || x < 0) return bad("bad dimension");
      if (x != 0 && elems > UINT64_MAX / uint64_t(x)) return bad("shape overflows");
      elems *= uint64_t(x);
      t.shape.push_back(x);
    }
    if (elems > UINT64_MAX / dtype_size(t.dtype) || elems * dtype_size(t.dtype) != len)
      return bad("shape does not match region length " + std::to_string(len));
    if (r.size() > 4 && r[4].is<std::string>()) t.device = r[4].as<std::string>();
    t.data = buf.subspan(off, len);
    t.keepalive = keepalive;
    p.tensors.push_back(std::move(t));
  }
  SL_TRY(check_refs(*tree, p.tensors.size(), 0));
  p.tree = *tree;
  return p;
}

Result<Payload> decode_frame_copy(std::span<const std::byte> buf) {
  SL_ASSIGN(Payload p, decode_frame(buf, nullptr));
  for (auto& t : p.tensors) {
    auto copy = Tensor::copy_of(t.data, t.dtype, t.shape);
    copy.device = t.device;
    t = std::move(copy);
  }
  return p;
}

}  // namespace stagelink
