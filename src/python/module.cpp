// stagelink._core: the thin binding. Argument conversion only; semantics live in C++. This file
// makes the module: numpy's C API, the exception classes, then each facade (bindings.hpp).
#define STAGELINK_IMPORT_NUMPY
#include "python/bindings.hpp"

using namespace stagelink;
using namespace stagelink::py;

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


  bind_connector(m);
  bind_mq(m);
  bind_tools(m);
  bind_control(m);
  bind_relay(m);
}
