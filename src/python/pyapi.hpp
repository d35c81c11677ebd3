// The CPython calls the binding makes that have a faster form outside the limited API. The wheel
// for CPython 3.12 and later is built against the stable ABI (abi3: one wheel for every later
// CPython), where nanobind's STABLE_ABI defines Py_LIMITED_API and the macros that read objects'
// insides (PyTuple_GET_ITEM, PyBytes_AS_STRING, a list's item array) do not exist. Each helper here
// is the macro in a version-specific build (CPython 3.10 and 3.11, and every developer build) and
// the limited API's function in an abi3 one: one source, both builds, and no cost to the former.
#pragma once
#include <Python.h>

#include <string>

namespace stagelink::py::capi {

#ifdef Py_LIMITED_API
inline constexpr bool kStableAbi = true;
inline char* bytes_data(PyObject* o) { return PyBytes_AsString(o); }
inline Py_ssize_t bytes_size(PyObject* o) { return PyBytes_Size(o); }
inline char* bytearray_data(PyObject* o) { return PyByteArray_AsString(o); }
inline double float_value(PyObject* o) { return PyFloat_AsDouble(o); }
inline Py_ssize_t dict_size(PyObject* o) { return PyDict_Size(o); }
inline Py_ssize_t list_size(PyObject* o) { return PyList_Size(o); }
// The size of an exact list or tuple (what PySequence_Fast returns).
inline Py_ssize_t seq_size(PyObject* o) { return PyList_CheckExact(o) ? PyList_Size(o) : PyTuple_Size(o); }
inline Py_ssize_t tuple_size(PyObject* o) { return PyTuple_Size(o); }
inline PyObject* tuple_item(PyObject* o, Py_ssize_t i) { return PyTuple_GetItem(o, i); }
inline PyObject* list_item(PyObject* o, Py_ssize_t i) { return PyList_GetItem(o, i); }
inline PyObject* call1(PyObject* f, PyObject* a) { return PyObject_CallFunctionObjArgs(f, a, nullptr); }
inline PyObject* call_method0(PyObject* o, PyObject* name) { return PyObject_CallMethodObjArgs(o, name, nullptr); }
inline std::string type_name(PyObject* o) {
  PyObject* n = PyType_GetName(Py_TYPE(o));
  std::string s = "object";
  if (n) {
    if (const char* u = PyUnicode_AsUTF8AndSize(n, nullptr)) s = u;
    Py_DECREF(n);
  }
  PyErr_Clear();
  return s;
}

// The items of an exact list or tuple, read by index (borrowed references).
class SeqItems {
 public:
  explicit SeqItems(PyObject* seq) : seq_(seq), list_(PyList_CheckExact(seq)) {}
  PyObject* operator[](Py_ssize_t i) const { return list_ ? PyList_GetItem(seq_, i) : PyTuple_GetItem(seq_, i); }
  // Whether a list being read was resized meanwhile (a reader by index cannot be left dangling:
  // only the size is checked).
  bool changed(PyObject* seq, Py_ssize_t n) const { return list_ && PyList_Size(seq) != n; }

 private:
  PyObject* seq_;
  bool list_;
};

// The item slots of a new list or tuple, each set once with a new reference (stolen).
class NewItems {
 public:
  NewItems(PyObject* seq, bool tuple) : seq_(seq), tuple_(tuple) {}
  void set(Py_ssize_t i, PyObject* item) const {
    if (tuple_) PyTuple_SetItem(seq_, i, item);
    else PyList_SetItem(seq_, i, item);
  }

 private:
  PyObject* seq_;
  bool tuple_;
};
#else
inline constexpr bool kStableAbi = false;
inline char* bytes_data(PyObject* o) { return PyBytes_AS_STRING(o); }
inline Py_ssize_t bytes_size(PyObject* o) { return PyBytes_GET_SIZE(o); }
inline char* bytearray_data(PyObject* o) { return PyByteArray_AS_STRING(o); }
inline double float_value(PyObject* o) { return PyFloat_AS_DOUBLE(o); }
inline Py_ssize_t dict_size(PyObject* o) { return PyDict_GET_SIZE(o); }
inline Py_ssize_t list_size(PyObject* o) { return PyList_GET_SIZE(o); }
inline Py_ssize_t seq_size(PyObject* o) { return PySequence_Fast_GET_SIZE(o); }
inline Py_ssize_t tuple_size(PyObject* o) { return PyTuple_GET_SIZE(o); }
inline PyObject* tuple_item(PyObject* o, Py_ssize_t i) { return PyTuple_GET_ITEM(o, i); }
inline PyObject* list_item(PyObject* o, Py_ssize_t i) { return PyList_GET_ITEM(o, i); }
inline PyObject* call1(PyObject* f, PyObject* a) { return PyObject_CallOneArg(f, a); }
inline PyObject* call_method0(PyObject* o, PyObject* name) { return PyObject_CallMethodNoArgs(o, name); }
inline std::string type_name(PyObject* o) { return Py_TYPE(o)->tp_name; }

class SeqItems {
 public:
  explicit SeqItems(PyObject* seq) : items_(PySequence_Fast_ITEMS(seq)) {}
  PyObject* operator[](Py_ssize_t i) const { return items_[i]; }
  // Whether a list being read was resized or its items moved meanwhile (the array read here
  // would then be freed memory).
  bool changed(PyObject* seq, Py_ssize_t n) const {
    return PyList_CheckExact(seq) && (PyList_GET_SIZE(seq) != n || PySequence_Fast_ITEMS(seq) != items_);
  }

 private:
  PyObject** items_;
};

class NewItems {
 public:
  NewItems(PyObject* seq, bool tuple)
      : items_(tuple ? reinterpret_cast<PyTupleObject*>(seq)->ob_item : reinterpret_cast<PyListObject*>(seq)->ob_item) {}
  void set(Py_ssize_t i, PyObject* item) const { items_[i] = item; }

 private:
  PyObject** items_;
};
#endif

}  // namespace stagelink::py::capi
