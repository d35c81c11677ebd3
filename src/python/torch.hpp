// torch tensors over DLPack, the exchange ABI array libraries share: DLPack 1.x's C exchange API
// where torch has it (2.10 and later), legacy "dltensor" capsules or the numpy route where not.
#pragma once
#include "python/common.hpp"
#include "cuda/driver.hpp"

namespace stagelink::py {

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
constexpr int32_t kDlCpu = 1, kDlCuda = 2;
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

// DLPack's type of `d`: code, bits, lanes.
DlType dl_type(DType d);
// The DType of a DLPack type; nullopt for the ones frames do not carry.
std::optional<DType> dtype_of_dl(nb::dlpack::dtype t);
// A capsule torch never consumed frees its tensor here.
void dl_capsule_free(PyObject* cap);

// Which of torch's routes tensors may take (all of them, but in tests that check the routes an
// older torch leaves: no exchange API (before 2.10), no DLPack import of some dtypes).
struct TorchRoutes {
  bool exchange_api = true, dlpack = true;
};
extern TorchRoutes g_torch_routes;

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
  static TorchApi* get(bool import);
};


// This process's GPUs as the CUDA driver sees them (empty without one), read once.
const std::vector<cuda::DeviceInfo>& local_gpus();
// "cuda:N" -> the UUID of that device here ("" when unknown).
std::string gpu_uuid_of(const std::string& dev);
// The device here holding `uuid` as "cuda:N" ("" when this process has no such GPU).
std::string gpu_by_uuid(const std::string& uuid);
// A received tensor as a torch tensor through DLPack: a view of `t`'s memory held by its keepalive
// (`view`), else a copy. An invalid object (no error set) when this torch cannot import it so.
nb::object torch_via_dlpack(const TorchApi& T, const Tensor& t, const Dims& dims, bool view);
// `m` handed to torch, which then owns it: through the exchange API (`x`), else a DLPack capsule.
// An invalid object (no error set) when torch refuses it.
nb::object dl_to_torch(const TorchApi& T, DlOut* m, bool x);

}  // namespace stagelink::py
