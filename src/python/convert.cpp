// The binding's shared helpers (common.hpp): errors, timeouts, Value <-> Python, region copies.
#include "python/common.hpp"

#include "python/arrays.hpp"

namespace stagelink::py {

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

// A str's UTF-8 bytes (cached by CPython for ASCII strings: no encoding, no nanobind cast).
std::string utf8(PyObject* o) {
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(o, &n);
  if (!s) throw nb::python_error();
  return std::string(s, size_t(n));
}

// ---- timeouts and waits ----
double timeout_secs(double v) {
  if (v != v) raise(make_error(Errc::invalid_argument, "timeout must be a number of seconds or None, not NaN"));
  return v >= 1e9 ? -1.0 : std::max(0.0, v);
}
double timeout_arg(nb::handle t) { return t.is_none() ? -1.0 : timeout_secs(nb::cast<double>(t)); }
double timeout_or(nb::handle t, double none_is) {
  if (t.is_none()) return none_is;
  const double v = timeout_secs(nb::cast<double>(t));
  return v < 0 ? 1e9 : v;
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
Value from_py(nb::handle h, int depth, PyObject* skip) {
  if (depth > 64) throw nb::value_error("metadata nested deeper than 64");
  if (h.is_none()) return Value();
  if (PyBool_Check(h.ptr())) return Value(h.ptr() == Py_True);
  if (PyLong_Check(h.ptr())) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow > 0) {
      const unsigned long long u = PyLong_AsUnsignedLongLong(h.ptr());
      if (u == (unsigned long long)-1 && PyErr_Occurred()) {  // 2^64 or more: no msgpack integer holds it
        PyErr_Clear();
        raise(make_error(Errc::invalid_argument, "an integer of 2^64 or more cannot travel in metadata"));
      }
      return Value(uint64_t(u));
    }
    if (overflow < 0) raise(make_error(Errc::invalid_argument, "an integer below -2^63 cannot travel in metadata"));
    return Value(int64_t(v));
  }
  if (PyFloat_Check(h.ptr())) return Value(PyFloat_AsDouble(h.ptr()));
  if (PyUnicode_Check(h.ptr())) return Value(utf8(h.ptr()));
  if (PyBytes_Check(h.ptr())) {
    auto* p = reinterpret_cast<const std::byte*>(capi::bytes_data(h.ptr()));
    return Value::copy_bytes(std::span<const std::byte>(p, size_t(capi::bytes_size(h.ptr()))));
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


// A region copied into a new bytes (0) or bytearray (1); large copies run without the GIL.
nb::object region_copy_as(const Tensor& t, int as) {
  const Py_ssize_t n = Py_ssize_t(t.nbytes());
  PyObject* o = as == 0 ? PyBytes_FromStringAndSize(nullptr, n) : PyByteArray_FromStringAndSize(nullptr, n);
  if (!o) throw nb::python_error();
  char* dst = as == 0 ? capi::bytes_data(o) : capi::bytearray_data(o);
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


std::string rid_str(nb::handle rid) {
  if (rid.is_none()) return {};
  if (PyUnicode_Check(rid.ptr())) return utf8(rid.ptr());
  return nb::cast<std::string>(nb::str(rid));
}

}  // namespace stagelink::py
