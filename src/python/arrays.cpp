// numpy arrays as typed tensors (arrays.hpp).
#include "python/arrays.hpp"

namespace stagelink::py {

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
nb::object tensor_array(const Tensor& t, bool zero_copy, bool owned) {
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


}  // namespace stagelink::py
