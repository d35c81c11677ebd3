// stagelink._core: the thin binding. Argument conversion only; semantics live in C++.
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstring>
#include <optional>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "bench/mq_bench.hpp"
#include "core/host_pool.hpp"
#include "cuda/driver.hpp"
#include "core/msgpack_io.hpp"
#include "core/net.hpp"
#include "bench/shm_bench.hpp"
#include "bench/relay_bench.hpp"
#include "core/curve_config.hpp"
#include "stagelink/stagelink.hpp"

namespace nb = nanobind;
using namespace stagelink;

namespace {

std::array<PyObject*, 16> g_exc{};
PyObject* g_base_exc = nullptr;  // stagelink.StagelinkError

[[noreturn]] void raise(const Error& e) {
  PyObject* t = g_exc[static_cast<size_t>(e.code)];
  // Messages quote untrusted bytes (keys, names off the wire): invalid UTF-8 is replaced, so the
  // caller gets this error and not a UnicodeDecodeError in its place.
  PyObject* msg = PyUnicode_DecodeUTF8(e.message.data(), Py_ssize_t(e.message.size()), "replace");
  if (!msg) throw nb::python_error();
  PyErr_SetObject(t ? t : PyExc_RuntimeError, msg);
  Py_DECREF(msg);
  throw nb::python_error();
}
template <class T>
T unwrap(Result<T>&& r) {
  if (!r.ok()) raise(r.error());
  return std::move(r).value();
}

// A str's UTF-8 bytes (cached by CPython for ASCII strings: no encoding, no nanobind cast).
std::string utf8(PyObject* o) {
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(o, &n);
  if (!s) throw nb::python_error();
  return std::string(s, size_t(n));
}

// ---- timeouts and waits ----
// A timeout argument in seconds: None, infinity and 1e9 s or more wait for ever (-1); a negative one
// is one attempt (0); NaN is refused.
double timeout_secs(double v) {
  if (v != v) raise(make_error(Errc::invalid_argument, "timeout must be a number of seconds or None, not NaN"));
  return v >= 1e9 ? -1.0 : std::max(0.0, v);
}
double timeout_arg(nb::handle t) { return t.is_none() ? -1.0 : timeout_secs(nb::cast<double>(t)); }
// A timeout argument for a call whose negative timeout means its own default: None -> `none_is`,
// infinity (1e9 s or more) -> 1e9 (for ever), NaN refused. Called with the GIL held (it may raise).
double timeout_or(nb::handle t, double none_is) {
  if (t.is_none()) return none_is;
  const double v = timeout_secs(nb::cast<double>(t));
  return v < 0 ? 1e9 : v;
}

// Long waits run in slices of at most kSignalSliceS without the GIL; between slices the GIL is
// taken back and Python's signal handlers run (PyErr_CheckSignals), so Ctrl-C (or a SIGTERM
// handler that raises) ends a call waiting for a peer instead of waiting out its timeout, or for
// ever without one. `op(slice_s)` is one attempt of at most slice_s seconds (0: one try); it must
// take and leave nothing when it times out (waits, dequeues, gets, sends all do). The last
// attempt's result is returned: a timeout then names what was waited for.
// A timeout of up to kUnslicedS runs as one call (its error then says exactly what was asked).
constexpr double kSignalSliceS = 0.2, kUnslicedS = 1.0;
template <class Op>
auto sliced_nogil(double timeout_s, Op&& op) -> decltype(op(0.0)) {
  if (timeout_s >= 0 && timeout_s <= kUnslicedS) {
    nb::gil_scoped_release nogil;
    return op(timeout_s);
  }
  const Deadline start = Clock::now();
  const Deadline end = timeout_s < 0 ? Deadline::max() : deadline_after(timeout_s);
  for (;;) {
    double slice = kSignalSliceS;
    bool last = false;
    if (timeout_s >= 0) {
      const double left = std::chrono::duration<double>(end - Clock::now()).count();
      if (left <= kSignalSliceS) {
        slice = std::max(0.0, left);
        last = true;
      }
    }
    auto r = [&] {
      nb::gil_scoped_release nogil;
      return op(slice);
    }();
    if (last && !r.ok() && r.error().code == Errc::timeout) {  // its message names the last slice only
      char all[64];
      std::snprintf(all, sizeof all, " (%.1f s in all)", std::chrono::duration<double>(Clock::now() - start).count());
      return make_error(Errc::timeout, r.error().message + all);
    }
    if (last || r.ok() || r.error().code != Errc::timeout) return r;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  }
}
// GetOptions::keep_waiting for a get called from Python: at most every kSignalSliceS, takes the
// GIL and runs Python's signal handlers. A handler that raised (Ctrl-C) ends the get, and the
// caller raises its exception when the get returns. Only the wait for the key is cut so; a
// payload found is read whole (a network transfer is never left half-done).
struct SignalCheck {
  Deadline next{};  // the first ask checks at once (it comes after a stretch of waiting); no clock read per get
  bool raised = false;
  bool operator()() {
    if (Clock::now() < next) return true;
    nb::gil_scoped_acquire gil;
    next = deadline_after(kSignalSliceS);
    raised = PyErr_CheckSignals() != 0;
    return !raised;
  }
};

// sliced_nogil for a Status: raises its error.
template <class Op>
void check_sliced(double timeout_s, Op&& op) {
  Status st = sliced_nogil(timeout_s, std::forward<Op>(op));
  if (!st.ok()) raise(st.error());
}

// ---- Value <-> Python ----
// Metadata maps repeat a few keys on every put: hand out interned strings for those (their hash
// is cached, so building and reading the dict skips hashing and allocating them).

// A str from UTF-8 bytes. Strict: bytes that are not UTF-8 (a damaged or foreign frame, metadata
// or message) raise CorruptError, as every other damage a decoder finds does.
nb::object py_str(std::string_view s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), nullptr);
  if (!o) {
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) throw nb::python_error();
    PyErr_Clear();
    raise(make_error(Errc::corrupt, "a string of " + std::to_string(s.size()) + " bytes that is not valid UTF-8"));
  }
  return nb::steal(o);
}

// A dict key as a str. Keys repeat on every get of the same shape (the metadata's "entry", "gen",
// "inline"; a payload's "hidden", "ids"): the strs of short keys are kept in a direct-mapped cache
// of 256 slots, so a repeated key costs a hash and a compare instead of a new str, and its hash
// (cached in the str) is not computed again when the dict takes it. Called with the GIL held.
nb::object key_str(std::string_view k) {
  constexpr size_t kMaxCached = 32;
  if (k.empty() || k.size() > kMaxCached) return py_str(k);
  static PyObject* cache[256] = {};  // strong references, kept for the interpreter's life
  uint32_t h = 2166136261u;  // FNV-1a
  for (char c : k) h = (h ^ uint8_t(c)) * 16777619u;
  PyObject*& slot = cache[(h ^ (h >> 16)) & 255];
  if (slot) {
    Py_ssize_t n = 0;
    const char* u = PyUnicode_AsUTF8AndSize(slot, &n);  // kept in the str: no encoding after the first
    if (u && size_t(n) == k.size() && std::memcmp(u, k.data(), k.size()) == 0) return nb::borrow(slot);
    PyErr_Clear();
  }
  nb::object s = py_str(k);
  PyObject* fresh = s.inc_ref().ptr();
  PyUnicode_InternInPlace(&fresh);  // the same object as equal keys elsewhere: compared by identity
  Py_XDECREF(slot);
  slot = fresh;
  return nb::borrow(slot);
}

nb::object to_py(const Value& v, const std::vector<nb::object>* tensors = nullptr);

nb::object to_py(const Value& v, const std::vector<nb::object>* tensors) {
  return std::visit(
      [&](auto&& x) -> nb::object {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::monostate>) return nb::none();
        else if constexpr (std::is_same_v<T, bool>) return nb::bool_(x);
        else if constexpr (std::is_same_v<T, int64_t>) return nb::int_(x);
        else if constexpr (std::is_same_v<T, uint64_t>) return nb::steal(PyLong_FromUnsignedLongLong(x));
        else if constexpr (std::is_same_v<T, double>) return nb::float_(x);
        else if constexpr (std::is_same_v<T, std::string>) return py_str(x);
        else if constexpr (std::is_same_v<T, Value::Bytes>) return nb::bytes(reinterpret_cast<const char*>(x.data()), x.size());
        else if constexpr (std::is_same_v<T, Value::List>) {
          nb::list l;
          for (auto& e : x) l.append(to_py(e, tensors));
          return l;
        } else if constexpr (std::is_same_v<T, Value::Map>) {
          nb::dict d;
          for (auto& [k, e] : x) {
            nb::object v = to_py(e, tensors);
            if (PyDict_SetItem(d.ptr(), key_str(k).ptr(), v.ptr()) != 0) throw nb::python_error();
          }
          return d;
        } else {
          if (tensors && x.index < tensors->size()) return (*tensors)[x.index];
          return nb::none();
        }
      },
      v.storage());
}

// `skip`: a value left out of a top-level dict (the inline bytes a get reads in place).
Value from_py(nb::handle h, int depth = 0, PyObject* skip = nullptr) {
  if (depth > 64) throw nb::value_error("metadata nested deeper than 64");
  if (h.is_none()) return Value();
  if (PyBool_Check(h.ptr())) return Value(h.ptr() == Py_True);
  if (PyLong_Check(h.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow > 0) return Value(uint64_t(PyLong_AsUnsignedLongLong(h.ptr())));
    if (overflow < 0) throw nb::value_error("integer too small for metadata");
    return Value(int64_t(v));
  }
  if (PyFloat_Check(h.ptr())) return Value(PyFloat_AsDouble(h.ptr()));
  if (PyUnicode_Check(h.ptr())) return Value(utf8(h.ptr()));
  if (PyBytes_Check(h.ptr())) {
    auto* p = reinterpret_cast<const std::byte*>(PyBytes_AS_STRING(h.ptr()));
    return Value::copy_bytes(std::span<const std::byte>(p, size_t(PyBytes_GET_SIZE(h.ptr()))));
  }
  if (PyDict_Check(h.ptr())) {
    Value::Map m;
    m.reserve(size_t(PyDict_Size(h.ptr())));
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(h.ptr(), &pos, &k, &v)) {
      if (v == skip) continue;
      m.emplace_back(PyUnicode_Check(k) ? utf8(k) : nb::cast<std::string>(nb::str(k)), from_py(v, depth + 1));
    }
    return Value(std::move(m));
  }
  if (PyList_Check(h.ptr()) || PyTuple_Check(h.ptr())) {
    Value::List l;
    for (auto e : h) l.push_back(from_py(e, depth + 1));
    return Value(std::move(l));
  }
  throw nb::type_error("metadata and extra may hold only None, bool, int, float, str, bytes, dict and list");
}

// Holds Py_buffer views of the Python objects (and temporaries: contiguous copies, resolved
// torch tensors) for the duration of a put.
// Also owns where PyEncoder packs the tree and ext, which the put reads until it returns: buffers
// of the thread, reused across its puts, for the thread's outermost BufferViews; buffers of its
// own for one made while another is alive on the thread. Python code can run in the middle of a
// put (a torch attribute read or method call runs an active TorchFunctionMode's
// __torch_function__; an allocation may run a finalizer; a stage's __str__), and a put made from
// there once packed into the thread's buffers under the outer put, which then reached its reader
// corrupt (a regression test puts from inside a mode).
struct BufferViews {
  std::vector<Py_buffer> views;
  std::vector<nb::object> keep;

  BufferViews() = default;
  BufferViews(const BufferViews&) = delete;
  BufferViews& operator=(const BufferViews&) = delete;
  ~BufferViews() {
    for (auto& v : views) PyBuffer_Release(&v);
    --depth();
  }
  std::vector<std::byte>& tree_buffer() {
    thread_local std::vector<std::byte> b(1024);
    return outer_ ? b : own_tree_;
  }
  std::vector<std::byte>& ext_buffer() {
    thread_local std::vector<std::byte> b(64);
    return outer_ ? b : own_ext_;
  }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  const bool outer_ = depth()++ == 0;
  std::vector<std::byte> own_tree_, own_ext_;  // a nested put's
};

std::string stage_str(nb::handle h) {
  if (PyUnicode_Check(h.ptr())) return utf8(h.ptr());
  if (PyLong_Check(h.ptr())) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    static const auto small = [] {  // stage ids are small integers: format them once
      std::array<std::string, 64> a;
      for (size_t i = 0; i < a.size(); ++i) a[i] = std::to_string(i);
      return a;
    }();
    if (!overflow && v >= 0 && v < (long long)small.size()) return small[size_t(v)];
    if (!overflow) return std::to_string(v);
    return nb::cast<std::string>(nb::str(h));
  }
  throw nb::type_error("stage ids must be int or str");
}

// Connector.get and dequeue_parts hand back (KIND_OBJECT, object): a frame without a Python pickle (a numpy
// array put from Python, or anything a C++ producer put), already turned into Python objects.
constexpr int64_t KIND_OBJECT = -1;

// Copies of regions larger than this release the GIL around the memcpy.
constexpr size_t kGilReleaseBytes = 256u << 10;

// An array's shape on the stack (a std::vector here cost a heap allocation per get).
struct Dims {
  npy_intp v[NPY_MAXDIMS];
  int n = 0;
  static Dims flat(size_t len) {
    Dims d;
    d.v[0] = npy_intp(len);
    d.n = 1;
    return d;
  }
};

nb::object copied_array(std::span<const std::byte> src, int type, const Dims& dims);

// A region copied into a new bytes (0) or bytearray (1); large copies run without the GIL.
nb::object region_copy_as(const Tensor& t, int as) {
  const Py_ssize_t n = Py_ssize_t(t.nbytes());
  PyObject* o = as == 0 ? PyBytes_FromStringAndSize(nullptr, n) : PyByteArray_FromStringAndSize(nullptr, n);
  if (!o) throw nb::python_error();
  char* dst = as == 0 ? PyBytes_AS_STRING(o) : PyByteArray_AS_STRING(o);
  if (t.nbytes() > kGilReleaseBytes) {
    nb::gil_scoped_release nogil;
    host_pool::copy_into_fresh(reinterpret_cast<std::byte*>(dst), t.data.data(), t.nbytes());  // malloc's: fresh
  } else if (n) {
    std::memcpy(dst, t.data.data(), t.nbytes());
  }
  return nb::steal(o);
}

// A region copied out: bytes (the pickle stream), else a bytearray, or for 1 MiB and more a uint8
// array in a pooled host buffer (pickle.loads rebuilds arrays and tensors over either).
nb::object region_copy(const Tensor& t, bool as_bytes) {
  if (!as_bytes && t.nbytes() >= host_pool::kPooledMin) return copied_array(t.data, NPY_UINT8, Dims::flat(t.nbytes()));
  return region_copy_as(t, as_bytes ? 0 : 1);
}

// ---- numpy arrays as typed tensors (numpy's C API: building an array costs ~0.1 us, the
// buffer-protocol route through np.frombuffer ~1.5 us) ----
std::optional<DType> dtype_of(PyArray_Descr* d) {
  const int sz = int(PyDataType_ELSIZE(d));
  switch (d->kind) {
    case 'b': if (sz == 1) return DType::boolean; break;
    case 'u': if (sz == 1) return DType::u8; if (sz == 2) return DType::u16; if (sz == 4) return DType::u32; if (sz == 8) return DType::u64; break;
    case 'i': if (sz == 1) return DType::i8; if (sz == 2) return DType::i16; if (sz == 4) return DType::i32; if (sz == 8) return DType::i64; break;
    case 'f': if (sz == 2) return DType::f16; if (sz == 4) return DType::f32; if (sz == 8) return DType::f64; break;
    case 'c': if (sz == 8) return DType::c64; if (sz == 16) return DType::c128; break;
  }
  return std::nullopt;
}

int npy_type(DType d) {
  switch (d) {
    case DType::u8: return NPY_UINT8;
    case DType::i8: return NPY_INT8;
    case DType::u16: return NPY_UINT16;
    case DType::i16: return NPY_INT16;
    case DType::u32: return NPY_UINT32;
    case DType::i32: return NPY_INT32;
    case DType::u64: return NPY_UINT64;
    case DType::i64: return NPY_INT64;
    case DType::f16: return NPY_FLOAT16;
    case DType::f32: return NPY_FLOAT32;
    case DType::f64: return NPY_FLOAT64;
    case DType::boolean: return NPY_BOOL;
    case DType::c64: return NPY_COMPLEX64;
    case DType::c128: return NPY_COMPLEX128;
    case DType::bf16:  // numpy has none of these: raw bytes to numpy, a view's dtype to torch
    case DType::f8e4m3fn:
    case DType::f8e5m2:
    case DType::f8e4m3fnuz:
    case DType::f8e5m2fnuz:
    case DType::f8e8m0fnu:
    case DType::c32:
    case DType::f4e2m1fn_x2: return -1;
  }
  return -1;
}

// A plain, C-contiguous, native-endian numpy array of at least one dimension becomes one typed
// tensor viewing its memory (held by `bv` for the call); anything else returns false and takes
// the pickle path (0-d arrays, subclasses, object/structured dtypes, strided views).
// `gil_held_if_small`: the caller keeps the GIL for payloads up to kGilReleaseBytes (put does,
// a queue's enqueue, which may block, does not); only otherwise is the buffer pinned.
bool array_payload(nb::handle obj, BufferViews& bv, Payload& p, bool gil_held_if_small) {
  if (!PyArray_CheckExact(obj.ptr())) return false;
  auto* a = reinterpret_cast<PyArrayObject*>(obj.ptr());
  if (PyArray_NDIM(a) < 1 || !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISNOTSWAPPED(a) || !PyArray_ISWRITEABLE(a))
    return false;  // PyEncoder takes these (a read-only array comes back read-only)
  const auto dt = dtype_of(PyArray_DESCR(a));
  if (!dt) return false;
  const size_t nbytes = size_t(PyArray_NBYTES(a));
  if (!gil_held_if_small || nbytes > kGilReleaseBytes) {  // the GIL will be released: pin the memory
    Py_buffer v;
    if (PyObject_GetBuffer(obj.ptr(), &v, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      return false;
    }
    bv.views.push_back(v);
  }  // else the GIL is held for the whole call: no other thread can resize or free the array
  Tensor t;
  t.dtype = *dt;
  t.shape.assign(PyArray_DIMS(a), PyArray_DIMS(a) + PyArray_NDIM(a));
  t.data = std::span<const std::byte>(static_cast<const std::byte*>(PyArray_DATA(a)), nbytes);
  p.tree = Value(TensorRef{0});
  p.tensors.push_back(std::move(t));
  return true;
}

// A numpy array over `data`, its base a capsule holding `keep` (a slot lease or a pooled buffer).
nb::object array_over(const std::byte* data, int type, const Dims& dims, std::shared_ptr<const void> keep,
                      bool writable) {
  PyObject* arr = PyArray_New(&PyArray_Type, dims.n, const_cast<npy_intp*>(dims.v), type, nullptr, const_cast<std::byte*>(data), 0,
                              NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (writable ? NPY_ARRAY_WRITEABLE : 0), nullptr);
  if (!arr) throw nb::python_error();
  auto* holder = new std::shared_ptr<const void>(std::move(keep));
  PyObject* cap = PyCapsule_New(holder, nullptr, [](PyObject* c) {
    delete static_cast<std::shared_ptr<const void>*>(PyCapsule_GetPointer(c, nullptr));
  });
  if (!cap) {
    delete holder;
    Py_DECREF(arr);
    throw nb::python_error();
  }
  if (PyArray_SetBaseObject(reinterpret_cast<PyArrayObject*>(arr), cap) != 0) {  // steals cap
    Py_DECREF(arr);
    throw nb::python_error();
  }
  return nb::steal(arr);
}

// A writable copy of `src` as an array. 1 MiB and more: in a pooled host buffer (already faulted
// in when one of that size was dropped before), released back to the pool with the array.
nb::object copied_array(std::span<const std::byte> src, int type, const Dims& dims) {
  if (src.size() >= host_pool::kPooledMin) {
    std::shared_ptr<std::byte> buf;
    {
      nb::gil_scoped_release nogil;
      buf = host_pool::copy_of(src);
    }
    if (!buf) raise(make_error(Errc::exhausted, "no memory for a copy of " + std::to_string(src.size()) + " bytes"));
    const std::byte* data = buf.get();
    return array_over(data, type, dims, std::move(buf), true);
  }
  PyObject* arr = PyArray_SimpleNew(dims.n, const_cast<npy_intp*>(dims.v), type);
  if (!arr) throw nb::python_error();
  if (!src.empty()) std::memcpy(PyArray_DATA(reinterpret_cast<PyArrayObject*>(arr)), src.data(), src.size());
  return nb::steal(arr);
}

// A received tensor as a numpy array: a copy the array owns, or (zero_copy) a read-only view whose
// base holds the slot until the array is dropped. A dtype numpy lacks (bfloat16, float8, ...) comes
// back as its raw bytes (uint8).
nb::object tensor_array(const Tensor& t, bool zero_copy, bool owned = false) {
  int type = npy_type(t.dtype);
  Dims dims;
  if (type < 0) {
    type = NPY_UINT8;
    dims = Dims::flat(t.nbytes());
  } else {
    if (t.shape.size() > size_t(NPY_MAXDIMS))
      raise(make_error(Errc::unsupported, "a tensor of " + std::to_string(t.shape.size()) + " dimensions; numpy holds at most " +
                                              std::to_string(NPY_MAXDIMS)));
    dims.n = int(t.shape.size());
    for (int i = 0; i < dims.n; ++i) dims.v[i] = npy_intp(t.shape[size_t(i)]);
  }
  if (zero_copy && t.keepalive) return array_over(t.data.data(), type, dims, t.keepalive, false);
  if (owned && t.keepalive) return array_over(t.data.data(), type, dims, t.keepalive, true);  // ours alone: no copy
  nb::object arr = copied_array(t.data, type, dims);
  // An inline payload asked for zero-copy is a private copy: read-only all the same, so code
  // that works for small payloads works for large ones.
  if (zero_copy) PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(arr.ptr()), NPY_ARRAY_WRITEABLE);
  return arr;
}

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
};

// DLPack 1.x's C exchange API (dlpack.h, DLPackExchangeAPI), which array libraries publish as
// the capsule `type(tensor).__dlpack_c_exchange_api__`: C functions that read a tensor's DLTensor
// and wrap a DLManagedTensorVersioned as a tensor without going through Python calls (a torch
// method call costs ~0.2-0.4 us when its code is cold, as it is between two puts of a pipeline).
struct DlVersion {
  uint32_t major, minor;
};
struct DlManagedVersioned {
  DlVersion version;
  void* manager_ctx;
  void (*deleter)(DlManagedVersioned*);
  uint64_t flags;
  nb::dlpack::dltensor dl_tensor;
};
struct DlExchangeApi {
  struct Header {
    DlVersion version;
    Header* prev_api;
  } header;
  int (*managed_tensor_allocator)(nb::dlpack::dltensor*, DlManagedVersioned**, void*,
                                  void (*)(void*, const char*, const char*));
  int (*managed_tensor_from_py_object_no_sync)(void*, DlManagedVersioned**);
  int (*managed_tensor_to_py_object_no_sync)(DlManagedVersioned*, void**);
  int (*dltensor_from_py_object_no_sync)(void*, nb::dlpack::dltensor*);
  int (*current_work_stream)(int32_t, int32_t, void**);
};
constexpr int32_t kDlCpu = 1;
// A DLPack data type: code, bits, lanes.
struct DlType {
  uint8_t code, bits;
  uint16_t lanes = 1;
};

// ---- torch tensors over DLPack (the exchange ABI every array framework reads) ----
// A received tensor handed to torch: DLPack's managed-tensor struct, legacy (DLManagedTensor:
// the DLTensor, the manager context, the deleter; what a "dltensor" capsule holds) or versioned
// (what the exchange API takes), whichever is used; then what is ours: the memory's keeper (a
// slot lease, a pooled buffer; small copies live in the same allocation, after the struct) and
// the shape and strides the DLTensor points at. torch calls the deleter when the tensor dies,
// from any thread.
constexpr int kMaxDlDims = 32;
struct DlOut {
  struct Legacy {
    nb::dlpack::dltensor dl{};
    void* manager_ctx = nullptr;
    void (*deleter)(Legacy*) = nullptr;
  } legacy;
  DlManagedVersioned versioned{};
  std::shared_ptr<const void> keep;
  int64_t shape[kMaxDlDims], strides[kMaxDlDims];

  static void destroy(DlOut* self) {
    self->~DlOut();
    ::operator delete(static_cast<void*>(self));
  }
  // One allocation: the struct, then (when `inline_bytes`) 64-byte-aligned room for the data.
  static DlOut* make(size_t inline_bytes, std::byte** data) {
    void* raw = ::operator new(sizeof(DlOut) + (inline_bytes ? inline_bytes + 64 : 0));
    auto* m = new (raw) DlOut();
    m->legacy.manager_ctx = m;
    m->legacy.deleter = [](Legacy* l) { destroy(static_cast<DlOut*>(l->manager_ctx)); };
    m->versioned.version = {1, 0};
    m->versioned.manager_ctx = m;
    m->versioned.deleter = [](DlManagedVersioned* v) { destroy(static_cast<DlOut*>(v->manager_ctx)); };
    if (inline_bytes)
      *data = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(m + 1) + 63) & ~uintptr_t(63));
    return m;
  }
  // Describes `data` as a C-contiguous tensor of `dims` (of DLPack type `type`) in both structs.
  void describe(std::byte* data, int ndim, const npy_intp* dims, DlType type) {
    nb::dlpack::dltensor& dl = legacy.dl;
    dl.data = data ? static_cast<void*>(data) : static_cast<void*>(this);  // never null, even when empty
    dl.device = {kDlCpu, 0};
    dl.ndim = ndim;
    dl.dtype = {type.code, type.bits, type.lanes};
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      shape[i] = int64_t(dims[i]);
      strides[i] = stride;
      stride *= std::max<int64_t>(shape[i], 1);
    }
    dl.shape = shape;
    dl.strides = strides;
    versioned.dl_tensor = dl;
  }
};

// DLPack's type of `d`: code, bits, lanes (DLPack 1.1's codes for the float8 and float4 kinds).
DlType dl_type(DType d) {
  using C = nb::dlpack::dtype_code;
  switch (d) {
    case DType::u8: return {uint8_t(C::UInt), 8};
    case DType::i8: return {uint8_t(C::Int), 8};
    case DType::u16: return {uint8_t(C::UInt), 16};
    case DType::i16: return {uint8_t(C::Int), 16};
    case DType::u32: return {uint8_t(C::UInt), 32};
    case DType::i32: return {uint8_t(C::Int), 32};
    case DType::u64: return {uint8_t(C::UInt), 64};
    case DType::i64: return {uint8_t(C::Int), 64};
    case DType::f16: return {uint8_t(C::Float), 16};
    case DType::bf16: return {uint8_t(C::Bfloat), 16};
    case DType::f32: return {uint8_t(C::Float), 32};
    case DType::f64: return {uint8_t(C::Float), 64};
    case DType::c64: return {uint8_t(C::Complex), 64};
    case DType::c128: return {uint8_t(C::Complex), 128};
    case DType::boolean: return {uint8_t(C::Bool), 8};
    case DType::f8e4m3fn: return {10, 8};
    case DType::f8e4m3fnuz: return {11, 8};
    case DType::f8e5m2: return {12, 8};
    case DType::f8e5m2fnuz: return {13, 8};
    case DType::f8e8m0fnu: return {14, 8};
    case DType::c32: return {uint8_t(C::Complex), 32};
    case DType::f4e2m1fn_x2: return {17, 4, 2};  // two 4-bit lanes per byte, as torch exports it
  }
  return {0, 0, 0};
}

// The DType of a DLPack type; nullopt for the ones frames do not carry (bit types, vectors, ...).
std::optional<DType> dtype_of_dl(nb::dlpack::dtype t) {
  for (int i = 0; i < kDTypeCount; ++i) {
    const DlType d = dl_type(DType(i));
    if (d.code == t.code && d.bits == t.bits && d.lanes == t.lanes) return DType(i);
  }
  return std::nullopt;
}

// A capsule torch never consumed (it renames the ones it takes) frees its tensor here.
void dl_capsule_free(PyObject* cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    auto* m = static_cast<DlOut::Legacy*>(PyCapsule_GetPointer(cap, "dltensor"));
    m->deleter(m);
  }
}


// Which of torch's routes tensors may take (all of them, but in tests that check the routes an
// older torch leaves: no exchange API (before 2.10), no DLPack import of some dtypes).
struct TorchRoutes {
  bool exchange_api = true, dlpack = true;
};
TorchRoutes g_torch_routes;

// torch, bound once it has been imported by someone (stagelink never imports it to put).
struct TorchApi {
  PyObject* tensor_type = nullptr;
  PyObject* param_type = nullptr;
  PyObject* from_numpy = nullptr;
  std::vector<std::pair<PyObject*, DType>> dtypes;  // torch dtype objects (singletons)
  // Interned attribute names: attribute reads and method calls without building a str each time.
  PyObject *s_requires_grad, *s_is_cpu, *s_cpu, *s_is_conj, *s_resolve_conj, *s_is_neg, *s_resolve_neg,
      *s_is_contiguous, *s_contiguous, *s_dtype, *s_shape, *s_data_ptr, *s_device;
  PyObject* cuda_available = nullptr;  // torch.cuda.is_available
  // torch._C._from_dlpack (torch.utils.dlpack.from_dlpack where that is missing): a tensor over a
  // DLPack capsule, ~0.4 us cheaper than an array plus torch.from_numpy, bfloat16 included.
  PyObject* from_dlpack = nullptr;
  PyObject *s_view, *s_to, *s_requires_grad_;
  // The exchange API where this torch has one (2.10 and later); null otherwise.
  const DlExchangeApi* xapi = nullptr;
  uint32_t xapi_dtypes = 0;  // bit per DType: a tensor of it made through xapi here
  // Whether a tensor can be moved to `dev` here ("cuda:N" needs CUDA; other kinds are tried).
  bool device_usable(const std::string& dev) const {
    if (dev.rfind("cuda", 0) != 0) return true;
    nb::object r = nb::steal(PyObject_CallNoArgs(cuda_available));
    if (!r.is_valid()) {
      PyErr_Clear();
      return false;
    }
    return r.ptr() == Py_True;
  }
  // nullptr when torch is not loaded (import: load it, for a get that holds torch tensors).
  static TorchApi* get(bool import) {
    static TorchApi* api = nullptr;
    if (api) return api;
    PyObject* mod = PyImport_GetModule(nb::str("torch").ptr());  // new reference or NULL
    if (!mod) {
      PyErr_Clear();
      if (!import) return nullptr;
      mod = PyImport_ImportModule("torch");
      if (!mod) {  // not installed, or broken: the caller says the payload needs it (UnsupportedError)
        PyErr_Clear();
        return nullptr;
      }
    }
    nb::object torch = nb::steal(mod);
    if (!nb::hasattr(torch, "Tensor") || !nb::hasattr(torch, "from_numpy")) return nullptr;  // half-imported
    auto* a = new TorchApi();  // lives as long as the interpreter; torch is never unloaded
    a->tensor_type = nb::object(torch.attr("Tensor")).release().ptr();
    a->param_type = nb::object(torch.attr("nn").attr("Parameter")).release().ptr();
    a->from_numpy = nb::object(torch.attr("from_numpy")).release().ptr();
    a->cuda_available = nb::object(torch.attr("cuda").attr("is_available")).release().ptr();
    nb::object c = torch.attr("_C");
    if (nb::hasattr(c, "_from_dlpack")) {
      a->from_dlpack = nb::object(c.attr("_from_dlpack")).release().ptr();
    } else {
      PyObject* dl = PyImport_ImportModule("torch.utils.dlpack");
      if (dl && PyObject_HasAttrString(dl, "from_dlpack")) a->from_dlpack = PyObject_GetAttrString(dl, "from_dlpack");
      Py_XDECREF(dl);
      PyErr_Clear();
    }
    if (PyObject* cap = PyObject_GetAttrString(a->tensor_type, "__dlpack_c_exchange_api__")) {
      auto* x = static_cast<const DlExchangeApi*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
      if (x && x->header.version.major == 1 && x->dltensor_from_py_object_no_sync &&
          x->managed_tensor_to_py_object_no_sync)
        a->xapi = x;  // the capsule is kept (never released): torch's API struct is static
      else
        Py_DECREF(cap);
    }
    PyErr_Clear();
    a->s_view = PyUnicode_InternFromString("view");
    a->s_to = PyUnicode_InternFromString("to");
    a->s_requires_grad_ = PyUnicode_InternFromString("requires_grad_");
    for (auto [slot, name] : {std::pair{&a->s_requires_grad, "requires_grad"}, {&a->s_is_cpu, "is_cpu"}, {&a->s_cpu, "cpu"},
                              {&a->s_is_conj, "is_conj"}, {&a->s_resolve_conj, "resolve_conj"}, {&a->s_is_neg, "is_neg"},
                              {&a->s_resolve_neg, "resolve_neg"}, {&a->s_is_contiguous, "is_contiguous"},
                              {&a->s_contiguous, "contiguous"}, {&a->s_dtype, "dtype"}, {&a->s_shape, "shape"},
                              {&a->s_data_ptr, "data_ptr"}, {&a->s_device, "device"}})
      *slot = PyUnicode_InternFromString(name);
    const std::pair<const char*, DType> names[] = {
        {"uint8", DType::u8}, {"int8", DType::i8}, {"int16", DType::i16}, {"int32", DType::i32},
        {"int64", DType::i64}, {"float16", DType::f16}, {"bfloat16", DType::bf16}, {"float32", DType::f32},
        {"float64", DType::f64}, {"bool", DType::boolean}, {"complex64", DType::c64}, {"complex128", DType::c128},
        {"uint16", DType::u16}, {"uint32", DType::u32}, {"uint64", DType::u64},
        {"float8_e4m3fn", DType::f8e4m3fn}, {"float8_e5m2", DType::f8e5m2}, {"float8_e4m3fnuz", DType::f8e4m3fnuz},
        {"float8_e5m2fnuz", DType::f8e5m2fnuz}, {"float8_e8m0fnu", DType::f8e8m0fnu}, {"complex32", DType::c32},
        {"float4_e2m1fn_x2", DType::f4e2m1fn_x2}};
    for (auto& [n, d] : names)
      if (nb::hasattr(torch, n)) a->dtypes.emplace_back(nb::object(torch.attr(n)).release().ptr(), d);
    if (a->xapi) {  // which dtypes this torch takes through it: a one-element tensor of each
      for (int i = 0; i < kDTypeCount; ++i) {
        std::byte* data = nullptr;
        DlOut* m = DlOut::make(16, &data);
        const npy_intp one = 1;
        m->describe(data, 1, &one, dl_type(DType(i)));
        void* out = nullptr;
        if (a->xapi->managed_tensor_to_py_object_no_sync(&m->versioned, &out) == 0 && out) {
          a->xapi_dtypes |= 1u << i;
          Py_DECREF(static_cast<PyObject*>(out));  // torch calls the deleter
        } else {
          PyErr_Clear();  // refused before taking it (or after: never freed twice); once per process
        }
      }
    }
    api = a;
    return api;
  }
};

bool truthy(const nb::object& o) {
  const int r = PyObject_IsTrue(o.ptr());
  if (r < 0) throw nb::python_error();
  return r == 1;
}

// One digit holds at most 30 bits: such a value and its sign fit an int32 (id lists rely on it).
static_assert(PyLong_SHIFT <= 30, "a one-digit int must fit 31 bits and its sign");
// The value of an exact int that fits one digit (every token id and count), read from the object
// without a call; false for larger ones, which PyLong_AsLongLongAndOverflow takes.
inline bool compact_int(PyObject* o, long long& v) {
#if PY_VERSION_HEX >= 0x030C0000
  auto* l = reinterpret_cast<PyLongObject*>(o);
  if (!PyUnstable_Long_IsCompact(l)) return false;
  v = PyUnstable_Long_CompactValue(l);
  return true;
#else
  const Py_ssize_t sz = Py_SIZE(o);
  if (sz < -1 || sz > 1) return false;
  v = (long long)sz * (long long)reinterpret_cast<PyLongObject*>(o)->ob_digit[0];
  return true;
#endif
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

// This process's GPUs as the CUDA driver sees them (empty without one), read once: a frame names
// the GPU a tensor came from by UUID, which holds across processes whose CUDA_VISIBLE_DEVICES
// number the same GPU differently.
const std::vector<cuda::DeviceInfo>& local_gpus() {
  static const std::vector<cuda::DeviceInfo> g = cuda::devices();
  return g;
}
// "cuda:N" -> the UUID of that device here ("" when unknown).
std::string gpu_uuid_of(const std::string& dev) {
  if (dev.rfind("cuda:", 0) != 0) return {};
  const int n = std::atoi(dev.c_str() + 5);
  for (auto& g : local_gpus())
    if (g.ordinal == n) return g.uuid;
  return {};
}
// The device here holding `uuid` as "cuda:N" ("" when this process has no such GPU).
std::string gpu_by_uuid(const std::string& uuid) {
  for (auto& g : local_gpus())
    if (g.uuid == uuid) return "cuda:" + std::to_string(g.ordinal);
  return {};
}

// What a frame's ext says (the keys above), read once from Payload::ext or, as gets leave it, its
// msgpack bytes (no Value tree). Malformed: corrupt.
struct ExtInfo {
  std::vector<int64_t> kinds;        // "tk"
  std::vector<uint64_t> tuples;      // "tu"
  std::vector<std::string> devices;  // "td"
  std::vector<std::string> gpus;     // "tg": the UUID of the GPU of each device tensor ("" if unknown)
  std::optional<int64_t> pickle;     // "pickle"
  bool plain() const { return kinds.empty() && tuples.empty() && devices.empty() && gpus.empty() && !pickle; }

  static ExtInfo of(const Payload& p) {
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
};

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
  std::string why;
  std::vector<std::byte>& buf = bv.tree_buffer();  // the packed tree (BufferViews says whose)
  detail::ByteSink sink{&buf, 0};
  detail::Packer pk{sink};

  bool fail(nb::handle h, const char* what = "") {
    if (why.empty()) why = std::string(Py_TYPE(h.ptr())->tp_name) + what;
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
    auto call = [&](PyObject* name) { return nb::steal(PyObject_CallMethodNoArgs(t.ptr(), name)); };
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
    if (!truthy(ok(attr(T.s_is_cpu)))) {  // a device tensor: staged through the host (CUDA IPC: later)
      if (limit >= 0) {
        const nb::object nbo = ok(nb::steal(PyObject_GetAttrString(t.ptr(), "nbytes")));
        const Py_ssize_t n = PyLong_AsSsize_t(nbo.ptr());
        if (n < 0 && PyErr_Occurred()) throw nb::python_error();
        if (total + size_t(n) > uint64_t(limit)) return fail(h, " (a device tensor) over the inline limit");
      }
      devices.resize(kinds.size());
      devices.emplace_back(nb::cast<std::string>(nb::str(ok(attr(T.s_device)))));
      if (std::string u = gpu_uuid_of(devices.back()); !u.empty()) {
        gpus.resize(kinds.size());
        gpus.push_back(std::move(u));
      }
      t = ok(call(T.s_cpu));
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
      x.shape[size_t(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), i));
      nbytes *= size_t(x.shape[size_t(i)]);
    }
    void* ptr = PyLong_AsVoidPtr(ok(call(T.s_data_ptr)).ptr());
    if (PyErr_Occurred()) throw nb::python_error();
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
  // A list of compact ints (|v| < 2^30: token ids, codes, -1 paddings) as an id list (ext type
  // 2, msgpack_io.hpp): one pass over the items writes each as 4 bytes (a compact int always fits
  // 31 bits and its sign: no range check), a second over those bytes finds the width they need
  // (unsigned when none is negative), then they are narrowed in place to it. The first loop does
  // no more than load, check and store each item: it runs once per id and is what a list's put
  // costs. False, with nothing written, at the first item that is anything else: the caller
  // packs the list item by item.
  bool id_list(PyObject** items, Py_ssize_t n) {
    // A list of anything else (strs, dicts) is turned away before room is reserved for it.
    if (!Py_IS_TYPE(items[0], &PyLong_Type) || size_t(n) > (UINT32_MAX - 1) / 4) return false;
    sink.reserve(7 + 4 * size_t(n));
    uint8_t* const h = sink.at();
    uint8_t* const d = h + 7;
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long v;
      if (!Py_IS_TYPE(items[i], &PyLong_Type) || !compact_int(items[i], v)) [[unlikely]]
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
  bool float_list(PyObject** items, Py_ssize_t n) {
    if (size_t(n) > (UINT32_MAX - 8) / 8) return false;
    sink.reserve(6 + 8 * size_t(n));
    uint8_t* const h = sink.at();
    uint8_t* const d = h + 6;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyFloat_CheckExact(items[i])) return false;
      detail::put_float(d, size_t(i), PyFloat_AS_DOUBLE(items[i]));
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
    if (PyFloat_CheckExact(o)) { pk.pack_double(PyFloat_AS_DOUBLE(o)); return true; }
    if (PyUnicode_CheckExact(o)) return str(o);
    if (PyDict_CheckExact(o)) {
      const Py_ssize_t n = PyDict_GET_SIZE(o);
      pk.pack_map(uint32_t(n));
      PyObject *k, *v;
      Py_ssize_t pos = 0, done = 0;
      while (PyDict_Next(o, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return fail(k, " as a dict key");
        if (!str(k) || !encode(v, depth + 1)) return false;
        ++done;
      }
      // A torch leaf runs Python code: a dict changed meanwhile would not match its packed count.
      if (done != n || PyDict_GET_SIZE(o) != n) return fail(h, " that changed while it was being put");
      return true;
    }
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o)) {
      if (PyTuple_CheckExact(o)) tuples.push_back(lists);
      ++lists;
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
      PyObject** items = PySequence_Fast_ITEMS(o);
      if (n >= kPackedListMin && (PyFloat_CheckExact(items[0]) ? float_list(items, n) : id_list(items, n))) return true;
      pk.pack_array(uint32_t(n));
      // Runs of compact ints are written through a cursor of our own, in room reserved 4096 ints
      // at a time (a huge list reserves no more): no bounds check nor call per int.
      for (Py_ssize_t i = 0; i < n;) {
        long long v;
        if (Py_IS_TYPE(items[i], &PyLong_Type) && compact_int(items[i], v)) {
          // A run of them (kept in registers: no lambda, no member written per value).
          const Py_ssize_t room = std::min<Py_ssize_t>(4096, n - i);
          sink.reserve(9 * size_t(room));
          uint8_t* const d0 = sink.at();
          uint8_t* d = detail::ByteSink::put_int(d0, v);
          const Py_ssize_t end = i + room;
          for (++i; i < end && Py_IS_TYPE(items[i], &PyLong_Type) && compact_int(items[i], v); ++i)
            d = detail::ByteSink::put_int(d, v);
          sink.len += size_t(d - d0);
          continue;
        }
        if (!encode(items[i], depth + 1)) return false;
        // A torch leaf runs Python code: a list it changed (resized: items moved) is not read on.
        if (PyList_CheckExact(o) && (PyList_GET_SIZE(o) != n || PySequence_Fast_ITEMS(o) != items))
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
      auto* b = reinterpret_cast<const std::byte*>(PyBytes_AS_STRING(o));
      add(Tensor::view_of(std::span<const std::byte>(b, size_t(PyBytes_GET_SIZE(o)))), kKindBytes);
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

// A received tensor as a torch tensor through DLPack: a view of `t`'s memory held by its keepalive
// (`view`), else a copy (small ones inside the DLPack allocation, 1 MiB and more in a pooled host
// buffer). An invalid object (no error set) when this torch cannot import it so: the caller takes
// the numpy route.
nb::object torch_via_dlpack(const TorchApi& T, const Tensor& t, const Dims& dims, bool view) {
  const bool x = g_torch_routes.exchange_api && T.xapi && (T.xapi_dtypes >> int(t.dtype) & 1u);
  if ((!x && !(g_torch_routes.dlpack && T.from_dlpack)) || dims.n > kMaxDlDims) return {};
  const size_t n = t.nbytes();
  std::byte* data = nullptr;
  DlOut* m;
  if (view) {
    m = DlOut::make(0, nullptr);
    m->keep = t.keepalive;
    data = const_cast<std::byte*>(t.data.data());
  } else if (n >= host_pool::kPooledMin) {
    std::shared_ptr<std::byte> buf;
    {
      nb::gil_scoped_release nogil;
      buf = host_pool::copy_of(t.data.subspan(0, n));
    }
    if (!buf) raise(make_error(Errc::exhausted, "no memory for a copy of " + std::to_string(n) + " bytes"));
    m = DlOut::make(0, nullptr);
    data = buf.get();
    m->keep = std::move(buf);
  } else {
    m = DlOut::make(n, &data);
    if (n) std::memcpy(data, t.data.data(), n);
  }
  m->describe(data, dims.n, dims.v, dl_type(t.dtype));
  if (x) {  // straight in C: no capsule, no argument parsing
    void* out = nullptr;
    if (T.xapi->managed_tensor_to_py_object_no_sync(&m->versioned, &out) != 0 || !out)
      throw nb::python_error();  // a dtype it took at start-up: only out of memory gets here
    return nb::steal(static_cast<PyObject*>(out));
  }
  PyObject* cap = PyCapsule_New(&m->legacy, "dltensor", dl_capsule_free);
  if (!cap) {
    DlOut::destroy(m);
    throw nb::python_error();
  }
  PyObject* out = PyObject_CallOneArg(T.from_dlpack, cap);
  Py_DECREF(cap);  // consumed: torch owns `m` now; else the capsule frees it
  if (!out) {  // e.g. a dtype this torch's DLPack import lacks
    PyErr_Clear();
    return {};
  }
  return nb::steal(out);
}

// Frame -> Python object: the tree with its tensors as numpy arrays, torch tensors or bytes-likes.
struct PyDecoder {
  const Payload& p;
  bool zero_copy;
  const ExtInfo& ext;  // kinds, tuples, and where torch tensors lived at put ("" or absent: the host)
  bool owned = false;  // the tensors' memory is this get's alone (GetResult::owned): views, writable, no copy
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
    const TorchApi* T = TorchApi::get(true);
    if (!T) raise(make_error(Errc::unsupported, "payload holds torch tensors but torch cannot be imported"));
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
      out = nb::steal(PyObject_CallOneArg(T->from_numpy, arr.ptr()));
      if (!out.is_valid()) throw nb::python_error();
      if (view_as) out = out.attr(nb::handle(T->s_view))(nb::handle(view_as));
    }
    if (!dev.empty()) out = out.attr(nb::handle(T->s_to))(dev);
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
    if (base == kKindTorch) return torch_tensor(t, k, i);
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
  PyObject** new_sequence(Out& o, uint32_t n) {
    const bool tup = next_is_tuple();
    set(o, tup ? PyTuple_New(Py_ssize_t(n)) : PyList_New(Py_ssize_t(n)));
    return tup ? reinterpret_cast<PyTupleObject*>(o.ptr())->ob_item : reinterpret_cast<PyListObject*>(o.ptr())->ob_item;
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
    PyObject** items = new_sequence(o, n);
    PyObject** ids = id_table();
    auto fill = [&](auto width) {  // the width a constant: one loop per width, no branch per value
      if (!sign) {
        for (uint32_t i = 0; i < n; ++i) items[i] = shared_int(ids, detail::id_at(d, width, i));
        return;
      }
      for (uint32_t i = 0; i < n; ++i) {
        const int32_t v = detail::signed_id_at(d, width, i);
        if (v >= 0) {
          items[i] = shared_int(ids, uint64_t(v));
        } else if (!(items[i] = PyLong_FromLong(v))) {  // -5..-1 are Python's own cached ints
          throw nb::python_error();
        }
      }
    };
    if (w == 1) fill(std::integral_constant<uint32_t, 1>{});
    else if (w == 2) fill(std::integral_constant<uint32_t, 2>{});
    else fill(std::integral_constant<uint32_t, 4>{});
    return true;
  }
  bool float_list(Out& o, const uint8_t* d, uint32_t n) {
    PyObject** items = new_sequence(o, n);
    for (uint32_t i = 0; i < n; ++i)
      if (!(items[i] = PyFloat_FromDouble(detail::float_at(d, i)))) throw nb::python_error();
    return true;
  }
  template <class F>
  bool array(Out& o, uint32_t n, F elem) {
    PyObject** items = new_sequence(o, n);
    PyObject** ids = id_table();
    for (uint32_t i = 0; i < n; ++i) {
      uint64_t v;
      if (rd->try_small_uint(v)) {  // ids: no call through the reader per item
        items[i] = shared_int(ids, v);
      } else {
        Out e;
        if (!elem(e)) return false;
        items[i] = e.release().ptr();
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

// A frame without a pickle (anything put from Python without pickling, or by a C++ producer): the
// Python object it holds. The tree is built from Payload::packed_tree when the get left it packed.
nb::object native_object(const Payload& p, bool zero_copy, const ExtInfo& ext, bool owned = false) {
  const bool single = p.packed_tree.empty() ? p.tree.is<TensorRef>()
                                            : p.packed_tree.size() == 6 && uint8_t(p.packed_tree[0]) == 0xd6;
  if (single && p.tensors.size() == 1) {  // one tensor: no tree to walk
    if (ext.plain()) return tensor_array(p.tensors[0], zero_copy, owned);
    if (ext.tuples.empty()) return PyDecoder{p, zero_copy, ext, owned}.tensor(0);
  }
  PyDecoder d{p, zero_copy, ext, owned};
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


struct PyLoan {
  Loan loan;
  nb::object region(size_t i) {
    auto s = loan.region(i);
    if (!loan.valid() || i >= loan.tensor_count()) throw nb::index_error("loan region out of range or loan already published");
    size_t shape[1] = {s.size()};
    return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(reinterpret_cast<uint8_t*>(s.data()), 1, shape, nb::handle()),
                    nb::rv_policy::reference);
  }
};

struct PyConnector {
  // shared: a call running without the GIL holds its own reference, so a close() from another
  // thread never destroys the connector under it (the call then ends with closed/cancelled).
  std::shared_ptr<Connector> c;
  bool allow_pickle = true;  // extra.allow_pickle: refuse frames holding a pickle when false
  // A connector whose calls wait on a network (store, transfer engine): every call runs without
  // the GIL, however small, so the process's other Python threads run during its round trips.
  // Shared memory's calls take microseconds and keep it below kGilReleaseBytes.
  bool networked = false;
  // `last_error`: why the last put or get failed or found nothing (None after one that worked).
  // Held here, not in the instance dict, so a successful call clears it with a pointer test.
  nb::object last_error = nb::none();
  void succeeded() {
    if (!last_error.is_none()) [[unlikely]] last_error = nb::none();
  }
  std::shared_ptr<Connector> get() {
    if (!c) raise(make_error(Errc::closed, "connector is closed"));
    return c;
  }
};

// `last_error` may hold an exception whose traceback reaches the connector (strict mode raises
// it): the cycle goes through this native field, so the collector must see it.
int connector_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT(nb::inst_ptr<PyConnector>(self)->last_error.ptr());
  return 0;
}
int connector_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<PyConnector>(self)->last_error = nb::none();
  return 0;
}
PyType_Slot g_connector_slots[] = {{Py_tp_traverse, (void*)connector_traverse},
                                   {Py_tp_clear, (void*)connector_clear},
                                   {0, nullptr}};

// Why the last get on this thread returned nothing (not put yet, timed out, consumed, cancelled):
// set by borrow() where it returns nullopt, read by the caller to fill `last_error`.
thread_local Error t_miss;

// The exception object of `e` (the class raise() would raise), not raised.
nb::object exception_of(const Error& e) {
  PyObject* t = g_exc[static_cast<size_t>(e.code)];
  nb::object msg = nb::steal(PyUnicode_DecodeUTF8(e.message.data(), Py_ssize_t(e.message.size()), "replace"));
  if (!msg.is_valid()) throw nb::python_error();
  nb::object exc = nb::steal(PyObject_CallOneArg(t ? t : PyExc_RuntimeError, msg.ptr()));
  if (!exc.is_valid()) throw nb::python_error();
  return exc;
}

// A pickled Python object as a payload: tree [refs], ext {"pickle": kind}, one tensor per region
// (the pickle-5 stream, then its out-of-band buffers; views of the Python buffers, held by `bv`).
// Returns the regions' total bytes.
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

// "inline", the shared-memory connector's metadata key for a small payload's frame: interned once
// (immortal: kept), for the put that adds it and the get that reads it in place.
PyObject* inline_key() {
  static PyObject* const k = PyUnicode_InternFromString("inline");
  return k;
}

// `request_id`: None, or the request the put is tied to (cleanup(request_id) frees it).
std::string rid_str(nb::handle rid) {
  if (rid.is_none()) return {};
  if (PyUnicode_Check(rid.ptr())) return utf8(rid.ptr());
  return nb::cast<std::string>(nb::str(rid));
}

// A put from Python: its size and its metadata as a dict.
struct PyPut {
  size_t size = 0;
  nb::object metadata;
};

PyPut put_payload(PyConnector& self, nb::handle from, nb::handle to, const std::string& key, const Payload& p,
                  size_t total, uint32_t readers, nb::handle request_id) {
  std::string f = stage_str(from), t = stage_str(to);
  const std::string rid = rid_str(request_id);
  const std::shared_ptr<Connector> keep = self.get();  // raises ClosedError: must run while holding the GIL
  Connector& conn = *keep;
  Result<PutResult> r = make_error(Errc::io, "");
  // An inline frame becomes the metadata's bytes straight from the arena (PutOptions::inline_sink),
  // where this thread keeps the GIL through the put; else the connector copies it into the Value.
  // The sink captures one pointer: it fits std::function's own storage (no allocation per put).
  struct {
    nb::object bytes;
    bool failed = false;  // out of memory: raised below (the put is published)
  } inline_out;
  nb::object& inl = inline_out.bytes;
  if (total > kGilReleaseBytes || self.networked) {  // the caller pinned the memory for this
    nb::gil_scoped_release nogil;
    r = conn.put(f, t, key, p, PutOptions{readers, rid, {}});
  } else {
    PutOptions po{readers, rid, {}};
    po.inline_sink = [out = &inline_out](std::span<const std::byte> frame) {
      out->bytes = nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(frame.data()), Py_ssize_t(frame.size())));
      out->failed = !out->bytes.is_valid();
    };
    r = conn.put(f, t, key, p, po);
  }
  if (inline_out.failed) throw nb::python_error();
  PutResult pr = unwrap(std::move(r));
  PyPut out{pr.size, to_py(pr.metadata)};
  if (inl.is_valid() && PyDict_SetItem(out.metadata.ptr(), inline_key(), inl.ptr()) != 0) throw nb::python_error();
  return out;
}

// Failures the vLLM-Omni contract reports (through the subclass's `_fail`: logged and kept in
// `last_error`, raised in strict mode) instead of raising: stagelink's errors and bad arguments.
// Anything else propagates.
void report_or_rethrow(nb::handle self, const char* op, nb::python_error& e) {
  if (!e.matches(g_base_exc) && !e.matches(PyExc_TypeError) && !e.matches(PyExc_ValueError) &&
      !e.matches(PyExc_BufferError))
    throw;
  self.attr("_fail")(op, e.value());
}

// Python's `Connector.put`: numpy arrays, torch tensors, bytes-likes and trees of them go straight
// through C++ as native frames (no Python frame, no pickle); anything else (a Loan, an object to
// pickle) through the subclass's `_put_slow`. Failures follow the contract: logged by `_fail` and
// returned as (False, 0, None), or raised in strict mode.
nb::object connector_put(nb::handle self_h, nb::handle from, nb::handle to, nb::handle key, nb::handle data,
                         nb::handle readers, nb::handle request_id) {
  try {
    uint32_t rd = 0;
    if (!readers.is_none()) {
      const long v = PyLong_AsLong(readers.ptr());
      if (v == -1 && PyErr_Occurred()) throw nb::python_error();
      if (v < 0 || v > long(UINT32_MAX)) raise(make_error(Errc::invalid_argument, "readers must be in [1, 8]"));
      rd = uint32_t(v);
    }
    if (!PyUnicode_Check(key.ptr())) {
      PyErr_SetString(PyExc_TypeError, "put_key must be a str");
      throw nb::python_error();
    }
    Payload p;
    BufferViews bv;
    size_t total = 0;
    PyConnector& self = *nb::inst_ptr<PyConnector>(self_h);
    if (array_payload(data, bv, p, !self.networked)) {  // pinned when the GIL will be let go
      total = p.tensors[0].nbytes();
    } else {
      PyEncoder enc{p, bv};
      if (!enc.run(data)) return self_h.attr("_put_slow")(from, to, key, data, readers, request_id, enc.why);
      total = enc.total;
    }
    PyPut pr = put_payload(self, from, to, utf8(key.ptr()), p, total, rd, request_id);
    self.succeeded();
    return nb::make_tuple(true, pr.size, std::move(pr.metadata));
  } catch (nb::python_error& e) {
    report_or_rethrow(self_h, "put", e);
    return nb::make_tuple(false, 0, nb::none());
  }
}

nb::tuple put_parts(PyConnector& self, nb::handle from, nb::handle to, const std::string& key, int kind,
                    nb::list regions, uint32_t readers, nb::handle request_id) {
  Payload p;
  BufferViews bv;
  const size_t total = payload_from_parts(kind, regions, bv, p);
  PyPut pr = put_payload(self, from, to, key, p, total, readers, request_id);
  return nb::make_tuple(pr.size, std::move(pr.metadata));
}

// A get's metadata as the connector reads it: the converted Value, and the bytes object of an
// inline payload (the shared-memory connector's "inline"), read in place rather than copied into
// the Value (GetOptions::metadata_inline). An inline payload's tensors view one or the other.
struct MetadataHold {
  Value value;
  nb::object inline_bytes;
};

// Borrow key's slot zero-copy (the slot is released when the result is dropped). nullopt when absent
// or timed out. A get that may block (keyless, with a timeout) releases the GIL; a lookup by
// metadata takes microseconds and keeps it. Must be entered holding the GIL. `md` receives the
// converted metadata and the bytes of an inline payload: its tensors view them, so the caller
// keeps `md` alive until it has copied them out.
std::optional<GetResult> borrow(PyConnector& self, nb::handle from, nb::handle to, const std::string& key,
                                nb::handle metadata, nb::handle timeout, MetadataHold& md, bool private_ok = false) {
  std::string f = stage_str(from), t = stage_str(to);
  const bool has_md = !metadata.is_none();
  // Our own metadata of an inline payload ({"size", "entry", "gen", "inline": bytes}): the frame is
  // read from the bytes object in place (held in `md` for the caller) instead of copied into the
  // Value. Any other shape goes through from_py whole.
  nb::object& inline_ref = md.inline_bytes;
  if (has_md && !self.networked && PyDict_CheckExact(metadata.ptr())) {  // the shared-memory connector's
    PyObject* b = PyDict_GetItemWithError(metadata.ptr(), inline_key());
    if (!b && PyErr_Occurred()) throw nb::python_error();
    if (b && PyBytes_CheckExact(b) && PyBytes_GET_SIZE(b) > 0) inline_ref = nb::borrow(b);
  }
  if (has_md) md.value = from_py(metadata, 0, inline_ref.ptr());
  // Our metadata is a direct lookup (microseconds: the GIL is kept); anything else (none, another
  // connector's) may wait for the key.
  static PyObject* const kEntry = PyUnicode_InternFromString("entry");  // immortal: kept
  const bool lookup = has_md && PyDict_Check(metadata.ptr()) && PyDict_GetItem(metadata.ptr(), kEntry);
  double secs = -1;  // no timeout: no wait
  if (!timeout.is_none()) {
    secs = PyFloat_AsDouble(timeout.ptr());  // TypeError for a non-number
    if (secs == -1.0 && PyErr_Occurred()) throw nb::python_error();
    secs = timeout_secs(secs);
    if (secs < 0) secs = 1e9;  // infinite: as long as a deadline can say
  }
  const std::shared_ptr<Connector> keep = self.get();  // raises ClosedError: must run while holding the GIL
  Connector& conn = *keep;
  Result<GetResult> r = make_error(Errc::io, "");
  // Zero-copy, inline payloads viewing `md`, the tree left packed: the caller builds its objects.
  GetOptions go{true, true, true};
  go.private_ok = private_ok;  // a copying get: a connector may land the payload in memory the result owns
  if (inline_ref.is_valid())
    go.metadata_inline = std::span<const std::byte>(reinterpret_cast<const std::byte*>(PyBytes_AS_STRING(inline_ref.ptr())),
                                                    size_t(PyBytes_GET_SIZE(inline_ref.ptr())));
  SignalCheck sig;  // a get that may wait for its key: Ctrl-C ends the wait
  if (secs > 0) go.keep_waiting = std::ref(sig);
  const Deadline dl = secs < 0 ? kNoWait : deadline_after(secs);
  if (self.networked || !lookup) {  // may cross a network, or wait for the key: without the GIL
    nb::gil_scoped_release nogil;
    r = conn.get(f, t, key, has_md ? &md.value : nullptr, dl, go);
  } else {  // our metadata: a direct lookup (microseconds)
    r = conn.get(f, t, key, has_md ? &md.value : nullptr, dl, go);
  }
  if (sig.raised) throw nb::python_error();
  if (!r.ok()) {
    const Errc c = r.error().code;  // absent, timed out, abandoned: None, as vLLM-Omni's get
    if (c == Errc::not_found || c == Errc::timeout || c == Errc::cancelled) {
      t_miss = std::move(r).error();
      return std::nullopt;
    }
    raise(r.error());
  }
  return std::move(r).value();
}

// What a get found: `kind` KIND_OBJECT with `obj` the finished object (a numpy array, a C++
// producer's tree), else a pickle kind with `obj` the list of its regions.
struct Found {
  int64_t kind = KIND_OBJECT;
  nb::object obj;
  size_t size = 0;
};

Found found_of(GetResult& g, bool zero_copy, bool allow_pickle, const std::string& key);

std::optional<Found> get_found(PyConnector& self, nb::handle from, nb::handle to, const std::string& key,
                               nb::handle metadata, nb::handle timeout, bool zero_copy) {
  // Always borrow the slot: copy mode copies each region exactly once, into the Python object,
  // and the slot is released when `g` goes out of scope below.
  MetadataHold md;  // outlives `got`: inline tensors view it
  std::optional<GetResult> got = borrow(self, from, to, key, metadata, timeout, md, !zero_copy);
  if (!got) return std::nullopt;
  return found_of(*got, zero_copy, self.allow_pickle, key);
}

// The Python object of a received payload (KIND_OBJECT), or a pickle's kind and regions to unpickle.
Found found_of(GetResult& g, bool zero_copy, bool allow_pickle, const std::string& key) {
  const ExtInfo ext = ExtInfo::of(g.payload);
  if (!ext.pickle) return Found{KIND_OBJECT, native_object(g.payload, zero_copy, ext, g.owned && !zero_copy), g.size};
  if (!allow_pickle)
    raise(make_error(Errc::corrupt, "'" + key + "' holds a pickled object and allow_pickle is off: refused unread"));
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

// Python's `Connector.get`: (data, size), or None when absent, timed out or failed (logged by
// `_fail`; raised in strict mode). A pickled payload is finished by the subclass's `_decode`.
nb::object connector_get(nb::handle self_h, nb::handle from, nb::handle to, nb::handle key, nb::handle metadata,
                         nb::handle timeout, bool zero_copy) {
  std::optional<Found> f;
  try {
    if (!PyUnicode_Check(key.ptr())) {
      PyErr_SetString(PyExc_TypeError, "get_key must be a str");
      throw nb::python_error();
    }
    static PyObject* const kDefaultTimeout = PyUnicode_InternFromString("default_get_timeout");  // immortal
    nb::object tmo = timeout.is_none() ? self_h.attr(kDefaultTimeout) : nb::borrow(timeout);
    f = get_found(*nb::inst_ptr<PyConnector>(self_h), from, to, utf8(key.ptr()), metadata, tmo, zero_copy);
  } catch (nb::python_error& e) {
    report_or_rethrow(self_h, "get", e);
    return nb::none();
  }
  if (!f) {  // None, as vLLM-Omni's get; `last_error` says why (strict mode raises it)
    self_h.attr("_miss")(exception_of(t_miss));
    return nb::none();
  }
  nb::inst_ptr<PyConnector>(self_h)->succeeded();
  if (f->kind == KIND_OBJECT) return nb::make_tuple(f->obj, f->size);
  return self_h.attr("_decode")(key, f->kind, f->obj, f->size, zero_copy);
}

// get_into: copy the array (or bytes) of key straight into `out`, a writable contiguous buffer the
// caller owns and may reuse: one memcpy, no allocation. Returns the bytes written, None when absent.
nb::object get_into_parts(PyConnector& self, nb::handle from, nb::handle to, const std::string& key,
                          nb::handle metadata, nb::handle timeout, nb::handle out) {
  Py_buffer view;
  if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
  BufferViews hold;
  hold.views.push_back(view);
  MetadataHold md;  // outlives `got`: inline tensors view it
  std::optional<GetResult> got = borrow(self, from, to, key, metadata, timeout, md);
  if (!got) return nb::none();
  GetResult& g = *got;
  // A typed array (Python's or C++'s) or raw bytes (region 0) copy straight; a pickled object
  // needs unpickling.
  const size_t idx = 0;
  if (g.payload.ext_has("pickle"))
    raise(make_error(Errc::invalid_argument, "get_into: '" + key + "' holds a pickled object; use get()"));
  if (idx >= g.payload.tensors.size())
    raise(make_error(Errc::invalid_argument, "get_into: '" + key + "' has no array to copy"));
  const Tensor& tn = g.payload.tensors[idx];
  if (tn.nbytes() > size_t(view.len))
    raise(make_error(Errc::invalid_argument, "get_into: '" + key + "' holds " + std::to_string(tn.nbytes()) +
                                                 " bytes; the destination has " + std::to_string(view.len)));
  if (tn.nbytes() > kGilReleaseBytes) {
    nb::gil_scoped_release nogil;
    host_pool::copy_split(static_cast<std::byte*>(view.buf), tn.data.data(), tn.nbytes());
  } else if (tn.nbytes()) {
    std::memcpy(view.buf, tn.data.data(), tn.nbytes());
  }
  return nb::int_(tn.nbytes());
}

// ---- MessageQueue ----
// shared_ptr: an enqueue/dequeue blocked with the GIL released keeps the queue alive even if
// another thread closes it (close shuts it down first, which wakes that call with cancelled).
struct PyMq {
  std::shared_ptr<MessageQueue> q;
  // A writer with remote readers: an enqueue that times out after the local readers got the
  // message leaves a gap for the remote ones, so it is not cut into slices (Ctrl-C waits for
  // its timeout there).
  bool remote_writer = false;
  explicit PyMq(std::unique_ptr<MessageQueue> m) : q(std::move(m)) {
    remote_writer = q->is_writer() && !q->export_handle().remote_addr.empty();
  }
  // A writer's enqueue: in slices (signal handlers run between them) unless remote_writer.
  void enqueue(const Payload& p, double t) {
    auto w = get();
    if (remote_writer) {
      Status st;
      {
        nb::gil_scoped_release nogil;
        st = w->enqueue(p, t);
      }
      if (!st.ok()) raise(st.error());
      return;
    }
    check_sliced(t, [&](double slice) { return w->enqueue(p, slice); });  // a full ring blocks until readers catch up
  }
  std::shared_ptr<MessageQueue> get() {
    if (!q) raise(make_error(Errc::closed, "message queue is closed"));
    return q;
  }
};


void mq_enqueue_parts(PyMq& self, int kind, nb::list regions, nb::handle timeout) {
  Payload p;
  BufferViews bv;
  payload_from_parts(kind, regions, bv, p);
  self.enqueue(p, timeout_arg(timeout));
}

// A numpy array, torch tensor, bytes-like or tree of them as a native frame; False when it needs
// the pickle path.
bool mq_enqueue_obj(PyMq& self, nb::handle obj, nb::handle timeout) {
  Payload p;
  BufferViews bv;
  if (!array_payload(obj, bv, p, false)) {
    PyEncoder enc{p, bv};
    if (!enc.run(obj)) return false;
  }
  self.enqueue(p, timeout_arg(timeout));
  return true;
}

// Returns (kind, [regions]) (or (KIND_OBJECT, object) for a numpy array or a C++ frame); each region copied once, straight from shared memory into a Python
// object, while the chunk is held.
// A frame as (KIND_OBJECT, object) or, for a pickle, (its kind, [regions copied out: the stream
// as bytes, the buffers]). Errors: corrupt.
nb::tuple frame_parts(std::span<const std::byte> frame) {
  Payload p;
  if (Status st = decode_frame_into(frame, nullptr, p, false); !st.ok()) raise(st.error());
  const ExtInfo ext = ExtInfo::of(p);
  if (!ext.pickle) return nb::make_tuple(KIND_OBJECT, native_object(p, false, ext));
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

// Returns (kind, [regions]) (or (KIND_OBJECT, object) for a native frame); each region copied once,
// straight from shared memory into a Python object, while the chunk is held.
nb::tuple mq_dequeue_parts(PyMq& self, nb::handle timeout) {
  const double t = timeout_arg(timeout);
  auto q = self.get();
  nb::object out;
  Error decode_err{Errc::ok, ""};
  Status st = sliced_nogil(t, [&](double slice) {
    return q->dequeue_with(slice, [&](std::span<const std::byte> frame) {
      nb::gil_scoped_acquire gil;
      try {  // nothing may be thrown through the queue's code
        out = frame_parts(frame);
      } catch (nb::python_error& e) {
        decode_err = Error{Errc::corrupt, std::string("message could not be read: ") + e.what()};
      }
    });
  });
  if (!st.ok()) raise(st.error());
  if (decode_err.code != Errc::ok) raise(decode_err);
  return nb::borrow<nb::tuple>(out);
}

// ---- control plane ----
ControlMessage control_from_args(const std::string& type, const std::string& rid, const std::string& from,
                                 const std::string& to, nb::handle metadata, nb::handle chunk_id, bool is_done,
                                 const std::string& error, nb::handle body) {
  ControlMessage c;
  c.type = unwrap(control_type_from_name(type));
  c.request_id = rid;
  c.from_stage = from;
  c.to_stage = to;
  if (!metadata.is_none()) c.metadata = from_py(metadata);
  if (!chunk_id.is_none()) {
    const long long v = PyLong_AsLongLong(chunk_id.ptr());
    if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    if (v < 0) raise(make_error(Errc::invalid_argument, "chunk_id must not be negative"));
    c.chunk_id = uint64_t(v);
  }
  c.is_done = is_done;
  c.error = error;
  if (!body.is_none()) {
    Py_buffer v;
    if (PyObject_GetBuffer(body.ptr(), &v, PyBUF_SIMPLE) != 0) throw nb::python_error();
    const auto* b = static_cast<const std::byte*>(v.buf);
    c.body.assign(b, b + v.len);
    PyBuffer_Release(&v);
  }
  return c;
}

nb::dict control_dict(const ControlMessage& c) {
  auto opt_str = [](const std::string& s) { return s.empty() ? nb::none() : py_str(s); };
  nb::dict d;
  d["type"] = control_type_name(c.type);
  d["request_id"] = py_str(c.request_id);
  d["from_stage"] = opt_str(c.from_stage);
  d["to_stage"] = opt_str(c.to_stage);
  try {
    d["metadata"] = to_py(c.metadata);
  } catch (const std::exception& e) {  // e.g. a string that is not UTF-8
    PyErr_Clear();
    raise(make_error(Errc::corrupt, std::string("control message: 'md' cannot be read: ") + e.what()));
  }
  d["chunk_id"] = c.chunk_id ? nb::object(nb::int_(*c.chunk_id)) : nb::none();
  d["is_done"] = c.is_done;
  d["error"] = opt_str(c.error);
  d["body"] = c.body.empty() ? nb::none()
                             : nb::object(nb::bytes(reinterpret_cast<const char*>(c.body.data()), c.body.size()));
  return d;
}

// CURVE keys from a Python dict: {public_key, secret_key} and allowed_clients (a server) or
// server_key (a client). A missing public key is derived from the secret one.
std::string curve_str(nb::handle d, const char* k, bool required) {
  PyObject* v = PyDict_GetItemString(d.ptr(), k);
  if (!v) {
    if (required) raise(make_error(Errc::invalid_argument, std::string("CURVE keys: '") + k + "' is missing"));
    return {};
  }
  if (!PyUnicode_Check(v)) raise(make_error(Errc::invalid_argument, std::string("CURVE keys: '") + k + "' must be a str"));
  return utf8(v);
}
CurveKeyPair curve_pair(nb::handle d) {
  if (!PyDict_Check(d.ptr())) raise(make_error(Errc::invalid_argument, "CURVE keys are a dict"));
  CurveKeyPair p{curve_str(d, "public_key", false), curve_str(d, "secret_key", true)};
  if (p.public_key.empty()) p.public_key = unwrap(curve_public_of(p.secret_key));
  return p;
}
std::optional<CurveServer> curve_server(nb::handle d) {
  if (d.is_none()) return std::nullopt;
  CurveServer s{curve_pair(d), {}};
  PyObject* a = PyDict_GetItemString(d.ptr(), "allowed_clients");
  if (!a || !PyList_Check(a)) raise(make_error(Errc::invalid_argument, "CURVE keys: 'allowed_clients' must be a list of public keys"));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a); ++i) {
    PyObject* k = PyList_GET_ITEM(a, i);
    if (!PyUnicode_Check(k)) raise(make_error(Errc::invalid_argument, "CURVE keys: allowed_clients holds public keys (str)"));
    s.allowed_clients.push_back(utf8(k));
  }
  return s;
}
std::optional<CurveClient> curve_client(nb::handle d) {
  if (d.is_none()) return std::nullopt;
  return CurveClient{curve_pair(d), curve_str(d, "server_key", true)};
}

// A message queue's `curve` argument: the `extra.curve` map of the connectors (secret_key or
// secret_key_file, server_key, allowed_clients).
std::optional<CurveConfig> mq_curve(nb::handle d) {
  if (d.is_none()) return std::nullopt;
  Value::Map m;
  m.emplace_back("curve", from_py(d));
  return unwrap(curve_from_extra(Value(std::move(m)), "MessageQueue"));
}

struct PyInbox {
  std::shared_ptr<ControlInbox> in;
  std::shared_ptr<ControlInbox> get() {
    if (!in) raise(make_error(Errc::closed, "control inbox is closed"));
    return in;
  }
};
struct PyOutbox {
  std::shared_ptr<ControlOutbox> out;
  std::shared_ptr<ControlOutbox> get() {
    if (!out) raise(make_error(Errc::closed, "control outbox is closed"));
    return out;
  }
};


// ---- Relay ----
// shared_ptr: a put or get blocked with the GIL released keeps the relay alive if another thread
// closes it (close ends that wait with `closed`).
struct PyRelay {
  std::shared_ptr<Relay> r;
  bool allow_pickle = true;
  std::shared_ptr<Relay> get() {
    if (!r) raise(make_error(Errc::closed, "relay is closed"));
    return r;
  }
};
struct PyRelayOp {
  RelayOp op;
  nb::object metadata;  // converted once
};

RelayPutOptions relay_put_options(nb::handle rid, nb::handle dst_rank, const std::string& edge, uint32_t readers,
                                  std::string& rid_holder) {
  rid_holder = rid_str(rid);
  RelayPutOptions o;
  o.request_id = rid_holder;
  if (!dst_rank.is_none()) o.dst_rank = nb::cast<int>(dst_rank);
  o.edge = edge;
  o.readers = readers;
  return o;
}

// A relay put by `put(relay, options)`: without the GIL (a credit wait may block up to
// timeout_s), Ctrl-C ending a wait for a credit.
template <class Put>
PyRelayOp relay_put_with(PyRelay& self, const RelayPutOptions& o, Put&& put) {
  auto relay = self.get();
  Result<RelayOp> r = make_error(Errc::io, "");
  SignalCheck sig;
  RelayPutOptions opts = o;
  opts.keep_waiting = std::ref(sig);
  {
    nb::gil_scoped_release nogil;
    r = put(*relay, opts);
  }
  if (sig.raised) throw nb::python_error();
  RelayOp op = unwrap(std::move(r));
  nb::object md = to_py(op.metadata());
  return PyRelayOp{std::move(op), std::move(md)};
}

PyRelayOp relay_put_payload(PyRelay& self, const Payload& p, const RelayPutOptions& o) {
  return relay_put_with(self, o, [&](Relay& r, const RelayPutOptions& opts) { return r.put_async(p, opts); });
}

// SGLang-Omni's put_many_async: (offset, buffer) pairs, each a C-contiguous buffer, into one
// uint8 tensor of `total` bytes (Relay::put_segments).
PyRelayOp relay_put_segments(PyRelay& self, nb::handle segments, size_t total, const RelayPutOptions& o) {
  BufferViews bv;
  std::vector<RelaySegment> segs;
  nb::object seq = nb::steal(PySequence_Fast(segments.ptr(), "put_segments: segments must be a sequence"));
  if (!seq.is_valid()) throw nb::python_error();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  bv.views.reserve(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.ptr(), i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2)
      throw nb::type_error("put_segments: each segment is an (offset, buffer) pair");
    const long long off = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0));
    if (off == -1 && PyErr_Occurred()) throw nb::python_error();
    if (off < 0) raise(make_error(Errc::invalid_argument, "put_segments: a negative offset"));
    Py_buffer v;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &v, PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
    bv.views.push_back(v);
    segs.push_back({size_t(off), std::span<const std::byte>(static_cast<const std::byte*>(v.buf), size_t(v.len))});
  }
  return relay_put_with(self, o, [&](Relay& r, const RelayPutOptions& opts) { return r.put_segments(segs, total, opts); });
}

// Native frames for arrays, tensors, bytes and trees; None when the object needs pickling (the
// Python side then calls _put_parts).
nb::object relay_put_obj(PyRelay& self, nb::handle data, nb::handle rid, nb::handle dst_rank, const std::string& edge,
                         uint32_t readers) {
  Payload p;
  BufferViews bv;
  if (!array_payload(data, bv, p, true)) {
    PyEncoder enc{p, bv};
    if (!enc.run(data)) return nb::none();
  }
  std::string rh;
  return nb::cast(relay_put_payload(self, p, relay_put_options(rid, dst_rank, edge, readers, rh)));
}

RelayGetOptions relay_get_options(nb::handle rid, nb::handle timeout, bool zero_copy, std::string& rid_holder) {
  rid_holder = rid_str(rid);
  RelayGetOptions o;
  o.request_id = rid_holder;
  o.zero_copy = zero_copy;
  o.timeout_s = timeout_arg(timeout);
  return o;
}

RelayOp relay_get(PyRelay& self, nb::handle metadata, const RelayGetOptions& o) {
  const Value md = from_py(metadata);
  auto relay = self.get();
  Result<RelayOp> r = make_error(Errc::io, "");
  SignalCheck sig;  // Ctrl-C ends a get still waiting for its payload
  RelayGetOptions opts = o;
  opts.keep_waiting = std::ref(sig);
  {
    nb::gil_scoped_release nogil;
    r = relay->get_async(md, opts);
  }
  if (sig.raised) throw nb::python_error();
  return unwrap(std::move(r));
}

nb::dict spec_dict(const ConnectorSpec& s) {
  nb::dict d;
  d["name"] = s.name;
  d["extra"] = to_py(s.extra);
  d["ref"] = s.ref;
  return d;
}

nb::dict config_dict(const TransferConfig& cfg) {
  nb::dict out;
  nb::list edges;
  for (auto& e : cfg.edges) {
    nb::dict d;
    d["from"] = e.from;
    d["to"] = e.to;
    d["connector"] = spec_dict(e.connector);
    d["defaulted"] = e.defaulted;
    edges.append(d);
  }
  out["edges"] = edges;
  nb::dict conns;
  for (auto& [k, v] : cfg.connectors) conns[nb::str(k.c_str())] = spec_dict(v);
  out["connectors"] = conns;
  nb::list stages;
  nb::dict per_stage;
  for (auto& s : cfg.stages) {
    stages.append(s);
    nb::list l;
    for (auto& sc : cfg.stage_connectors(s)) {
      nb::dict d;
      d["peer"] = sc.peer;
      d["direction"] = sc.input ? "input" : "output";
      d["role"] = role_name(sc.role);
      d["connector"] = spec_dict(sc.connector);
      l.append(d);
    }
    per_stage[nb::str(s.c_str())] = l;
  }
  out["stages"] = stages;
  out["stage_connectors"] = per_stage;
  out["default_shm_threshold_bytes"] = cfg.default_shm_threshold_bytes;
  out["source"] = cfg.source;
  nb::list notes;
  for (auto& n : cfg.notes) notes.append(n);
  out["notes"] = notes;
  return out;
}

nb::dict stat_dict(const bench::Stat& s) {
  nb::dict d;
  d["median_us"] = s.median_us;
  d["p99_us"] = s.p99_us;
  return d;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "stagelink native core";
  if (_import_array() < 0) throw nb::python_error();  // numpy's C API
  PyObject* base = PyErr_NewException("stagelink.StagelinkError", PyExc_RuntimeError, nullptr);
  m.attr("StagelinkError") = nb::handle(base);
  g_base_exc = base;
  const char* names[] = {"", "TimeoutError", "NotFoundError", "ClosedError", "CancelledError",
                         "InvalidArgumentError", "CorruptError", "ExhaustedError", "PeerDeadError",
                         "IOError", "UnsupportedError", "KeyInUseError", "PermissionDeniedError"};
  for (int i = 1; i <= 12; ++i) {
    std::string full = std::string("stagelink.") + names[i];
    PyObject* bases = base;
    nb::object tup;
    if (i == 1) tup = nb::make_tuple(nb::handle(base), nb::handle(PyExc_TimeoutError));
    else if (i == 5) tup = nb::make_tuple(nb::handle(base), nb::handle(PyExc_ValueError));
    else if (i == 12) tup = nb::make_tuple(nb::handle(base), nb::handle(PyExc_PermissionError));
    // NotFoundError: also a ValueError, which vLLM-Omni's callers catch for an unknown connector name.
    else if (i == 2) tup = nb::make_tuple(nb::handle(base), nb::handle(PyExc_KeyError), nb::handle(PyExc_ValueError));
    PyObject* e = PyErr_NewException(full.c_str(), tup.is_valid() ? tup.ptr() : bases, nullptr);
    g_exc[i] = e;
    m.attr(names[i]) = nb::handle(e);
  }

  nb::class_<PyLoan>(m, "_Loan")
      .def("region", &PyLoan::region, nb::rv_policy::reference_internal)
      .def_prop_ro("count", [](PyLoan& l) { return l.loan.tensor_count(); })
      .def_prop_ro("frame_size", [](PyLoan& l) { return l.loan.frame_size(); })
      .def_prop_ro("valid", [](PyLoan& l) { return l.loan.valid(); });

  // The base of Python's `stagelink.Connector`: `put` and `get` run here without a Python frame
  // (the subclass supplies `_put_slow`, `_decode`, `_fail` and `default_get_timeout`); the
  // underscored methods are the subclass's building blocks.
  nb::class_<PyConnector>(m, "_Connector", nb::type_slots(g_connector_slots))
      .def("__init__", [](PyConnector* self, const std::string& name, nb::handle extra, bool allow_pickle) {
             Value e = extra.is_none() ? Value(Value::Map{}) : from_py(extra);
             Result<std::unique_ptr<Connector>> made = make_error(Errc::io, "");
             {
               nb::gil_scoped_release nogil;  // a network connector connects (and asks its server) here
               made = create_connector(name, e);
             }
             auto c = unwrap(std::move(made));
             const bool networked = c->name() != "SharedMemoryConnector";
             new (self) PyConnector{std::move(c), allow_pickle, networked};
           }, nb::arg("name"), nb::arg("extra").none(), nb::arg("allow_pickle") = true)
      .def("put", [](nb::handle self, nb::handle from, nb::handle to, nb::handle key, nb::handle data,
                     nb::handle readers, nb::handle request_id) {
             return connector_put(self, from, to, key, data, readers, request_id);
           },
           nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("put_key"), nb::arg("data").none(), nb::kw_only(),
           nb::arg("readers").none() = nb::none(), nb::arg("request_id").none() = nb::none(),
           "Publish ``data`` for ``get(from_stage, to_stage, put_key)``; returns ``(success, size, metadata)``.\n\n"
           "``readers``: how many gets may read it (fan-out); the memory is freed after the last one.\n"
           "``request_id``: ties the put to a request, so that ``cleanup(request_id)`` frees it (chunk\n"
           "keys of one request); without it only ``cleanup(put_key)`` does.\n"
           "numpy arrays, torch tensors (any dtype), bytes-likes and trees of dicts, lists, tuples,\n"
           "str, int, float, bool and None travel as native frames, readable from C++; ``Loan``\n"
           "objects are published in place; anything else is pickled (protocol 5, buffers out of\n"
           "band) where ``allow_pickle`` permits.")
      .def("get", [](nb::handle self, nb::handle from, nb::handle to, nb::handle key, nb::handle metadata,
                     nb::handle timeout, bool zero_copy) {
             return connector_get(self, from, to, key, metadata, timeout, zero_copy);
           },
           nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("get_key"), nb::arg("metadata").none() = nb::none(),
           nb::arg("timeout").none() = nb::none(), nb::kw_only(), nb::arg("zero_copy") = false,
           "Fetch what ``put`` published: ``(data, size)``, or ``None`` when absent, timed out or failed.\n\n"
           "``metadata``: what put returned (direct lookup); without it the key is looked up, waiting\n"
           "up to ``timeout`` seconds (None: ``extra.get_timeout_s``, else a single attempt).\n"
           "``zero_copy``: arrays and buffers are read-only views into shared memory that keep the\n"
           "slot alive until dropped; otherwise the data is copied out and the slot freed at once.")
      .def("_put_parts", &put_parts, nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("key"), nb::arg("kind"),
           nb::arg("regions"), nb::arg("readers") = 0, nb::arg("request_id").none() = nb::none())
      .def("_get_into_parts", &get_into_parts, nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("key"),
           nb::arg("metadata").none(), nb::arg("timeout").none(), nb::arg("out"))
      .def("_loan_array", [](PyConnector& self, const std::string& dtype, std::vector<int64_t> shape) {
             // One typed region in the arena, read back as a numpy array (or a C++ tensor).
             TensorSpec spec;
             spec.dtype = unwrap(dtype_from_name(dtype));
             size_t n = dtype_size(spec.dtype);
             for (auto d : shape) {
               if (d < 0) raise(make_error(Errc::invalid_argument, "loan: negative dimension"));
               n *= size_t(d);
             }
             spec.nbytes = n;
             spec.shape = std::move(shape);
             return PyLoan{unwrap(self.get()->loan(Value(TensorRef{0}), std::span<const TensorSpec>(&spec, 1)))};
           })
      .def("_put_loan", [](PyConnector& self, nb::handle from, nb::handle to, const std::string& key, PyLoan& loan,
                           uint32_t readers, nb::handle request_id) {
             const std::string rid = rid_str(request_id);
             PutResult pr =
                 unwrap(self.get()->put_loan(stage_str(from), stage_str(to), key, std::move(loan.loan), PutOptions{readers, rid}));
             return nb::make_tuple(pr.size, to_py(pr.metadata));
           }, nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("key"), nb::arg("loan"), nb::arg("readers") = 0,
           nb::arg("request_id").none() = nb::none())
      .def("_cleanup", [](PyConnector& self, const std::string& rid) {
             auto c = self.get();
             if (!self.networked) return c->cleanup(rid);
             nb::gil_scoped_release nogil;  // a store's cleanup is a few round trips
             return c->cleanup(rid);
           })
      .def("_abandon_get", [](PyConnector& self, const std::string& key) { return self.get()->abandon_get(key); })
      .def("_reap_consumed", [](PyConnector& self) { return self.get()->reap_consumed(); })
      .def("_arrival_epoch", [](PyConnector& self) -> nb::object {
             if (!self.c) return nb::none();
             auto e = self.c->arrival_epoch();
             if (!e.ok()) return nb::none();
             return nb::int_(e.value());
           })
      .def("_wait_arrival", [](PyConnector& self, uint64_t seen, double timeout_s) {
             if (!self.c) return false;
             const std::shared_ptr<Connector> c = self.c;
             // In slices (a Status: timeout while nothing arrived), so Ctrl-C ends the wait.
             Status st = sliced_nogil(std::max(timeout_s, 0.0), [&](double slice) -> Status {
               if (c->wait_arrival(seen, deadline_after(slice))) return {};
               return make_error(Errc::timeout, "no arrival");
             });
             return st.ok();
           })
      .def("_pending_key_list", [](PyConnector& self) -> nb::object {
             if (!self.c) return nb::list();
             auto k = self.c->pending_keys();
             if (!k.ok()) return nb::none();
             nb::list out;
             for (auto& s : k.value()) out.append(nb::str(s.data(), s.size()));
             return out;
           })
      .def("_sender_info", [](PyConnector& self) { return self.c ? to_py(self.c->sender_info()) : nb::none(); })
      .def("_connect", [](PyConnector& self, nb::handle info, nb::handle timeout) {
             const Value v = info.is_none() ? Value() : from_py(info);
             const Deadline dl = deadline_after(timeout_or(timeout, 1e9));  // None: for ever
             const std::shared_ptr<Connector> c = self.get();
             Status st;
             {
               nb::gil_scoped_release nogil;
               st = c->connect(v, dl);
             }
             if (!st.ok()) raise(st.error());
           }, nb::arg("sender_info").none(), nb::arg("timeout").none())
      .def("_update_sender_info", [](PyConnector& self, const std::string& host, int port) {
             auto st = self.get()->update_sender_info(host, port);
             if (!st.ok()) raise(st.error());
           })
      .def_prop_ro("allow_pickle", [](PyConnector& self) { return self.allow_pickle; })
      .def_prop_rw("last_error", [](PyConnector& self) { return self.last_error; },
                   [](PyConnector& self, nb::handle e) { self.last_error = nb::borrow(e); }, nb::arg("error").none(),
                   "Why the last put or get failed or returned None (NotFoundError: nothing under the key, or "
                   "already read by every reader; TimeoutError; CancelledError: cleaned up), kept without its "
                   "traceback; None after a call that worked.")
      .def("_health", [](PyConnector& self) {
             if (!self.c) return nb::object(nb::dict());
             const std::shared_ptr<Connector> c = self.c;
             Value h;
             if (self.networked) {
               nb::gil_scoped_release nogil;  // asks the server (INFO)
               h = c->health();
             } else {
               h = c->health();
             }
             return to_py(h);
           })
      .def("close", [](PyConnector& self) {
             if (self.c) {
               const std::shared_ptr<Connector> c = std::move(self.c);  // later calls say closed
               nb::gil_scoped_release nogil;
               c->close();  // wakes calls in flight; they hold their own references
             }
           }, "Release everything this connector owns. Safe to call twice.")
      .def_prop_ro("closed", [](PyConnector& self) { return !self.c; });

  nb::class_<PyMq>(m, "_MessageQueue")
      .def_static("create", [](uint32_t n_reader, uint32_t n_local_reader, std::vector<uint32_t> local_ranks,
                               size_t max_chunk_bytes, uint32_t max_chunks, const std::string& connect_ip, int remote_port,
                               size_t overflow_bytes, double warn_interval_s, bool drop_dead_readers, uint64_t spin_us,
                               const std::string& shm_dir, nb::handle curve) {
             MessageQueueOptions o;
             if (auto cc = mq_curve(curve)) o.curve = cc->server;
             o.n_reader = n_reader;
             o.n_local_reader = n_local_reader;
             o.local_reader_ranks = std::move(local_ranks);
             o.max_chunk_bytes = max_chunk_bytes;
             o.max_chunks = max_chunks;
             o.connect_ip = connect_ip;
             o.remote_port = remote_port;
             o.overflow_bytes = overflow_bytes;
             o.warn_interval_s = warn_interval_s;
             o.drop_dead_readers = drop_dead_readers;
             o.spin_us = spin_us;
             o.shm_dir = shm_dir;
             return PyMq(unwrap(MessageQueue::create(o)));
           }, nb::arg("n_reader"), nb::arg("n_local_reader"), nb::arg("local_ranks"), nb::arg("max_chunk_bytes"),
           nb::arg("max_chunks"), nb::arg("connect_ip"), nb::arg("remote_port"), nb::arg("overflow_bytes"),
           nb::arg("warn_interval_s"), nb::arg("drop_dead_readers"), nb::arg("spin_us"), nb::arg("shm_dir"),
           nb::arg("curve").none() = nb::none())
      .def_static("create_from_handle", [](nb::bytes handle, int64_t rank, nb::handle curve) {
             auto h = unwrap(MessageQueueHandle::from_msgpack(
                 std::span<const std::byte>(reinterpret_cast<const std::byte*>(handle.c_str()), handle.size())));
             auto cc = mq_curve(curve);
             return PyMq(unwrap(MessageQueue::create_from_handle(h, rank, cc ? &cc->client : nullptr)));
           }, nb::arg("handle"), nb::arg("rank"), nb::arg("curve").none() = nb::none())
      .def("export_handle", [](PyMq& self) {
             auto b = self.get()->export_handle().to_msgpack();
             return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def("wait_until_ready", [](PyMq& self, nb::handle timeout) {
             const double t = timeout_arg(timeout);
             auto q = self.get();
             check_sliced(t, [&](double slice) { return q->wait_until_ready(slice); });
           }, nb::arg("timeout").none())
      .def("enqueue_parts", &mq_enqueue_parts, nb::arg("kind"), nb::arg("regions"), nb::arg("timeout").none())
      .def("enqueue_obj", &mq_enqueue_obj, nb::arg("obj").none(), nb::arg("timeout").none())
      .def("dequeue_parts", &mq_dequeue_parts, nb::arg("timeout").none())
      .def("wait_message", [](PyMq& self, nb::handle timeout) {
             const double t = timeout_arg(timeout);
             auto q = self.get();
             Result<bool> r = t == 0 ? q->wait_message(0) : [&] {  // a poll needs no GIL release
               nb::gil_scoped_release nogil;
               return q->wait_message(t);
             }();
             return unwrap(std::move(r));
           }, nb::arg("timeout").none())
      .def("drop_reader", [](PyMq& self, uint32_t rank) {
             auto st = self.get()->drop_reader(rank);
             if (!st.ok()) raise(st.error());
           })
      .def("shutdown", [](PyMq& self, bool everyone) { if (self.q) self.q->shutdown(everyone); },
           nb::arg("everyone") = false)
      .def("stats", [](PyMq& self) { return self.q ? to_py(self.q->stats()) : nb::object(nb::dict()); })
      .def_prop_ro("is_writer", [](PyMq& self) { return self.get()->is_writer(); })
      .def_prop_ro("rank", [](PyMq& self) { return self.get()->rank(); })
      .def_prop_ro("shutting_down", [](PyMq& self) { return !self.q || self.q->shutting_down(); })
      .def_prop_ro("closed", [](PyMq& self) { return !self.q; })
      .def("close", [](PyMq& self) {
             std::shared_ptr<MessageQueue> q = std::move(self.q);
             if (q) {
               nb::gil_scoped_release nogil;  // the writer's socket may flush (bounded linger)
               q->shutdown(true);  // a closed writer has ended the queue for its readers
               q.reset();
             }
           });

  // A frame as C++ sees it (tree with tensor leaves as (dtype, shape, bytes), and the ext a C++ reader
  // ignores): what tests use to check that Python payloads are native frames.
  m.def("_torch_routes", [](bool exchange_api, bool dlpack) {
        const TorchRoutes was = g_torch_routes;
        g_torch_routes = TorchRoutes{exchange_api, dlpack};
        return nb::make_tuple(was.exchange_api, was.dlpack);
      }, nb::arg("exchange_api"), nb::arg("dlpack"),
      "For tests: which of torch's routes tensors may take (DLPack's C exchange API, DLPack capsules; "
      "off: the attribute and numpy routes an older torch leaves). Returns the previous setting.");
  m.def("_frame_as_cpp_sees_it", [](nb::bytes frame) {
    auto p = unwrap(decode_frame(std::span<const std::byte>(reinterpret_cast<const std::byte*>(frame.c_str()), frame.size())));
    std::vector<nb::object> leaves;
    for (auto& t : p.tensors) {
      nb::list shape;
      for (auto d : t.shape) shape.append(d);
      leaves.push_back(nb::make_tuple(dtype_name(t.dtype), nb::tuple(shape),
                                      nb::bytes(reinterpret_cast<const char*>(t.data.data()), t.nbytes())));
    }
    nb::dict d;
    d["tree"] = to_py(p.tree, &leaves);
    d["ext"] = to_py(p.ext);
    return d;
  });
  m.def("cuda_status", [] { return to_py(cuda::status()); },
        "Whether this process can use CUDA (the driver is loaded at run time): {'available': bool, "
        "'reason': why not, or 'driver_version' and 'devices' [{ordinal, name, uuid, total_bytes}]}.");
  m.def("mq_handle_info", [](nb::bytes handle) {
    auto h = unwrap(MessageQueueHandle::from_msgpack(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(handle.c_str()), handle.size())));
    nb::dict d;
    nb::list ranks;
    for (auto r : h.local_reader_ranks) ranks.append(r);
    d["local_reader_ranks"] = ranks;
    d["n_reader"] = h.n_reader;
    d["ring_name"] = h.ring_name;
    d["overflow_name"] = h.overflow_name;
    d["shm_dir"] = h.shm_dir;
    d["remote_addr"] = h.remote_addr;
    d["server_key"] = h.server_key;
    d["chunk_bytes"] = h.chunk_bytes;
    d["max_chunks"] = h.max_chunks;
    return d;
  });
  m.def("host_address", &net::host_address);
  m.def("host_pool_stats", [] {  // the pool of host buffers copying gets land in (tests, diagnosis)
    const auto s = host_pool::stats();
    nb::dict d;
    d["cached_bytes"] = s.cached_bytes;
    d["cached_buffers"] = s.cached_buffers;
    d["limit_bytes"] = s.limit_bytes;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    return d;
  });
  m.def("expand_env", [](const std::string& value, const std::string& key, const std::string& source, bool bare) {
    return unwrap(expand_env_value(value, key, source, bare));
  }, nb::arg("value"), nb::arg("key"), nb::arg("source"), nb::arg("bare") = false);
  // vLLM-Omni's serialize_obj/deserialize_obj: one frame in a bytes object.
  // `limit` >= 0: None too when the tensors, bytes and packed tree add up to more than `limit`
  // bytes, found before anything is copied (the pipeline's payloads inside control messages).
  m.def("encode_object", [](nb::handle obj, int64_t limit) -> nb::object {
    Payload p;
    BufferViews bv;
    PyEncoder enc{p, bv};
    enc.limit = limit;
    if (!enc.run(obj)) return nb::none();  // needs pickle (or over the limit): the caller sends parts
    if (limit >= 0 && enc.total + p.packed_tree.size() > uint64_t(limit)) return nb::none();
    return frame_bytes(p);
  }, nb::arg("obj").none(), nb::arg("limit") = -1);
  m.def("encode_parts", [](int kind, nb::list regions) {
    Payload p;
    BufferViews bv;
    payload_from_parts(kind, regions, bv, p);
    return frame_bytes(p);
  });
  m.def("decode_frame_parts", [](nb::bytes data) {
    return frame_parts(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.c_str()), data.size()));
  });
  m.def("control_encode", [](const std::string& type, const std::string& rid, const std::string& from,
                             const std::string& to, nb::handle metadata, nb::handle chunk_id, bool is_done,
                             const std::string& error, nb::handle body) {
    auto out = unwrap(encode_control(control_from_args(type, rid, from, to, metadata, chunk_id, is_done, error, body)));
    return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size());
  }, nb::arg("type"), nb::arg("request_id"), nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("metadata").none(),
     nb::arg("chunk_id").none(), nb::arg("is_done"), nb::arg("error"), nb::arg("body").none());
  m.def("control_decode", [](nb::handle data) {
    Py_buffer v;
    if (PyObject_GetBuffer(data.ptr(), &v, PyBUF_SIMPLE) != 0) throw nb::python_error();
    auto r = decode_control(std::span<const std::byte>(static_cast<const std::byte*>(v.buf), size_t(v.len)));
    PyBuffer_Release(&v);
    return control_dict(unwrap(std::move(r)));
  });
  nb::class_<PyInbox>(m, "_ControlInbox")
      .def_static("bind", [](const std::string& ep, nb::handle curve) {
             auto cs = curve_server(curve);
             return PyInbox{std::shared_ptr<ControlInbox>(unwrap(ControlInbox::bind(ep, cs ? &*cs : nullptr)))};
           }, nb::arg("endpoint"), nb::arg("curve").none() = nb::none())
      .def_prop_ro("refused", [](PyInbox& self) { return self.get()->refused(); })
      .def_prop_ro("authenticated", [](PyInbox& self) { return self.get()->authenticated(); })
      .def_prop_ro("endpoint", [](PyInbox& self) { return self.get()->endpoint(); })
      .def("recv", [](PyInbox& self, nb::handle timeout) {
             const double t = timeout_arg(timeout);
             auto in = self.get();
             return control_dict(unwrap(sliced_nogil(t, [&](double slice) { return in->recv(slice); })));
           }, nb::arg("timeout").none())
      .def("close", [](PyInbox& self) {
             if (auto in = std::move(self.in)) {
               nb::gil_scoped_release nogil;
               in->close();
             }
           })
      .def_prop_ro("closed", [](PyInbox& self) { return !self.in; });
  nb::class_<PyOutbox>(m, "_ControlOutbox")
      .def_static("connect", [](const std::string& ep, nb::handle curve) {
             auto cc = curve_client(curve);
             return PyOutbox{std::shared_ptr<ControlOutbox>(unwrap(ControlOutbox::connect(ep, cc ? &*cc : nullptr)))};
           }, nb::arg("endpoint"), nb::arg("curve").none() = nb::none())
      .def("send", [](PyOutbox& self, const std::string& type, const std::string& rid, const std::string& from,
                      const std::string& to, nb::handle metadata, nb::handle chunk_id, bool is_done,
                      const std::string& error, nb::handle body, nb::handle timeout) {
             const ControlMessage c = control_from_args(type, rid, from, to, metadata, chunk_id, is_done, error, body);
             const double t = timeout_arg(timeout);
             auto out = self.get();
             check_sliced(t, [&](double slice) { return out->send(c, slice); });
           }, nb::arg("type"), nb::arg("request_id"), nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("metadata").none(),
           nb::arg("chunk_id").none(), nb::arg("is_done"), nb::arg("error"), nb::arg("body").none(), nb::arg("timeout").none())
      .def("send_bytes", [](PyOutbox& self, nb::bytes b, nb::handle timeout) {
             auto st = self.get()->send_bytes(std::span<const std::byte>(reinterpret_cast<const std::byte*>(b.c_str()), b.size()),
                                              timeout_arg(timeout));
             if (!st.ok()) raise(st.error());
           }, nb::arg("data"), nb::arg("timeout").none())
      .def("close", [](PyOutbox& self) {
             if (auto out = std::move(self.out)) {
               nb::gil_scoped_release nogil;  // flushes for up to 1 s
               out->close();
             }
           })
      .def_prop_ro("closed", [](PyOutbox& self) { return !self.out; });
  nb::class_<PyRelayOp>(m, "_RelayOp")
      .def_prop_ro("metadata", [](PyRelayOp& self) { return self.metadata; })
      .def("wait", [](PyRelayOp& self, nb::handle timeout) {
             const double t = timeout_arg(timeout);
             check_sliced(t, [&](double slice) { return self.op.wait(slice); });
           }, nb::arg("timeout").none() = nb::none())
      .def("done", [](PyRelayOp& self) { return self.op.done(); })
      .def("withdraw", [](PyRelayOp& self) { return self.op.withdraw(); });
  nb::class_<PyRelay>(m, "_Relay")
      .def("__init__", [](PyRelay* self, nb::handle config, bool allow_pickle) {
             RelayConfig c = unwrap(RelayConfig::from_value(config.is_none() ? Value() : from_py(config)));
             new (self) PyRelay{std::shared_ptr<Relay>(unwrap(Relay::create(c))), allow_pickle};
           }, nb::arg("config").none(), nb::arg("allow_pickle") = true)
      .def("_put_obj", &relay_put_obj, nb::arg("data").none(), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"))
      .def("_put_parts", [](PyRelay& self, int kind, nb::list regions, nb::handle rid, nb::handle dst_rank,
                            const std::string& edge, uint32_t readers) {
             Payload p;
             BufferViews bv;
             payload_from_parts(kind, regions, bv, p);
             std::string rh;
             return relay_put_payload(self, p, relay_put_options(rid, dst_rank, edge, readers, rh));
           }, nb::arg("kind"), nb::arg("regions"), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"))
      .def("_put_segments", [](PyRelay& self, nb::handle segments, size_t total, nb::handle rid, nb::handle dst_rank,
                               const std::string& edge, uint32_t readers) {
             std::string rh;
             return relay_put_segments(self, segments, total, relay_put_options(rid, dst_rank, edge, readers, rh));
           }, nb::arg("segments"), nb::arg("total"), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"))
      .def("_get_found", [](PyRelay& self, nb::handle metadata, nb::handle rid, nb::handle timeout, bool zero_copy) {
             std::string rh;
             // Always views (the slot held until `g` goes): a copying get copies each region once,
             // into its Python object (found_of), or not at all where the transport landed the
             // payload in memory it then owns (private_ok). A copying get at the connector too
             // copied every payload twice.
             RelayGetOptions o = relay_get_options(rid, timeout, true, rh);
             o.private_ok = !zero_copy;
             RelayOp op = relay_get(self, metadata, o);
             GetResult g{std::move(op.payload()), op.size(), op.owned()};
             Found f = found_of(g, zero_copy, self.allow_pickle, "relay payload");
             return nb::make_tuple(f.kind, f.obj, f.size);
           }, nb::arg("metadata").none(), nb::arg("request_id").none(), nb::arg("timeout").none(), nb::arg("zero_copy"))
      .def("_get_into", [](PyRelay& self, nb::handle metadata, nb::handle out, nb::handle rid, nb::handle timeout) {
             Py_buffer view;
             if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
             BufferViews hold;
             hold.views.push_back(view);
             std::string rh;
             RelayGetOptions o = relay_get_options(rid, timeout, false, rh);
             o.dest = std::span<std::byte>(static_cast<std::byte*>(view.buf), size_t(view.len));
             return relay_get(self, metadata, o).size();
           }, nb::arg("metadata").none(), nb::arg("out"), nb::arg("request_id").none(), nb::arg("timeout").none())
      .def("sender_info", [](PyRelay& self) { return self.r ? to_py(self.r->sender_info()) : nb::none(); },
           "Where another process's relay reaches this one's puts (a transfer engine's source_host and "
           "source_port), or None where nothing needs connecting (shared memory).")
      .def("_connect", [](PyRelay& self, nb::handle info, nb::handle timeout) {
             const Value v = info.is_none() ? Value() : from_py(info);
             const double t = timeout_or(timeout, -1.0);  // None: the relay's timeout_s
             auto r = self.get();
             Status st;
             {
               nb::gil_scoped_release nogil;
               st = r->connect(v, t);
             }
             if (!st.ok()) raise(st.error());
           }, nb::arg("sender_info").none(), nb::arg("timeout").none())
      .def("cleanup", [](PyRelay& self, const std::string& rid) { return self.get()->cleanup(rid); },
           "Release every unread put of ``request_id`` on this host and this relay's credits for them; returns how many.")
      .def("health", [](PyRelay& self) { return self.r ? to_py(self.r->health()) : nb::object(nb::dict()); })
      .def_prop_ro("allow_pickle", [](PyRelay& self) { return self.allow_pickle; })
      .def("close", [](PyRelay& self) {
             if (auto r = std::move(self.r)) {
               nb::gil_scoped_release nogil;
               r->close();
             }
           }, "Release everything; waits for credits end with ClosedError. Idempotent.")
      .def_prop_ro("closed", [](PyRelay& self) { return !self.r; });
  m.def("make_private_socket_dir", [](const std::string& tag) { return unwrap(make_private_socket_dir(tag)); },
        nb::arg("tag") = "stagelink");
  m.def("remove_private_socket_dir", &remove_private_socket_dir);
  m.def("registered_connectors", &registered_connectors);
  m.def("load_config_file", [](const std::string& path, uint64_t default_shm_threshold) {
    return config_dict(unwrap(load_transfer_config_file(path, default_shm_threshold)));
  }, nb::arg("path"), nb::arg("default_shm_threshold") = kDefaultShmThresholdBytes);
  m.def("load_config_string", [](const std::string& text, const std::string& source, uint64_t default_shm_threshold) {
    return config_dict(unwrap(load_transfer_config_string(text, source, default_shm_threshold)));
  }, nb::arg("text"), nb::arg("source"), nb::arg("default_shm_threshold") = kDefaultShmThresholdBytes);
  m.def("transfer_engine_port", [](int base, const std::string& purpose, int from_stage, int dp_index, int tp_size, int tp_rank) {
    PortPurpose p = purpose == "kv_transfer" ? PortPurpose::kv_transfer
                    : purpose == "orchestrator" ? PortPurpose::orchestrator
                    : purpose == "request_forwarding" ? PortPurpose::request_forwarding
                    : (throw nb::value_error("purpose must be request_forwarding, kv_transfer or orchestrator"), PortPurpose::kv_transfer);
    return transfer_engine_port(base, p, from_stage, dp_index, tp_size, tp_rank);
  }, nb::arg("base"), nb::arg("purpose"), nb::arg("from_stage"), nb::arg("dp_index") = 0, nb::arg("tp_size") = 1, nb::arg("tp_rank") = 0);
  m.def("shm_list", [](const std::string& dir) {
    nb::list l;
    for (auto& r : shm::list_resources(dir)) {
      nb::dict d;
      d["name"] = r.name; d["kind"] = r.kind; d["owner_pid"] = r.owner_pid; d["owner_alive"] = r.owner_alive;
      d["size"] = r.size; d["held"] = r.held; d["age_s"] = r.age_s; d["live_entries"] = r.live_entries;
      d["attached"] = r.attached;
      l.append(d);
    }
    return l;
  }, nb::arg("shm_dir") = "/dev/shm");
  m.def("shm_reap", [](const std::string& dir) { return shm::reap(dir); }, nb::arg("shm_dir") = "/dev/shm");
  m.def("shm_user_prefix", &shm::user_prefix);
  m.def("curve_keypair", [] {
    auto k = unwrap(curve_keypair());
    return nb::make_tuple(k.public_key, k.secret_key);
  }, "A fresh CurveZMQ key pair, (public_key, secret_key), each 40 Z85 characters.");
  m.def("bench_mq_cpp", [](uint64_t latency_msgs, uint64_t throughput_msgs, uint64_t bandwidth_msgs, uint64_t idle_msgs,
                           double idle_gap_s, nb::object progress) {
    bench::MqBenchOptions o{latency_msgs, throughput_msgs, bandwidth_msgs, idle_msgs, idle_gap_s};
    Value v;
    {
      nb::gil_scoped_release nogil;
      v = bench::bench_mq(o, [&](const std::string& msg) {
        nb::gil_scoped_acquire gil;
        if (!progress.is_none()) progress(msg);
      });
    }
    return to_py(v);
  });
  m.def("bench_relay_cpp", [](std::vector<size_t> sizes, int iters, const std::string& ns, nb::object progress) {
    Result<std::vector<bench::RelayRow>> rows = make_error(Errc::io, "");
    {
      nb::gil_scoped_release nogil;
      rows = bench::bench_relay(sizes, iters, ns, [&](const std::string& what) {
        nb::gil_scoped_acquire gil;
        if (!progress.is_none()) progress(what);
      });
    }
    nb::list l;
    for (auto& r : unwrap(std::move(rows))) {
      nb::dict d;
      d["size"] = r.size;
      d["rtt_copy"] = stat_dict(r.rtt_copy); d["rtt_view"] = stat_dict(r.rtt_view);
      d["rtt_zmq"] = stat_dict(r.rtt_zmq); d["memcpy"] = stat_dict(r.memcpy_);
      d["rtt_view_zmqctl"] = stat_dict(r.rtt_view_zmqctl);
      l.append(d);
    }
    return l;
  }, nb::arg("sizes"), nb::arg("iters"), nb::arg("ns"), nb::arg("progress").none());
  m.def("bench_shm_cpp", [](std::vector<size_t> sizes, int iters, const std::string& ns, size_t arena) {
    std::vector<bench::ShmRow> rows;
    {
      nb::gil_scoped_release nogil;
      rows = bench::bench_shm(sizes, iters, ns, arena);
    }
    nb::list l;
    for (auto& r : rows) {
      nb::dict d;
      d["size"] = r.size; d["iters"] = r.iters;
      d["put"] = stat_dict(r.put); d["get"] = stat_dict(r.get); d["get_view"] = stat_dict(r.get_view);
      d["get_into"] = stat_dict(r.get_into);
      d["roundtrip"] = stat_dict(r.roundtrip); d["memcpy"] = stat_dict(r.memcpy_);
      l.append(d);
    }
    return l;
  });
}
