// The control plane: messages, inboxes and outboxes; CURVE keys from Python dicts.
#include "python/bindings.hpp"

#include "core/curve_config.hpp"

namespace stagelink::py {

// ---- control plane ----
ControlMessage control_from_args(const std::string& type, const std::string& rid, const std::string& from,
                                 const std::string& to, nb::handle metadata, nb::handle chunk_id, bool is_done,
                                 const std::string& error, nb::handle body, const std::string& traceparent) {
  ControlMessage c;
  c.traceparent = traceparent;
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
  d["traceparent"] = opt_str(c.traceparent);
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
  for (Py_ssize_t i = 0; i < capi::list_size(a); ++i) {
    PyObject* k = capi::list_item(a, i);
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


void bind_control(nb::module_& m) {
  m.def("control_encode", [](const std::string& type, const std::string& rid, const std::string& from,
                             const std::string& to, nb::handle metadata, nb::handle chunk_id, bool is_done,
                             const std::string& error, nb::handle body, const std::string& traceparent) {
    auto out = unwrap(encode_control(control_from_args(type, rid, from, to, metadata, chunk_id, is_done, error, body,
                                                       traceparent)));
    return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size());
  }, nb::arg("type"), nb::arg("request_id"), nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("metadata").none(),
     nb::arg("chunk_id").none(), nb::arg("is_done"), nb::arg("error"), nb::arg("body").none(),
     nb::arg("traceparent") = "");
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
                      const std::string& error, nb::handle body, nb::handle timeout, const std::string& traceparent) {
             const ControlMessage c =
                 control_from_args(type, rid, from, to, metadata, chunk_id, is_done, error, body, traceparent);
             const double t = timeout_arg(timeout);
             auto out = self.get();
             check_sliced(t, [&](double slice) { return out->send(c, slice); });
           }, nb::arg("type"), nb::arg("request_id"), nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("metadata").none(),
           nb::arg("chunk_id").none(), nb::arg("is_done"), nb::arg("error"), nb::arg("body").none(), nb::arg("timeout").none(),
           nb::arg("traceparent") = "")
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
}

}  // namespace stagelink::py
