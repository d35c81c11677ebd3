// The payload codec's Python front end (codec.hpp): PyEncoder packs a Python tree into a frame,
// PyDecoder builds Python objects from one.
#include "python/codec.hpp"

#include "core/counts.hpp"
#include "core/host_pool.hpp"
#include "core/msgpack_io.hpp"
#include "python/arrays.hpp"
#include "python/torch.hpp"

namespace stagelink::py {

PyObject* g_zero_copy_hook = nullptr;

namespace {

bool truthy(const nb::object& o) {
  const int r = PyObject_IsTrue(o.ptr());
  if (r < 0) throw nb::python_error();
  return r == 1;
}

// The value of an exact int of id range (|v| < 2^30: every token id, codec code, count and
// padding), which id lists and msgpack's small ints take; false for others, which go the general
// way. Through CPython's API: reading its int layout directly measured no faster end to end.
inline bool small_int(PyObject* o, long long& v) {
  int overflow = 0;
  v = PyLong_AsLongLongAndOverflow(o, &overflow);
  return !overflow && v > -(1LL << 30) && v < (1LL << 30);
}

// Ints of token-id range, shared across gets: a list of ids is rebuilt with an incref per item
// instead of an allocation (ints are immutable; Python promises no identity for them). 0..255 are
// Python's own cached ints; the rest up to 2^18 (every common vocabulary: Qwen's 151,646 tokens,
// Llama 3's 128,256) are made on first use and kept, at most ~9 MiB for a process that meets
// them all. Larger values are made each time. Called with the GIL held.
constexpr uint64_t kIdCache = 1u << 18;
PyObject** id_table() {  // zeroed pages: only those of ids met take memory (nullptr: no memory)
  static PyObject** table = static_cast<PyObject**>(std::calloc(kIdCache, sizeof(PyObject*)));
  return table;
}
PyObject* id_int(uint64_t v) {
  PyObject** table = id_table();
  if (v >= kIdCache || !table) return PyLong_FromUnsignedLongLong(v);
  PyObject*& slot = table[v];
  if (!slot) {
    slot = PyLong_FromUnsignedLongLong(v);
    if (!slot) return nullptr;
  }
  Py_INCREF(slot);
  return slot;
}

// Python object -> Payload, the tree packed straight into msgpack (no Value tree: ~4 ns per list
// element instead of ~40). run() returns false (with `why`) when the object needs pickle.
struct PyEncoder {
  Payload& p;
  BufferViews& bv;
  std::vector<int64_t> kinds;
  bool any_kind = false;
  std::vector<uint64_t> tuples;
  std::vector<std::string> devices;  // per tensor, where a torch tensor lived ("" for the host)
  std::vector<std::string> gpus;     // per tensor, the UUID of that GPU ("" where unknown)
  uint32_t lists = 0;
  size_t total = 0;
  // encode_object's byte limit (>= 0): a device tensor that would take the payload past it fails
  // the encoding before it is staged through the host (a copy off the GPU for nothing).
  int64_t limit = -1;
  DeviceStaging* staging = nullptr;  // CUDA tensors into device arenas (encode_py's `ds`)
  std::string why;
  std::vector<std::byte>& buf = bv.tree_buffer();  // the packed tree (BufferViews says whose)
  detail::ByteSink sink{&buf, 0};
  detail::Packer pk{sink};

  bool fail(nb::handle h, const char* what = "") {
    if (why.empty()) why = capi::type_name(h.ptr()) + what;
    return false;
  }
  void add(Tensor t, int64_t kind) {
    total += t.nbytes();
    kinds.push_back(kind);
    any_kind |= kind != kKindNumpy;
    p.tensors.push_back(std::move(t));
    const uint32_t i = uint32_t(p.tensors.size() - 1);
    const char be[4] = {char(i >> 24), char(i >> 16), char(i >> 8), char(i)};
    pk.pack_ext(4, detail::kExtTensorRef);
    pk.pack_ext_body(be, 4);
  }
  bool pin(nb::handle h, Py_buffer& v) {
    if (PyObject_GetBuffer(h.ptr(), &v, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      return false;
    }
    bv.views.push_back(v);
    return true;
  }
  bool str(PyObject* o) {
    Py_ssize_t n = 0;
    const char* c = PyUnicode_AsUTF8AndSize(o, &n);
    if (!c) {
      PyErr_Clear();
      return fail(o, " that is not valid UTF-8");
    }
    pk.pack_str(uint32_t(n));
    pk.pack_str_body(c, uint32_t(n));
    return true;
  }

  bool numpy(nb::handle h) {
    auto* a = reinterpret_cast<PyArrayObject*>(h.ptr());
    const auto dt = dtype_of(PyArray_DESCR(a));
    if (!dt || !PyArray_ISNOTSWAPPED(a)) return fail(h, " of a dtype without a native frame");
    int64_t kind = kKindNumpy;
    if (!PyArray_ISWRITEABLE(a)) kind |= kFlagReadOnly;
    if (PyArray_NDIM(a) == 0) kind |= kFlagScalar;
    nb::handle src = h;
    if (!PyArray_IS_C_CONTIGUOUS(a)) {  // strided view: one contiguous copy
      bv.keep.push_back(nb::steal(PyArray_NewCopy(a, NPY_CORDER)));
      if (!bv.keep.back().is_valid()) throw nb::python_error();
      src = bv.keep.back();
      a = reinterpret_cast<PyArrayObject*>(src.ptr());
    }
    Py_buffer v;
    if (!pin(src, v)) return fail(h);
    Tensor t;
    t.dtype = *dt;
    t.shape.assign(PyArray_DIMS(a), PyArray_DIMS(a) + PyArray_NDIM(a));
    t.data = std::span<const std::byte>(static_cast<const std::byte*>(v.buf), size_t(v.len));
    add(std::move(t), kind);
    return true;
  }

  bool torch(nb::handle h, const TorchApi& T) {
    int64_t kind = kKindTorch;
    if (Py_TYPE(h.ptr()) == reinterpret_cast<PyTypeObject*>(T.param_type)) kind |= kFlagParameter;
    nb::object t = nb::borrow(h);
    auto attr = [&](PyObject* name) { return nb::steal(PyObject_GetAttr(t.ptr(), name)); };
    auto call = [&](PyObject* name) { return nb::steal(capi::call_method0(t.ptr(), name)); };
    auto ok = [](const nb::object& o) {
      if (!o.is_valid()) throw nb::python_error();
      return o;
    };
    if (truthy(ok(attr(T.s_requires_grad)))) kind |= kFlagRequiresGrad;
    if (T.xapi && g_torch_routes.exchange_api) {  // two calls into torch instead of seven, for a CPU tensor
      // DLPack describes memory, not torch's lazy bits: a negative (or, below, conjugated) view
      // is resolved first, or its raw memory would travel as if it were the values.
      if (truthy(ok(call(T.s_is_neg)))) t = ok(call(T.s_resolve_neg));
      nb::dlpack::dltensor dl;
      if (T.xapi->dltensor_from_py_object_no_sync(t.ptr(), &dl) != 0) {
        PyErr_Clear();  // the attribute route below says what is wrong, if anything
      } else if (auto dt = dtype_of_dl(dl.dtype); dt && dl.device.device_type == kDlCpu && dl.ndim >= 0) {
        bool compact = true;
        int64_t want = 1;
        size_t nbytes = dtype_size(*dt);
        for (int32_t i = dl.ndim - 1; i >= 0; --i) {
          const int64_t d = dl.shape[i];
          if (dl.strides && d > 1 && dl.strides[i] != want) compact = false;
          want *= d;
          nbytes *= size_t(d);
        }
        const bool conj = (*dt == DType::c64 || *dt == DType::c128) && truthy(ok(call(T.s_is_conj)));
        if (compact && !conj) {
          if (dl.ndim == 0) kind |= kFlagScalar;
          Tensor x;
          x.dtype = *dt;
          x.shape.assign(dl.shape, dl.shape + dl.ndim);
          x.data = std::span<const std::byte>(static_cast<const std::byte*>(dl.data) + dl.byte_offset, nbytes);
          bv.keep.push_back(std::move(t));  // the memory lives as long as the put
          add(std::move(x), kind);
          return true;
        }
      }
    }
    int cuda_ordinal = -1;  // >= 0: left on that GPU, in a device arena (below)
    if (!truthy(ok(attr(T.s_is_cpu)))) {  // a device tensor: a device arena, else staged through the host
      nb::object dev = ok(attr(T.s_device));
      if (staging && nb::cast<std::string>(ok(nb::steal(PyObject_GetAttrString(dev.ptr(), "type")))) == "cuda") {
        nb::object idx = ok(nb::steal(PyObject_GetAttrString(dev.ptr(), "index")));
        cuda_ordinal = idx.is_none() ? 0 : nb::cast<int>(idx);
      }
      if (cuda_ordinal < 0) {
        if (limit >= 0) {
          const nb::object nbo = ok(nb::steal(PyObject_GetAttrString(t.ptr(), "nbytes")));
          const Py_ssize_t n = PyLong_AsSsize_t(nbo.ptr());
          if (n < 0 && PyErr_Occurred()) throw nb::python_error();
          if (total + size_t(n) > uint64_t(limit)) return fail(h, " (a device tensor) over the inline limit");
        }
        devices.resize(kinds.size());
        devices.emplace_back(nb::cast<std::string>(nb::str(dev)));
        if (std::string u = gpu_uuid_of(devices.back()); !u.empty()) {
          gpus.resize(kinds.size());
          gpus.push_back(std::move(u));
        }
        t = staged_on_host(t);
      }
    }
    nb::object dto = ok(attr(T.s_dtype));
    std::optional<DType> dt;
    for (auto& [o, d] : T.dtypes)
      if (o == dto.ptr()) dt = d;
    if (!dt) return fail(h, " of a dtype without a native frame");
    // Lazy views are resolved, not refused: conjugation exists only for complex dtypes, a negative
    // bit for any (conj().imag is a real one).
    if ((*dt == DType::c64 || *dt == DType::c128) && truthy(ok(call(T.s_is_conj)))) t = ok(call(T.s_resolve_conj));
    if (truthy(ok(call(T.s_is_neg)))) t = ok(call(T.s_resolve_neg));
    if (!truthy(ok(call(T.s_is_contiguous)))) t = ok(call(T.s_contiguous));
    Tensor x;
    x.dtype = *dt;
    nb::object shape = ok(attr(T.s_shape));
    const Py_ssize_t nd = PyTuple_Size(shape.ptr());
    if (nd < 0) throw nb::python_error();
    if (nd == 0) kind |= kFlagScalar;
    x.shape.resize(size_t(nd));
    size_t nbytes = dtype_size(*dt);
    for (Py_ssize_t i = 0; i < nd; ++i) {
      x.shape[size_t(i)] = PyLong_AsLongLong(capi::tuple_item(shape.ptr(), i));
      nbytes *= size_t(x.shape[size_t(i)]);
    }
    void* ptr = PyLong_AsVoidPtr(ok(call(T.s_data_ptr)).ptr());
    if (PyErr_Occurred()) throw nb::python_error();
    if (cuda_ordinal >= 0) {  // into the producer's device arena; the frame holds its record
      stage_cuda_tensor(T, cuda_ordinal, ptr, nbytes, *dt, x.shape, *staging, x);
      bv.keep.push_back(std::move(t));  // the source lives until the put returns (the copy is queued before)
      add(std::move(x), kind | kFlagDeviceRef);
      return true;
    }
    x.data = std::span<const std::byte>(static_cast<const std::byte*>(ptr), nbytes);
    bv.keep.push_back(std::move(t));
    add(std::move(x), kind);
    return true;
  }

  static constexpr Py_ssize_t kPackedListMin = 16;  // the shortest list packed as ids or floats
  // msgpack's ext 32 header at h (6 bytes): the tag, the body's length (big-endian), the type.
  static void ext32_header(uint8_t* h, uint32_t body, int8_t type) {
    h[0] = 0xc9;
    h[1] = uint8_t(body >> 24), h[2] = uint8_t(body >> 16), h[3] = uint8_t(body >> 8), h[4] = uint8_t(body);
    h[5] = uint8_t(type);
  }
  // A list of small ints (|v| < 2^30: token ids, codes, -1 paddings) as an id list (ext type
  // 2, msgpack_io.hpp): one pass over the items writes each as 4 bytes (a small int always fits
  // 31 bits and its sign: no range check), a second over those bytes finds the width they need
  // (unsigned when none is negative), then they are narrowed in place to it. The first loop does
  // no more than load, check and store each item: it runs once per id and is what a list's put
  // costs. False, with nothing written, at the first item that is anything else: the caller
  // packs the list item by item.
  bool id_list(const capi::SeqItems& items, Py_ssize_t n) {
    // A list of anything else (strs, dicts) is turned away before room is reserved for it.
    if (!Py_IS_TYPE(items[0], &PyLong_Type) || size_t(n) > (UINT32_MAX - 1) / 4) return false;
    sink.reserve(7 + 4 * size_t(n));
    uint8_t* const h = sink.at();
    uint8_t* const d = h + 7;
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long v;
      if (!Py_IS_TYPE(items[i], &PyLong_Type) || !small_int(items[i], v)) [[unlikely]]
        return false;
      const uint32_t u = uint32_t(v);
      uint8_t* q = d + 4 * i;  // little-endian on any host; one 4-byte store on x86-64 and aarch64
      q[0] = uint8_t(u), q[1] = uint8_t(u >> 8), q[2] = uint8_t(u >> 16), q[3] = uint8_t(u >> 24);
    }
    const uint8_t wb = detail::id_list_width(d, size_t(n));
    const uint32_t w = wb & 0x0f;
    if (w < 4) detail::narrow_ids(d, size_t(n), w);  // the low bytes: a value's two's complement narrowed
    const uint32_t body = 1 + uint32_t(n) * w;
    ext32_header(h, body, detail::kExtIdList);
    h[6] = wb;
    sink.len += 6 + body;
    return true;
  }

  // A list of floats as a float list (ext type 3, msgpack_io.hpp): each value's 8 bytes,
  // little-endian, in one pass. False, with nothing written, at the first item that is not an
  // exact float (an int among them keeps its type: the caller packs the list item by item).
  bool float_list(const capi::SeqItems& items, Py_ssize_t n) {
    if (size_t(n) > (UINT32_MAX - 8) / 8) return false;
    sink.reserve(6 + 8 * size_t(n));
    uint8_t* const h = sink.at();
    uint8_t* const d = h + 6;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyFloat_CheckExact(items[i])) return false;
      detail::put_float(d, size_t(i), capi::float_value(items[i]));
    }
    const uint32_t body = 8 * uint32_t(n);
    ext32_header(h, body, detail::kExtFloatList);
    sink.len += 6 + body;
    return true;
  }

  bool encode(nb::handle h, int depth) {
    if (depth > 64) return fail(h, " nested deeper than 64");
    PyObject* o = h.ptr();
    if (o == Py_None) { pk.pack_nil(); return true; }
    if (PyBool_Check(o)) { o == Py_True ? pk.pack_true() : pk.pack_false(); return true; }
    if (PyLong_CheckExact(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (!overflow) { sink.write_int(v); return true; }
      if (overflow > 0) {
        const unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (!PyErr_Occurred()) { pk.pack_uint64(u); return true; }
        PyErr_Clear();
      }
      return fail(h, " beyond 64 bits");
    }
    if (PyFloat_CheckExact(o)) { pk.pack_double(capi::float_value(o)); return true; }
    if (PyUnicode_CheckExact(o)) return str(o);
    if (PyDict_CheckExact(o)) {
      const Py_ssize_t n = capi::dict_size(o);
      pk.pack_map(uint32_t(n));
      PyObject *k, *v;
      Py_ssize_t pos = 0, done = 0;
      while (PyDict_Next(o, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return fail(k, " as a dict key");
        if (!str(k) || !encode(v, depth + 1)) return false;
        ++done;
      }
      // A torch leaf runs Python code: a dict changed meanwhile would not match its packed count.
      if (done != n || capi::dict_size(o) != n) return fail(h, " that changed while it was being put");
      return true;
    }
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o)) {
      if (PyTuple_CheckExact(o)) tuples.push_back(lists);
      ++lists;
      const Py_ssize_t n = capi::seq_size(o);
      const capi::SeqItems items(o);
      if (n >= kPackedListMin && (PyFloat_CheckExact(items[0]) ? float_list(items, n) : id_list(items, n))) return true;
      pk.pack_array(uint32_t(n));
      // Runs of small ints are written through a cursor of our own, in room reserved 4096 ints
      // at a time (a huge list reserves no more): no bounds check nor call per int.
      for (Py_ssize_t i = 0; i < n;) {
        long long v;
        if (Py_IS_TYPE(items[i], &PyLong_Type) && small_int(items[i], v)) {
          // A run of them (kept in registers: no lambda, no member written per value).
          const Py_ssize_t room = std::min<Py_ssize_t>(4096, n - i);
          sink.reserve(9 * size_t(room));
          uint8_t* const d0 = sink.at();
          uint8_t* d = detail::ByteSink::put_int(d0, v);
          const Py_ssize_t end = i + room;
          for (++i; i < end && Py_IS_TYPE(items[i], &PyLong_Type) && small_int(items[i], v); ++i)
            d = detail::ByteSink::put_int(d, v);
          sink.len += size_t(d - d0);
          continue;
        }
        if (!encode(items[i], depth + 1)) return false;
        // A torch leaf runs Python code: a list it changed (resized: items moved) is not read on.
        if (items.changed(o, n))
          return fail(h, " that changed while it was being put");
        ++i;
      }
      return true;
    }
    if (PyArray_CheckExact(o)) return numpy(h);
    if (PyArray_IsScalar(o, Generic)) {  // np.float32(1.5) and kin: a 0-d array, back as a scalar
      nb::object arr = nb::steal(PyArray_FromScalar(o, nullptr));
      if (!arr.is_valid()) throw nb::python_error();
      bv.keep.push_back(arr);
      if (!numpy(arr)) return fail(h, " of a dtype without a native frame");
      kinds.back() |= kFlagNumpyScalar;
      any_kind = true;
      return true;
    }
    if (PyBytes_CheckExact(o)) {
      bv.keep.push_back(nb::borrow(h));  // immutable: no pin needed
      auto* b = reinterpret_cast<const std::byte*>(capi::bytes_data(o));
      add(Tensor::view_of(std::span<const std::byte>(b, size_t(capi::bytes_size(o)))), kKindBytes);
      return true;
    }
    if (PyByteArray_CheckExact(o) || PyMemoryView_Check(o)) {
      Py_buffer v;
      if (!pin(h, v)) return fail(h, " that is not contiguous");
      add(Tensor::view_of(std::span<const std::byte>(static_cast<const std::byte*>(v.buf), size_t(v.len))),
          PyByteArray_CheckExact(o) ? kKindByteArray : kKindMemoryView);
      return true;
    }
    if (const TorchApi* T = TorchApi::get(false)) {
      PyTypeObject* tp = Py_TYPE(o);
      if (tp == reinterpret_cast<PyTypeObject*>(T->tensor_type) || tp == reinterpret_cast<PyTypeObject*>(T->param_type))
        return torch(h, *T);
    }
    return fail(h);
  }

  // The whole object; false (nothing kept in p) when it needs pickle.
  bool run(nb::handle obj) {
    if (!encode(obj, 0)) {
      p.tensors.clear();
      return false;
    }
    if (p.tensors.size() == 1 && sink.len == 6)  // the object is one tensor: the plan of the last put may be kept
      p.tree = Value(TensorRef{0});
    else
      p.packed_tree = std::span<const std::byte>(buf.data(), sink.len);
    // ext packed straight into msgpack too (no Value tree), after the tree: its buffer is separate.
    const uint32_t entries =
        uint32_t(any_kind) + uint32_t(!tuples.empty()) + uint32_t(!devices.empty()) + uint32_t(!gpus.empty());
    if (entries) {
      std::vector<std::byte>& eb = bv.ext_buffer();
      detail::ByteSink es{&eb, 0};
      detail::Packer ep{es};
      ep.pack_map(entries);
      if (any_kind) {
        ep.pack_str(2);
        ep.pack_str_body("tk", 2);
        ep.pack_array(uint32_t(kinds.size()));
        for (int64_t k : kinds) es.write_int(k);
      }
      if (!tuples.empty()) {
        ep.pack_str(2);
        ep.pack_str_body("tu", 2);
        ep.pack_array(uint32_t(tuples.size()));
        for (uint64_t t : tuples) ep.pack_uint64(t);
      }
      // Per-tensor strings, one per tensor ("" for those without).
      auto strings = [&](const char* key, std::vector<std::string>& v) {
        if (v.empty()) return;
        v.resize(kinds.size());
        ep.pack_str(2);
        ep.pack_str_body(key, 2);
        ep.pack_array(uint32_t(v.size()));
        for (auto& x : v) {
          ep.pack_str(uint32_t(x.size()));
          ep.pack_str_body(x.data(), uint32_t(x.size()));
        }
      };
      strings("td", devices);
      strings("tg", gpus);
      p.packed_ext = std::span<const std::byte>(eb.data(), es.len);
    }
    return true;
  }
};

struct PyDecoder {
  const Payload& p;
  bool zero_copy;
  const ExtInfo& ext;  // kinds, tuples, and where torch tensors lived at put ("" or absent: the host)
  bool owned = false;  // the tensors' memory is this get's alone (GetResult::owned): views, writable, no copy
  bool host_local = false;  // came within this host: CUDA device records allowed (native_object)
  detail::MpReader* rd = nullptr;  // set while building from the packed tree
  size_t next_tuple = 0;
  uint32_t lists = 0;

  int64_t kind_of(size_t i) const { return i < ext.kinds.size() ? ext.kinds[i] : 0; }
  nb::object bytes_like(const Tensor& t, int64_t base) {
    if (zero_copy && t.keepalive) {  // read-only view of shared memory, whatever it was
      nb::object arr = array_over(t.data.data(), NPY_UINT8, Dims::flat(t.nbytes()), t.keepalive, false);
      return nb::steal(PyMemoryView_FromObject(arr.ptr()));
    }
    nb::object copy = region_copy_as(t, base == kKindByteArray ? 1 : 0);
    if (base == kKindMemoryView || zero_copy) return nb::steal(PyMemoryView_FromObject(copy.ptr()));
    return copy;
  }
  nb::object torch_tensor(const Tensor& t, int64_t k, size_t i) {
    if ((k & kFlagDeviceRef) && !host_local)  // before torch or any driver call: only this host's make valid ones
      raise(make_error(Errc::corrupt, "a CUDA device record arrived by a path that crosses hosts (or a control "
                                      "message): refused unread; it can only be valid on the host that made it"));
    const TorchApi* T = TorchApi::get(true);
    if (!T) raise(make_error(Errc::unsupported, "payload holds torch tensors but torch cannot be imported"));
    if (k & kFlagDeviceRef) return finish_torch(*T, tensor_from_ref(*T, t, zero_copy), k, t);
    Dims dims;
    dims.n = (k & kFlagScalar) ? 0 : int(t.shape.size());
    if (dims.n > NPY_MAXDIMS) raise(make_error(Errc::unsupported, "tensor of more than 32 dimensions"));
    for (int i = 0; i < dims.n; ++i) dims.v[i] = npy_intp(t.shape[size_t(i)]);
    if ((k & kFlagScalar) && t.nbytes() != dtype_size(t.dtype))
      raise(make_error(Errc::corrupt, "a 0-d tensor of " + std::to_string(t.nbytes()) + " bytes"));
    // Put from a device: back to that GPU where this process has it (found by UUID: ordinals
    // differ between processes), else to a device of that name, else on the host.
    std::string dev;
    if (i < ext.devices.size() && !ext.devices[i].empty()) {
      dev = ext.devices[i];
      if (i < ext.gpus.size() && !ext.gpus[i].empty())
        if (std::string here = gpu_by_uuid(ext.gpus[i]); !here.empty()) dev = std::move(here);
      if (!T->device_usable(dev)) dev.clear();
    }
    if (const std::string* wish = DeviceWish::wished())  // the caller's device= wins
      dev = *wish == "cpu" ? std::string() : *wish;
    // A zero-copy view is documented as not to be written (torch has no read-only tensors). A
    // tensor bound for a device is read from shared memory as a view too: the copy to the device
    // is then the only one (a pageable source: .to() returns once it is read).
    const bool view = (zero_copy || owned || !dev.empty()) && t.keepalive;
    nb::object out = torch_via_dlpack(*T, t, dims, view);
    if (!out.is_valid()) {  // the numpy route: an array, then torch.from_numpy
      // A dtype numpy lacks (bfloat16, float8, ...) goes as integers of its size, then torch
      // views them as that dtype.
      int type = npy_type(t.dtype);
      PyObject* view_as = nullptr;
      if (type < 0) {
        for (auto& [o, d] : T->dtypes)
          if (d == t.dtype) view_as = o;
        const size_t w = dtype_size(t.dtype);
        type = w == 1 ? NPY_UINT8 : w == 2 ? NPY_INT16 : w == 4 ? NPY_INT32 : -1;
        if (!view_as || type < 0)
          raise(make_error(Errc::unsupported, std::string("a torch tensor of ") + dtype_name(t.dtype) +
                                                  ", which this torch does not have"));
      }
      nb::object arr = view ? array_over(t.data.data(), type, dims, t.keepalive, false) : copied_array(t.data, type, dims);
      // torch warns for each read-only array.
      PyArray_ENABLEFLAGS(reinterpret_cast<PyArrayObject*>(arr.ptr()), NPY_ARRAY_WRITEABLE);
      out = nb::steal(capi::call1(T->from_numpy, arr.ptr()));
      if (!out.is_valid()) throw nb::python_error();
      if (view_as) out = out.attr(nb::handle(T->s_view))(nb::handle(view_as));
    }
    if (!dev.empty()) out = out.attr(nb::handle(T->s_to))(dev);
    return finish_torch(*T, std::move(out), k, t);
  }
  // A received torch tensor made a Parameter or set to require gradients as its frame says.
  nb::object finish_torch(const TorchApi& Tr, nb::object out, int64_t k, const Tensor& t) {
    const TorchApi* T = &Tr;
    const bool rg = k & kFlagRequiresGrad;
    try {
      if (k & kFlagParameter) return nb::handle(T->param_type)(out, nb::arg("requires_grad") = rg);
      if (rg) out.attr(nb::handle(T->s_requires_grad_))(true);
    } catch (nb::python_error& e) {  // damage: no put marks an integer tensor so (torch refuses it)
      if (!e.matches(PyExc_RuntimeError)) throw;  // Ctrl-C, out of memory: not the frame's doing
      raise(make_error(Errc::corrupt, std::string("the frame marks a tensor of ") + dtype_name(t.dtype) +
                                          " as requiring gradients, which torch refuses"));
    }
    return out;
  }
  nb::object tensor(size_t i) {
    if (i >= p.tensors.size())
      raise(make_error(Errc::corrupt, "tree references tensor " + std::to_string(i) + " of " +
                                          std::to_string(p.tensors.size())));
    const Tensor& t = p.tensors[i];
    const int64_t k = kind_of(i), base = k & kKindMask;
    if (base == kKindTorch) {
      nb::object out = torch_tensor(t, k, i);
      if (zero_copy && g_zero_copy_hook) out = nb::steal(PyObject_CallFunctionObjArgs(g_zero_copy_hook, out.ptr(), nullptr));
      if (!out.is_valid()) throw nb::python_error();
      return out;
    }
    if (base != kKindNumpy) return bytes_like(t, base);
    if (!(k & kFlagScalar)) {
      nb::object arr = tensor_array(t, zero_copy, owned);
      if (k & kFlagReadOnly) PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(arr.ptr()), NPY_ARRAY_WRITEABLE);
      return arr;
    }
    Dims d;  // 0-d: exactly one element (a frame saying otherwise would overrun the array)
    if (t.nbytes() != dtype_size(t.dtype) || npy_type(t.dtype) < 0)
      raise(make_error(Errc::corrupt, "a 0-d array of " + std::to_string(t.nbytes()) + " bytes of " + dtype_name(t.dtype)));
    nb::object arr = copied_array(t.data, npy_type(t.dtype), d);
    if (k & kFlagNumpyScalar) return nb::steal(PyArray_Return(reinterpret_cast<PyArrayObject*>(arr.release().ptr())));
    if (k & kFlagReadOnly) PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(arr.ptr()), NPY_ARRAY_WRITEABLE);
    return arr;
  }
  bool next_is_tuple() {
    const bool tup = next_tuple < ext.tuples.size() && ext.tuples[next_tuple] == lists;
    ++lists;
    if (tup) ++next_tuple;
    return tup;
  }

  // MpReader::read_any's builder: Python objects straight from the packed tree.
  using Out = nb::object;
  static bool set(Out& o, PyObject* x) {
    if (!x) throw nb::python_error();
    o = nb::steal(x);
    return true;
  }
  bool nil(Out& o) { o = nb::none(); return true; }
  bool boolean(Out& o, bool b) { o = nb::bool_(b); return true; }
  bool uint(Out& o, uint64_t v) { return set(o, PyLong_FromUnsignedLongLong(v)); }
  bool sint(Out& o, int64_t v) { return set(o, PyLong_FromLongLong(v)); }
  bool real(Out& o, double v) { return set(o, PyFloat_FromDouble(v)); }
  bool str(Out& o, std::string_view s) { o = py_str(s); return true; }
  bool bin(Out& o, std::span<const std::byte> b) {
    return set(o, PyBytes_FromStringAndSize(reinterpret_cast<const char*>(b.data()), Py_ssize_t(b.size())));
  }
  bool tensor(Out& o, uint32_t i) { o = tensor(size_t(i)); return true; }
  // A new list, or a tuple where the put had one (the tree's next sequence): its item slots,
  // every one empty until set.
  capi::NewItems new_sequence(Out& o, uint32_t n) {
    const bool tup = next_is_tuple();
    set(o, tup ? PyTuple_New(Py_ssize_t(n)) : PyList_New(Py_ssize_t(n)));
    return capi::NewItems(o.ptr(), tup);
  }
  // The int v: the shared one where `ids` has it (an incref), else id_int's.
  [[gnu::always_inline]] static PyObject* shared_int(PyObject** ids, uint64_t v) {
    PyObject* x;
    if (ids && v < kIdCache && (x = ids[v])) {
      Py_INCREF(x);
      return x;
    }
    if (!(x = id_int(v))) throw nb::python_error();
    return x;
  }
  bool id_list(Out& o, uint32_t w, bool sign, const uint8_t* d, uint32_t n) {
    const capi::NewItems items = new_sequence(o, n);
    PyObject** ids = id_table();
    auto fill = [&](auto width) {  // the width a constant: one loop per width, no branch per value
      if (!sign) {
        for (uint32_t i = 0; i < n; ++i) items.set(i, shared_int(ids, detail::id_at(d, width, i)));
        return;
      }
      for (uint32_t i = 0; i < n; ++i) {
        const int32_t v = detail::signed_id_at(d, width, i);
        if (v >= 0) {
          items.set(i, shared_int(ids, uint64_t(v)));
        } else {
          PyObject* x = PyLong_FromLong(v);  // -5..-1 are Python's own cached ints
          if (!x) throw nb::python_error();
          items.set(i, x);
        }
      }
    };
    if (w == 1) fill(std::integral_constant<uint32_t, 1>{});
    else if (w == 2) fill(std::integral_constant<uint32_t, 2>{});
    else fill(std::integral_constant<uint32_t, 4>{});
    return true;
  }
  bool float_list(Out& o, const uint8_t* d, uint32_t n) {
    const capi::NewItems items = new_sequence(o, n);
    for (uint32_t i = 0; i < n; ++i) {
      PyObject* x = PyFloat_FromDouble(detail::float_at(d, i));
      if (!x) throw nb::python_error();
      items.set(i, x);
    }
    return true;
  }
  template <class F>
  bool array(Out& o, uint32_t n, F elem) {
    const capi::NewItems items = new_sequence(o, n);
    PyObject** ids = id_table();
    for (uint32_t i = 0; i < n; ++i) {
      uint64_t v;
      if (rd->try_small_uint(v)) {  // ids: no call through the reader per item
        items.set(i, shared_int(ids, v));
      } else {
        Out e;
        if (!elem(e)) return false;
        items.set(i, e.release().ptr());
      }
    }
    return true;
  }
  template <class K, class F>
  bool map(Out& o, uint32_t n, K key, F elem) {
    set(o, PyDict_New());
    for (uint32_t i = 0; i < n; ++i) {
      std::string_view k;
      Out e;
      if (!key(k)) return false;
      nb::object ks = key_str(k);
      if (!elem(e)) return false;
      if (PyDict_SetItem(o.ptr(), ks.ptr(), e.ptr()) != 0) throw nb::python_error();
    }
    return true;
  }
};


}  // namespace

ExtInfo ExtInfo::of(const Payload& p) {
  ExtInfo e;
  std::vector<std::byte> packed;
  std::span<const std::byte> b = p.packed_ext;
  if (b.empty()) {
    if (p.ext.is_nil()) return e;
    packed = value_to_msgpack(p.ext);
    b = packed;
  }
  detail::MpReader rd(b.data(), b.size());
  auto bad = [&](const char* what) {
    raise(make_error(Errc::corrupt, std::string("frame ext: ") + what + (rd.error.empty() ? "" : ": " + rd.error)));
  };
  uint32_t n = 0;
  if (!rd.read_map(n)) bad("not a map");
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view k;
    if (!rd.read_str(k)) bad("a key that is not a string");
    uint32_t m = 0;
    if (k == "tk" || k == "tu" || k == "td" || k == "tg") {
      if (!rd.read_array(m) || m > rd.left()) bad("a list that is not one");
      if (k == "tk") {
        e.kinds.resize(m);
        for (auto& x : e.kinds)
          if (!rd.read_i64(x)) bad("tk");
      } else if (k == "tu") {
        e.tuples.resize(m);
        for (auto& x : e.tuples)
          if (!rd.read_u64(x)) bad("tu");
      } else {
        auto& v = k == "td" ? e.devices : e.gpus;
        v.resize(m);
        for (auto& x : v) {
          std::string_view d;
          if (!rd.read_str(d)) bad(k == "td" ? "td" : "tg");
          x.assign(d);
        }
      }
    } else if (k == "pickle") {
      int64_t v = 0;
      if (!rd.read_i64(v)) bad("pickle");
      e.pickle = v;
    } else if (!rd.skip()) {
      bad("an unreadable value");
    }
  }
  return e;
}

Encoding encode_py(nb::handle obj, Payload& p, BufferViews& bv, int64_t limit, DeviceStaging* ds) {
  PyEncoder enc{p, bv};
  enc.limit = limit;
  enc.staging = ds && ds->arena_bytes ? ds : nullptr;
  Encoding e;
  e.ok = enc.run(obj);
  e.total = enc.total;
  if (!e.ok) e.why = std::move(enc.why);
  return e;
}

// A frame without a pickle (anything put from Python without pickling, or by a C++ producer): the
// Python object it holds. The tree is built from Payload::packed_tree when the get left it packed.
nb::object native_object(const Payload& p, bool zero_copy, const ExtInfo& ext, bool owned, bool host_local) {
  const bool single = p.packed_tree.empty() ? p.tree.is<TensorRef>()
                                            : p.packed_tree.size() == 6 && uint8_t(p.packed_tree[0]) == 0xd6;
  if (single && p.tensors.size() == 1) {  // one tensor: no tree to walk
    if (ext.plain()) return tensor_array(p.tensors[0], zero_copy, owned);
    if (ext.tuples.empty()) return PyDecoder{p, zero_copy, ext, owned, host_local}.tensor(0);
  }
  PyDecoder d{p, zero_copy, ext, owned, host_local};
  // Gets and dequeues leave the tree packed; a tree decoded as a Value (a frame from elsewhere) is
  // packed once and read the same way.
  std::vector<std::byte> packed;
  std::span<const std::byte> tree = p.packed_tree;
  if (tree.empty()) {
    packed = value_to_msgpack(p.tree);
    tree = packed;
  }
  detail::MpReader rd(tree.data(), tree.size());
  d.rd = &rd;
  nb::object out;
  if (!rd.read_any(d, out) || !rd.at_end())
    raise(make_error(Errc::corrupt, "payload tree: " + (rd.error.empty() ? std::string("trailing bytes") : rd.error)));
  return out;
}


size_t payload_from_parts(int kind, nb::list regions, BufferViews& bv, Payload& p) {
  Value::List refs;
  size_t n = nb::len(regions);
  bv.views.reserve(n);
  p.tensors.reserve(n);
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    Py_buffer v;
    if (PyObject_GetBuffer(regions[i].ptr(), &v, PyBUF_SIMPLE) != 0) throw nb::python_error();
    bv.views.push_back(v);
    Tensor tn = Tensor::view_of(std::span<const std::byte>(static_cast<const std::byte*>(v.buf), size_t(v.len)));
    total += tn.nbytes();
    p.tensors.push_back(std::move(tn));
    refs.emplace_back(TensorRef{uint32_t(i)});
  }
  p.tree = Value(std::move(refs));
  Value::Map ext;
  ext.emplace_back("pickle", int64_t(kind));
  p.ext = Value(std::move(ext));
  return total;
}


namespace {
// A copying get of several arrays or tensors that together hold 1 MiB or more (a KV cache's 64
// layers of 256 KiB, a dict of hidden states): their bytes copied out of the slot in one copy into
// one pooled host buffer (two threads from 16 MiB, already mapped when one was dropped before),
// each result viewing its part, writable, the buffer back in the pool when the last is dropped.
// Each copied on its own instead, every array below 1 MiB came from malloc, whose large blocks are
// fresh pages the kernel zeroes on each get. True where it did so (those tensors then view the
// buffer; the caller keeps the slot's keepalive, which the packed tree and the other regions still
// view). Only numpy arrays and CPU torch tensors: bytes objects copy into objects of their own
// anyway (they stay as they are, and may ride in the one copy where they lie between arrays).
bool pool_together(Payload& p, const ExtInfo& ext) {
  auto& ts = p.tensors;
  if (ts.size() < 2 || ext.kinds.size() != ts.size() || !ext.devices.empty()) return false;
  // The result is then `owned` as a whole (the decoder views every array and tensor writable), so
  // anything else that would view the slot refuses it: 0-d ones (a torch scalar is a view) and
  // regions without a keepalive.
  auto pooled = [&](size_t i) {
    const int64_t base = ext.kinds[i] & kKindMask;
    return base == kKindNumpy || base == kKindTorch;
  };
  const std::byte* lo = nullptr;
  const std::byte* hi = nullptr;
  size_t total = 0, n = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].keepalive || (ext.kinds[i] & (kFlagScalar | kFlagDeviceRef))) return false;
    if (!pooled(i) || !ts[i].nbytes()) continue;
    const std::byte* a = ts[i].data.data();
    if (lo && a < hi) return false;  // the frame lays its regions out in order; anything else: each on its own
    if (!lo) lo = a;
    hi = a + ts[i].nbytes();
    total += ts[i].nbytes();
    ++n;
  }
  if (n < 2 || total < host_pool::kPooledMin || size_t(hi - lo) > total + total / 8) return false;
  std::shared_ptr<std::byte> buf;
  {
    nb::gil_scoped_release nogil;
    buf = host_pool::copy_of(std::span<const std::byte>(lo, size_t(hi - lo)));
  }
  if (!buf) return false;  // no memory for it here: each copied on its own, as before
  std::shared_ptr<const void> keep(buf, buf.get());
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!pooled(i)) continue;
    if (ts[i].nbytes()) ts[i].data = std::span<const std::byte>(buf.get() + (ts[i].data.data() - lo), ts[i].nbytes());
    ts[i].keepalive = keep;  // an empty one too: it must not hold the slot
  }
  return true;
}
}  // namespace

// The Python object of a received payload (KIND_OBJECT), or a pickle's kind and regions to unpickle.
Found found_of(GetResult& g, bool zero_copy, bool allow_pickle, const std::string& key, bool host_local) {
  const ExtInfo ext = ExtInfo::of(g.payload);
  if (!ext.pickle) {
    bool owned = g.owned && !zero_copy;
    std::shared_ptr<const void> slot;  // the packed tree views the slot: held until the objects are built
    if (!zero_copy && !owned && g.payload.tensors.size() >= 2) {  // (one array is pooled by copied_array)
      slot = g.payload.tensors[0].keepalive;
      owned = pool_together(g.payload, ext);
    }
    return Found{KIND_OBJECT, native_object(g.payload, zero_copy, ext, owned, host_local), g.size};
  }
  if (!allow_pickle) {
    counts::pickle_refused();
    raise(make_error(Errc::corrupt, "'" + key + "' holds a pickled object and allow_pickle is off: refused unread"));
  }
  const int64_t kind = *ext.pickle;
  nb::list l;
  for (size_t i = 0; i < g.payload.tensors.size(); ++i) {
    const Tensor& tn = g.payload.tensors[i];
    if (zero_copy && tn.keepalive) {  // read-only uint8 view; its base holds the slot
      l.append(array_over(tn.data.data(), NPY_UINT8, Dims::flat(tn.nbytes()), tn.keepalive, false));
    } else {  // a copy; asked for zero-copy (an inline payload), read-only bytes as the views would be
      l.append(region_copy(tn, i == 0 || zero_copy));
    }
  }
  return Found{kind, std::move(l), g.size};
}


// Returns (kind, [regions]) (or (KIND_OBJECT, object) for a numpy array or a C++ frame); each region copied once, straight from shared memory into a Python
// object, while the chunk is held.
// A frame as (KIND_OBJECT, object) or, for a pickle, (its kind, [regions copied out: the stream
// as bytes, the buffers]). Errors: corrupt.
nb::tuple frame_parts(std::span<const std::byte> frame, bool host_local) {
  Payload p;
  if (Status st = decode_frame_into(frame, nullptr, p, false); !st.ok()) raise(st.error());
  const ExtInfo ext = ExtInfo::of(p);
  if (!ext.pickle) return nb::make_tuple(KIND_OBJECT, native_object(p, false, ext, false, host_local));
  const int64_t kind = *ext.pickle;
  nb::list l;
  for (size_t i = 0; i < p.tensors.size(); ++i) l.append(region_copy(p.tensors[i], i == 0));
  return nb::make_tuple(kind, l);
}

// A payload as one frame in a bytes object.
nb::bytes frame_bytes(const Payload& p) {
  auto bytes = unwrap(encode_frame(p));
  return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}


}  // namespace stagelink::py
