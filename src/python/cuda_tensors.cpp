// CUDA tensors left on their GPU (cuda_tensors.hpp).
#include "python/cuda_tensors.hpp"

#include "cuda/arena.hpp"

namespace stagelink::py {
namespace {

// The stream torch's next work on device `ordinal` goes to, in this thread: the producer's copy
// is ordered after the kernels that wrote the tensor, and the reader's work after the copy.
cuda::CUstream current_stream(const TorchApi& T, int ordinal) {
  static bool torch_cuda_ready = false;  // the first call goes through Python: it initializes torch's CUDA
  if (torch_cuda_ready && T.xapi && T.xapi->current_work_stream) {
    void* s = nullptr;
    if (T.xapi->current_work_stream(kDlCuda, ordinal, &s) == 0) return static_cast<cuda::CUstream>(s);
    PyErr_Clear();
  }
  nb::object torch = nb::module_::import_("torch");
  nb::object s = torch.attr("cuda").attr("current_stream")(ordinal).attr("cuda_stream");
  torch_cuda_ready = true;
  return reinterpret_cast<cuda::CUstream>(nb::cast<uintptr_t>(s));
}

void check(const Status& s) {
  if (!s.ok()) raise(s.error());
}

// A view's keepalive: when torch drops the view, the reader's claim on the entry is released once
// the work queued on its stream so far has finished (the producer reuses the slot only then).
// Made in place only: a copied temporary's destructor would release the claim at once.
struct ViewRelease {
  ViewRelease(int o, cuda::CUstream s, std::shared_ptr<const void> c) : ordinal(o), stream(s), claim(std::move(c)) {}
  ViewRelease(const ViewRelease&) = delete;
  ViewRelease& operator=(const ViewRelease&) = delete;
  int ordinal;
  cuda::CUstream stream;
  std::shared_ptr<const void> claim;
  ~ViewRelease() {
    if (claim) cuda::DeviceImports::instance().release_after(ordinal, stream, std::move(claim));
  }
};

}  // namespace

void stage_cuda_tensor(const TorchApi& T, int ordinal, const void* ptr, size_t nbytes, DType dtype,
                       const std::vector<int64_t>& shape, DeviceStaging& ds, Tensor& x) {
  cuda::DeviceRef ref;
  ref.dtype = dtype;
  ref.shape = shape;
  const cuda::CUstream stream = current_stream(T, ordinal);
  auto hold = cuda::DeviceArenas::instance().stage(ordinal, cuda::CUdeviceptr(reinterpret_cast<uintptr_t>(ptr)),
                                                   nbytes, stream, ds.arena_bytes, ref);
  if (!hold.ok()) raise(hold.error());
  ds.holds.push_back(std::move(hold).value());
  const std::vector<std::byte> rec = cuda::encode_ref(ref);
  ds.device_bytes += nbytes;
  ds.record_bytes += rec.size();
  x = Tensor::copy_of(rec, DType::u8, {int64_t(rec.size())});
}

nb::object staged_on_host(const nb::object& t) {
  if (nb::cast<bool>(t.attr("is_cuda"))) {
    try {
      nb::object torch = nb::module_::import_("torch");
      nb::object host = torch.attr("empty")(t.attr("shape"), nb::arg("dtype") = t.attr("dtype"), nb::arg("pin_memory") = true);
      host.attr("copy_")(t);  // waits for the copy (not non_blocking): the frame is written next
      return host;
    } catch (nb::python_error& e) {
      if (e.matches(PyExc_KeyboardInterrupt)) throw;  // else (no pinned memory left, ...): the pageable route
    }
  }
  nb::object h = nb::steal(PyObject_CallMethod(t.ptr(), "cpu", nullptr));
  if (!h.is_valid()) throw nb::python_error();
  return h;
}

nb::object tensor_from_ref(const TorchApi& T, const Tensor& t, bool view) {
  auto r = cuda::decode_ref(t.data);
  if (!r.ok()) raise(r.error());
  const cuda::DeviceRef& ref = r.value();
  std::vector<cuda::CUuuid> local;
  for (auto& g : local_gpus()) local.push_back(g.raw);
  const cuda::Reachability reach = cuda::reachability(ref.gpu, local, -1, nullptr);
  if (reach.how == cuda::Reach::unreachable)
    raise(make_error(Errc::unsupported,
                     "a CUDA tensor left on " + cuda::uuid_string(ref.gpu) + " by process " + std::to_string(ref.pid) +
                         ", a GPU this process does not see (another host, or hidden by CUDA_VISIBLE_DEVICES): "
                         "put it with extra.cuda_ipc false to stage it through host memory"));
  const int ordinal = reach.ordinal;
  if (ref.shape.size() > size_t(kMaxDlDims)) raise(make_error(Errc::corrupt, "device tensor of too many dimensions"));
  const std::string* w = DeviceWish::wished();
  const std::string wish = w ? *w : std::string();
  const bool to_host = wish == "cpu";
  const std::string here = "cuda:" + std::to_string(ordinal);
  if (!wish.empty() && !to_host && wish != here) {  // another device: read here, then torch's copy there
    DeviceWish stay(here);
    nb::object got = tensor_from_ref(T, t, false);
    return got.attr("to")(wish);
  }
  if (to_host || !t.keepalive) view = false;  // a view needs something holding the slot
  const cuda::CUstream stream = current_stream(T, ordinal);
  auto m = cuda::DeviceImports::instance().open(ref, ordinal);
  if (!m.ok()) raise(m.error());
  check(cuda::DeviceImports::instance().wait_ready(*m, stream));
  auto& imports = cuda::DeviceImports::instance();
  if (view) {
    DlOut* o = DlOut::make(0, nullptr);
    o->keep = std::make_shared<ViewRelease>(ordinal, stream, t.keepalive);
    npy_intp dims[kMaxDlDims];
    for (size_t i = 0; i < ref.shape.size(); ++i) dims[i] = npy_intp(ref.shape[i]);
    o->describe(reinterpret_cast<std::byte*>(uintptr_t(m->ptr)), int(ref.shape.size()), dims, dl_type(ref.dtype));
    o->legacy.dl.device = {kDlCuda, ordinal};
    o->versioned.dl_tensor.device = {kDlCuda, ordinal};
    const bool x = g_torch_routes.exchange_api && T.xapi && (T.xapi_dtypes >> int(ref.dtype) & 1u);
    nb::object out = dl_to_torch(T, o, x);
    if (!out.is_valid())
      raise(make_error(Errc::unsupported, std::string("this torch cannot import a CUDA tensor of ") + dtype_name(ref.dtype)));
    return out;
  }
  // A copy: a fresh tensor from torch's allocator, filled on the reader's stream.
  PyObject* dtype_obj = nullptr;
  for (auto& [o, d] : T.dtypes)
    if (d == ref.dtype) dtype_obj = o;
  if (!dtype_obj)
    raise(make_error(Errc::unsupported, std::string("a torch tensor of ") + dtype_name(ref.dtype) + ", which this torch does not have"));
  nb::list shape;
  for (int64_t d : ref.shape) shape.append(d);
  nb::object torch = nb::module_::import_("torch");
  nb::object out = torch.attr("empty")(nb::tuple(shape), nb::arg("dtype") = nb::handle(dtype_obj),
                                       nb::arg("device") = to_host ? std::string("cpu") : here);
  if (ref.nbytes) {
    const uintptr_t dst = nb::cast<uintptr_t>(out.attr("data_ptr")());
    auto d = cuda::driver();
    if (!d.ok()) raise(d.error());
    check(cuda::use_device(ordinal));
    if (to_host) {  // the caller reads it on the host at once: copied and waited for here
      check(cuda::check((*d)->cuMemcpyDtoHAsync(reinterpret_cast<void*>(dst), m->ptr, ref.nbytes, stream), "cuMemcpyDtoHAsync"));
      Status synced;
      {
        nb::gil_scoped_release nogil;
        synced = cuda::check((*d)->cuStreamSynchronize(stream), "cuStreamSynchronize");
      }
      check(synced);
    } else {
      check(cuda::check((*d)->cuMemcpyDtoDAsync(dst, m->ptr, ref.nbytes, stream), "cuMemcpyDtoDAsync"));
    }
  }
  if (t.keepalive) {
    imports.release_after(ordinal, stream, t.keepalive);
  } else if (ref.nbytes && !to_host) {
    // Read in place with nothing to hold (a queue's chunk is released when this returns): the
    // copy out of the slot is finished before the message counts as read.
    auto d = cuda::driver();
    Status synced;
    {
      nb::gil_scoped_release nogil;
      synced = cuda::check((*d)->cuStreamSynchronize(stream), "cuStreamSynchronize");
    }
    check(synced);
  }
  return out;
}

}  // namespace stagelink::py
