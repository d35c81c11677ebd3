// torch tensors over DLPack (torch.hpp).
#include "python/torch.hpp"

#include "python/arrays.hpp"

namespace stagelink::py {

TorchRoutes g_torch_routes;

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


TorchApi* TorchApi::get(bool import) {
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
  return dl_to_torch(T, m, x);
}

// `m` handed to torch (which then owns it): through the exchange API (`x`), else a capsule. An
// invalid object (no error set) when torch refuses it.
nb::object dl_to_torch(const TorchApi& T, DlOut* m, bool x) {
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
  PyObject* out = capi::call1(T.from_dlpack, cap);
  Py_DECREF(cap);  // consumed: torch owns `m` now; else the capsule frees it
  if (!out) {  // e.g. a dtype this torch's DLPack import lacks
    PyErr_Clear();
    return {};
  }
  return nb::steal(out);
}

// Frame -> Python object: the tree with its tensors as numpy arrays, torch tensors or bytes-likes.

}  // namespace stagelink::py
