// What every translation unit of the binding shares: Python exceptions for stagelink's errors,
// timeout arguments and signal-aware waits without the GIL, Value <-> Python conversion, the views
// a put holds, and the constants of the Python payload path. The binding is split by concern:
//   convert.cpp   these helpers          arrays.cpp   numpy arrays as tensors
//   torch.cpp     torch over DLPack      codec.cpp    Python objects <-> frames (the payload codec)
//   bind_*.cpp    one file per facade (connector, queue, control, relay, config and tools)
//   module.cpp    the module: exceptions, then each bind_* in turn
// Everything here is called with the GIL held unless it says otherwise.
#pragma once
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// numpy's C API in several translation units: one table, imported by module.cpp.
#define PY_ARRAY_UNIQUE_SYMBOL stagelink_numpy_api
#ifndef STAGELINK_IMPORT_NUMPY
#define NO_IMPORT_ARRAY
#endif
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "core/host_pool.hpp"
#include "python/pyapi.hpp"
#include "stagelink/stagelink.hpp"

namespace nb = nanobind;

namespace stagelink::py {

// The exception classes raise() uses, by Errc (module.cpp makes them), and their base.
extern std::array<PyObject*, 16> g_exc;
extern PyObject* g_base_exc;  // stagelink.StagelinkError
[[noreturn]] void raise(const Error& e);
template <class T>
T unwrap(Result<T>&& r) {
  if (!r.ok()) raise(r.error());
  return std::move(r).value();
}


// A str's UTF-8 bytes (cached by CPython for ASCII strings: no encoding, no nanobind cast).
std::string utf8(PyObject* o);

// A timeout argument in seconds: None, infinity and 1e9 s or more wait for ever (-1); a negative one
// is one attempt (0); NaN is refused.
double timeout_secs(double v);
double timeout_arg(nb::handle t);
// A timeout argument for a call whose negative timeout means its own default: None -> `none_is`,
// infinity (1e9 s or more) -> 1e9 (for ever), NaN refused.
double timeout_or(nb::handle t, double none_is);

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

// A str from UTF-8 bytes; bytes that are not UTF-8 raise CorruptError.
nb::object py_str(std::string_view s);
// A dict key as a str, short keys from a cache of interned strs.
nb::object key_str(std::string_view k);
// A Value as Python objects (TensorRef leaves: `tensors`' objects, or None).
nb::object to_py(const Value& v, const std::vector<nb::object>* tensors = nullptr);
// Python objects as a Value (metadata, extra, config). `skip`: a value left out of a top-level dict
// (the inline bytes a get reads in place).
Value from_py(nb::handle h, int depth = 0, PyObject* skip = nullptr);

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

// A stage id (int or str) as the string the connectors key on.
std::string stage_str(nb::handle h);
// `request_id`: None, or the request a put is tied to (cleanup(request_id) frees it).
std::string rid_str(nb::handle rid);

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

// A region copied into a new bytes (0) or bytearray (1); large copies run without the GIL.
nb::object region_copy_as(const Tensor& t, int as);
// A region copied out: bytes (the pickle stream), else a bytearray, or for 1 MiB and more a uint8
// array in a pooled host buffer (pickle.loads rebuilds arrays and tensors over either).
nb::object region_copy(const Tensor& t, bool as_bytes);

}  // namespace stagelink::py
