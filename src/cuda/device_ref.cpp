// See device_ref.hpp.
#include "cuda/device_ref.hpp"

#include <algorithm>
#include <cstring>

namespace stagelink::cuda {
namespace {

struct Writer {
  std::vector<std::byte>& out;
  template <class T>
  void put(T v) {  // little-endian on the hosts stagelink runs on (x86-64, aarch64)
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof v);
  }
  void raw(const void* p, size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  }
};

struct Reader {
  std::span<const std::byte> in;
  size_t at = 0;
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, in.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  void raw(void* p, size_t n) {
    std::memcpy(p, in.data() + at, n);
    at += n;
  }
};

Error bad(const std::string& why) { return make_error(Errc::corrupt, "device tensor record: " + why); }

}  // namespace

std::vector<std::byte> encode_ref(const DeviceRef& r) {
  std::vector<std::byte> out;
  out.reserve(kDeviceRefFixed + 8 * r.shape.size());
  Writer w{out};
  w.put(kDeviceRefMagic);
  w.put(kDeviceRefVersion);
  w.put(uint8_t(r.dtype));
  w.put(uint8_t(r.shape.size()));
  w.put(r.pid);
  w.put(r.event_id);
  for (uint64_t v : {r.start_time, r.arena_id, r.arena_bytes, r.offset, r.nbytes, uint64_t(0)}) w.put(v);
  w.raw(r.gpu.bytes, 16);
  w.raw(r.mem.reserved, 64);
  w.raw(r.event.reserved, 64);
  for (int64_t d : r.shape) w.put(d);
  return out;
}

Result<DeviceRef> decode_ref(std::span<const std::byte> b) {
  if (b.size() < kDeviceRefFixed) return bad("only " + std::to_string(b.size()) + " bytes");
  Reader rd{b};
  if (rd.get<uint32_t>() != kDeviceRefMagic) return bad("not one (wrong magic)");
  if (const auto v = rd.get<uint16_t>(); v != kDeviceRefVersion) return bad("version " + std::to_string(v) + " unknown here");
  DeviceRef r;
  const uint8_t dt = rd.get<uint8_t>(), nd = rd.get<uint8_t>();
  if (dt >= kDTypeCount) return bad("unknown dtype " + std::to_string(dt));
  r.dtype = DType(dt);
  if (nd > kDeviceRefMaxDims) return bad(std::to_string(nd) + " dimensions");
  if (b.size() != kDeviceRefFixed + 8 * size_t(nd)) return bad(std::to_string(b.size()) + " bytes for " + std::to_string(nd) + " dimensions");
  r.pid = rd.get<uint32_t>();
  r.event_id = rd.get<uint32_t>();
  r.start_time = rd.get<uint64_t>();
  r.arena_id = rd.get<uint64_t>();
  r.arena_bytes = rd.get<uint64_t>();
  r.offset = rd.get<uint64_t>();
  r.nbytes = rd.get<uint64_t>();
  (void)rd.get<uint64_t>();  // reserved
  rd.raw(r.gpu.bytes, 16);
  rd.raw(r.mem.reserved, 64);
  rd.raw(r.event.reserved, 64);
  // The shape's bytes, overflow-checked: they must be the slot's.
  unsigned __int128 total = dtype_size(r.dtype);
  r.shape.resize(nd);
  for (auto& d : r.shape) {
    d = rd.get<int64_t>();
    if (d < 0) return bad("a negative dimension");
    total *= uint64_t(d);
    if (total > (unsigned __int128)(UINT64_MAX)) return bad("a shape past 2^64 bytes");
  }
  if (uint64_t(total) != r.nbytes)
    return bad("shape of " + std::to_string(uint64_t(total)) + " bytes in a slot of " + std::to_string(r.nbytes));
  if (r.offset > r.arena_bytes || r.nbytes > r.arena_bytes - r.offset)
    return bad("slot [" + std::to_string(r.offset) + ", +" + std::to_string(r.nbytes) + ") past its arena's " +
               std::to_string(r.arena_bytes) + " bytes");
  if (r.pid == 0) return bad("no producer");
  return r;
}

Reachability reachability(const CUuuid& gpu, const std::vector<CUuuid>& local, int want,
                          const std::function<bool(int, int)>& can_peer) {
  int here = -1;
  for (size_t i = 0; i < local.size(); ++i)
    if (std::memcmp(local[i].bytes, gpu.bytes, 16) == 0) here = int(i);
  if (here < 0) return {};  // not one of ours: another host, or hidden by CUDA_VISIBLE_DEVICES
  if (want < 0 || want == here) return {Reach::same_device, here};
  if (want < int(local.size()) && can_peer && can_peer(want, here)) return {Reach::peer, want};
  return {Reach::same_device, here};  // read where it lies, then copied to `want`
}

std::optional<SlotBook::Slot> SlotBook::take(size_t n) {
  for (auto& a : arenas_) {
    auto off = a.alloc.allocate(n);
    if (!off.ok()) continue;
    ++a.slots;
    ++in_flight_;
    Slot s{a.id, off.value(), n, 0};
    if (!free_events_.empty()) {
      s.event_id = free_events_.back();
      free_events_.pop_back();
    } else {
      s.event_id = next_event_++;
    }
    return s;
  }
  return std::nullopt;
}

size_t SlotBook::arena_size_for(size_t n) const {
  const size_t r = (std::max<size_t>(n, 1) + align_ - 1) / align_ * align_;
  return std::max(r, arena_bytes_);
}

void SlotBook::add_arena(uint64_t id, size_t bytes) { arenas_.push_back(Arena{id, BufferAllocator(bytes, align_), 0}); }

Status SlotBook::give_back(const Slot& s) {
  for (auto& a : arenas_) {
    if (a.id != s.arena_id) continue;
    if (a.slots == 0) return make_error(Errc::corrupt, "slot given back to an arena with none out");
    SL_TRY(a.alloc.free(s.offset, s.bytes));
    --a.slots;
    --in_flight_;
    free_events_.push_back(s.event_id);
    return {};
  }
  return make_error(Errc::corrupt, "slot of an unknown arena " + std::to_string(s.arena_id));
}

size_t SlotBook::capacity() const {
  size_t c = 0;
  for (auto& a : arenas_) c += a.alloc.capacity();
  return c;
}
size_t SlotBook::used() const {
  size_t c = 0;
  for (auto& a : arenas_) c += a.alloc.used();
  return c;
}
size_t SlotBook::largest_free() const {
  size_t c = 0;
  for (auto& a : arenas_) c = std::max(c, a.alloc.largest_free());
  return c;
}

std::vector<uint64_t> SlotBook::drop_idle_arenas() {
  std::vector<uint64_t> out;
  for (size_t i = 1; i < arenas_.size();) {
    if (arenas_[i].slots == 0) {
      out.push_back(arenas_[i].id);
      arenas_.erase(arenas_.begin() + long(i));
    } else {
      ++i;
    }
  }
  return out;
}

}  // namespace stagelink::cuda
