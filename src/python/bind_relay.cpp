// The relay (`_Relay`, `_RelayOp`).
#include "python/bindings.hpp"

#include "python/arrays.hpp"
#include "python/codec.hpp"

namespace stagelink::py {

namespace {

// ---- Relay ----
// shared_ptr: a put or get blocked with the GIL released keeps the relay alive if another thread
// closes it (close ends that wait with `closed`).
struct PyRelay {
  std::shared_ptr<Relay> r;
  bool allow_pickle = true;
  // Whether its payloads come within this host (RelayConfig::host_local, read once): only such a
  // path may bring CUDA device records.
  bool host_local = false;
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
                                  std::string& rid_holder, const std::string& traceparent) {
  rid_holder = rid_str(rid);
  RelayPutOptions o;
  o.request_id = rid_holder;
  o.traceparent = traceparent;
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
  const Py_ssize_t n = capi::seq_size(seq.ptr());
  bv.views.reserve(size_t(n));
  const capi::SeqItems items(seq.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!PyTuple_Check(item) || capi::tuple_size(item) != 2)
      throw nb::type_error("put_segments: each segment is an (offset, buffer) pair");
    const long long off = PyLong_AsLongLong(capi::tuple_item(item, 0));
    if (off == -1 && PyErr_Occurred()) throw nb::python_error();
    if (off < 0) raise(make_error(Errc::invalid_argument, "put_segments: a negative offset"));
    Py_buffer v;
    if (PyObject_GetBuffer(capi::tuple_item(item, 1), &v, PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
    bv.views.push_back(v);
    segs.push_back({size_t(off), std::span<const std::byte>(static_cast<const std::byte*>(v.buf), size_t(v.len))});
  }
  return relay_put_with(self, o, [&](Relay& r, const RelayPutOptions& opts) { return r.put_segments(segs, total, opts); });
}

// Native frames for arrays, tensors, bytes and trees; None when the object needs pickling (the
// Python side then calls _put_parts).
nb::object relay_put_obj(PyRelay& self, nb::handle data, nb::handle rid, nb::handle dst_rank, const std::string& edge,
                         uint32_t readers, const std::string& traceparent) {
  Payload p;
  BufferViews bv;
  DeviceStaging ds;  // CUDA tensors left on their GPU where the relay's connector keeps device slots
  ds.arena_bytes = self.get()->device_slots();
  if (!array_payload(data, bv, p, true)) {
    if (!encode_py(data, p, bv, -1, &ds).ok) return nb::none();
  }
  std::string rh;
  RelayPutOptions o = relay_put_options(rid, dst_rank, edge, readers, rh, traceparent);
  if ((o.hold = ds.hold())) o.data_bytes = p.tensor_bytes() - ds.record_bytes + ds.device_bytes;
  return nb::cast(relay_put_payload(self, p, o));
}

// The local backend: `data` itself, by reference (no frame), as the seed's LOCAL_OBJECT. The
// relay drops its reference outside its locks, on whatever thread lets go last: the deleter takes
// the GIL (and leaks the object once the interpreter is finalizing).
nb::object relay_put_ref(PyRelay& self, nb::handle data, nb::handle rid, nb::handle dst_rank, const std::string& edge,
                         uint32_t readers, size_t nbytes, const std::string& traceparent) {
  std::string rh;
  RelayPutOptions o = relay_put_options(rid, dst_rank, edge, readers, rh, traceparent);
  Py_INCREF(data.ptr());
  o.object = std::shared_ptr<const void>(data.ptr(), [](const void* p) {
    if (!Py_IsInitialized()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF(static_cast<PyObject*>(const_cast<void*>(p)));
    PyGILState_Release(g);
  });
  o.object_bytes = nbytes;
  return nb::cast(relay_put_with(self, o, [&](Relay& r, const RelayPutOptions& opts) { return r.put_async(Payload{}, opts); }));
}

RelayGetOptions relay_get_options(nb::handle rid, nb::handle timeout, bool zero_copy, std::string& rid_holder,
                                  const std::string& traceparent) {
  rid_holder = rid_str(rid);
  RelayGetOptions o;
  o.request_id = rid_holder;
  o.traceparent = traceparent;
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


}  // namespace

void bind_relay(nb::module_& m) {
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
             new (self) PyRelay{std::shared_ptr<Relay>(unwrap(Relay::create(c))), allow_pickle, c.host_local()};
           }, nb::arg("config").none(), nb::arg("allow_pickle") = true)
      .def("_put_obj", &relay_put_obj, nb::arg("data").none(), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"), nb::arg("traceparent") = "")
      .def("_put_ref", &relay_put_ref, nb::arg("data").none(), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"), nb::arg("nbytes"), nb::arg("traceparent") = "")
      .def("_put_parts", [](PyRelay& self, int kind, nb::list regions, nb::handle rid, nb::handle dst_rank,
                            const std::string& edge, uint32_t readers, const std::string& tp) {
             Payload p;
             BufferViews bv;
             payload_from_parts(kind, regions, bv, p);
             std::string rh;
             return relay_put_payload(self, p, relay_put_options(rid, dst_rank, edge, readers, rh, tp));
           }, nb::arg("kind"), nb::arg("regions"), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"), nb::arg("traceparent") = "")
      .def("_put_segments", [](PyRelay& self, nb::handle segments, size_t total, nb::handle rid, nb::handle dst_rank,
                               const std::string& edge, uint32_t readers, const std::string& tp) {
             std::string rh;
             return relay_put_segments(self, segments, total, relay_put_options(rid, dst_rank, edge, readers, rh, tp));
           }, nb::arg("segments"), nb::arg("total"), nb::arg("request_id").none(), nb::arg("dst_rank").none(),
           nb::arg("edge"), nb::arg("readers"), nb::arg("traceparent") = "")
      .def("_get_found", [](PyRelay& self, nb::handle metadata, nb::handle rid, nb::handle timeout, bool zero_copy,
                            const std::string& tp) {
             std::string rh;
             // Always views (the slot held until `g` goes): a copying get copies each region once,
             // into its Python object (found_of), or not at all where the transport landed the
             // payload in memory it then owns (private_ok). A copying get at the connector too
             // copied every payload twice.
             RelayGetOptions o = relay_get_options(rid, timeout, true, rh, tp);
             o.private_ok = !zero_copy;
             RelayOp op = relay_get(self, metadata, o);
             if (const auto& obj = op.object())  // a local put's object, by reference
               return nb::make_tuple(KIND_OBJECT, nb::borrow(static_cast<PyObject*>(const_cast<void*>(obj.get()))), op.size());
             GetResult g{std::move(op.payload()), op.size(), op.owned()};
             Found f = found_of(g, zero_copy, self.allow_pickle, "relay payload", self.host_local);
             return nb::make_tuple(f.kind, f.obj, f.size);
           }, nb::arg("metadata").none(), nb::arg("request_id").none(), nb::arg("timeout").none(), nb::arg("zero_copy"),
           nb::arg("traceparent") = "")
      .def("_get_into", [](PyRelay& self, nb::handle metadata, nb::handle out, nb::handle rid, nb::handle timeout,
                           const std::string& tp) {
             Py_buffer view;
             if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
             BufferViews hold;
             hold.views.push_back(view);
             std::string rh;
             RelayGetOptions o = relay_get_options(rid, timeout, false, rh, tp);
             o.dest = std::span<std::byte>(static_cast<std::byte*>(view.buf), size_t(view.len));
             return relay_get(self, metadata, o).size();
           }, nb::arg("metadata").none(), nb::arg("out"), nb::arg("request_id").none(), nb::arg("timeout").none(),
           nb::arg("traceparent") = "")
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
}

}  // namespace stagelink::py
