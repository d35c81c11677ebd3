// The payload codec's Python front end: Python objects <-> stagelink frames (Payload), the same
// frames C++ stages read and write (core/frame.hpp is the codec; this packs Python trees straight
// into its msgpack and builds Python objects straight from it, with no Value tree in between, which
// is why it is a front end of its own rather than a conversion to Value). What C++ cannot tell
// apart (numpy or torch, tuples, where a tensor lived) rides in the frame's ext.
#pragma once
#include "python/common.hpp"
#include "python/cuda_tensors.hpp"

namespace stagelink::py {

// ---- Python objects as native frames (no pickle) ----
// A payload's tree is the object's tree of dicts (str keys), lists, tuples, str, int, float, bool
// and None; its leaves numpy arrays, torch tensors and bytes-likes are tensors. What C++ cannot
// tell apart is kept in Payload::ext, which C++ readers ignore:
//   "tk": per tensor, its Python kind and flags (omitted when every tensor is a plain numpy array)
//   "tu": pre-order indices of the lists that were tuples
//   "pickle": 0 when the frame is a pickle-5 stream (regions: the stream, then its buffers)
enum : int64_t {
  kKindNumpy = 0, kKindTorch = 1, kKindBytes = 2, kKindByteArray = 3, kKindMemoryView = 4, kKindMask = 7,
  kFlagReadOnly = 8, kFlagRequiresGrad = 16, kFlagParameter = 32, kFlagScalar = 64, kFlagNumpyScalar = 128,
  kFlagDeviceRef = 256,  // the tensor's bytes are a device record (cuda/device_ref.hpp): it stayed on its GPU
};

// What a frame's ext says (the keys above), read once from Payload::ext or, as gets leave it, its
// msgpack bytes (no Value tree). Malformed: corrupt.
struct ExtInfo {
  std::vector<int64_t> kinds;        // "tk"
  std::vector<uint64_t> tuples;      // "tu"
  std::vector<std::string> devices;  // "td"
  std::vector<std::string> gpus;     // "tg": the UUID of the GPU of each device tensor ("" if unknown)
  std::optional<int64_t> pickle;     // "pickle"
  bool plain() const { return kinds.empty() && tuples.empty() && devices.empty() && gpus.empty() && !pickle; }

  static ExtInfo of(const Payload& p);
};


// The outcome of encoding a Python object as a native frame.
struct Encoding {
  bool ok = false;  // false: the object needs pickle (`why` names the type), or is over `limit`
  size_t total = 0;  // bytes of its tensors
  std::string why;
};
// Python object -> Payload (views held by `bv` until the put returns). `limit` >= 0: fail before
// staging a device tensor that would take the payload past `limit` bytes.
// `ds`: CUDA tensors are left in device arenas (DeviceStaging) instead of staged through the host.
Encoding encode_py(nb::handle obj, Payload& p, BufferViews& bv, int64_t limit = -1, DeviceStaging* ds = nullptr);
// A frame without a pickle as its Python object; `owned`: the tensors' memory is the result's.
// `host_local`: the payload came by a path within this host (shared memory); only then may it
// hold CUDA device records (refused before any driver call otherwise: a record can only be
// valid on the host that made it).
nb::object native_object(const Payload& p, bool zero_copy, const ExtInfo& ext, bool owned = false,
                         bool host_local = false);
// A pickled Python object as a payload: tree [refs], ext {"pickle": kind}, one tensor per region
// (the pickle-5 stream, then its out-of-band buffers; views of the Python buffers, held by `bv`).
// Returns the regions' total bytes.
size_t payload_from_parts(int kind, nb::list regions, BufferViews& bv, Payload& p);

// What a get found: `kind` KIND_OBJECT with `obj` the finished object (a numpy array, a C++
// producer's tree), else a pickle kind with `obj` the list of its regions.
struct Found {
  int64_t kind = KIND_OBJECT;
  nb::object obj;
  size_t size = 0;
};

// What each torch tensor of a zero_copy result passes through (stagelink/__init__.py sets it:
// tensors over read-only shared memory become ReadOnlyInputTensor, whose in-place ops raise instead
// of killing the process with SIGSEGV), called by the decoder as it makes the tensor: no walk of
// the result's tree (in Python a list of 300 ids cost 140-250 us). Lives as long as the module.
extern PyObject* g_zero_copy_hook;

Found found_of(GetResult& g, bool zero_copy, bool allow_pickle, const std::string& key, bool host_local);
// A frame as (KIND_OBJECT, object) or, for a pickle, (its kind, [regions copied out]).
nb::tuple frame_parts(std::span<const std::byte> frame, bool host_local = false);
// A payload as one frame in a bytes object.
nb::bytes frame_bytes(const Payload& p);

}  // namespace stagelink::py
