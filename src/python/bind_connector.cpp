// The connectors: stagelink.Connector's native base `_Connector` (put and get run here, without
// a Python frame) and `_Loan`.
#include "python/bindings.hpp"

#include "connectors/capabilities.hpp"

#include "python/arrays.hpp"
#include "shm/directory.hpp"
#include "python/codec.hpp"

namespace stagelink::py {

namespace {

struct PyLoan {
  Loan loan;
  nb::object region(size_t i) {
    auto s = loan.region(i);
    if (!loan.valid() || i >= loan.tensor_count()) throw nb::index_error("loan region out of range or loan already published");
    size_t shape[1] = {s.size()};
    return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(reinterpret_cast<uint8_t*>(s.data()), 1, shape, nb::handle()),
                    nb::rv_policy::reference);
  }
};

struct PyConnector {
  // shared: a call running without the GIL holds its own reference, so a close() from another
  // thread never destroys the connector under it (the call then ends with closed/cancelled).
  std::shared_ptr<Connector> c;
  bool allow_pickle = true;  // extra.allow_pickle: refuse frames holding a pickle when false
  // A connector whose calls wait on a network (store, transfer engine): every call runs without
  // the GIL, however small, so the process's other Python threads run during its round trips.
  // Shared memory's calls take microseconds and keep it below kGilReleaseBytes.
  bool networked = false;
  // The metadata fields this connector lets a binding read in place (BindingFields: the shared
  // memory connector's inline frame and direct-lookup fields), as interned strs; null: none.
  PyObject* inline_field = nullptr;
  PyObject* lookup_field = nullptr;
  // BindingFields::device_slots(): each device arena's size when CUDA tensors may stay on their
  // GPU (the put keeps their slots with its entry); 0: they are staged through host memory.
  size_t device_slots = 0;
  // `last_error`: why the last put or get failed or found nothing (None after one that worked).
  // Held here, not in the instance dict, so a successful call clears it with a pointer test.
  nb::object last_error = nb::none();
  void succeeded() {
    if (!last_error.is_none()) [[unlikely]] last_error = nb::none();
  }
  std::shared_ptr<Connector> get() {
    if (!c) raise(make_error(Errc::closed, "connector is closed"));
    return c;
  }
};

// The connector's Lending, or UnsupportedError naming it (a connector that lends nothing).
Lending& lending(PyConnector& self) {
  const std::shared_ptr<Connector>& c = self.get();
  auto* l = c->capability<Lending>();
  if (!l) raise(make_error(Errc::unsupported, c->name() + " does not lend buffers"));
  return *l;
}

// `last_error` may hold an exception whose traceback reaches the connector (strict mode raises
// it): the cycle goes through this native field, so the collector must see it.
int connector_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  Py_VISIT(nb::inst_ptr<PyConnector>(self)->last_error.ptr());
  return 0;
}
int connector_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<PyConnector>(self)->last_error = nb::none();
  return 0;
}
PyType_Slot g_connector_slots[] = {{Py_tp_traverse, (void*)connector_traverse},
                                   {Py_tp_clear, (void*)connector_clear},
                                   {0, nullptr}};

// Why the last get on this thread returned nothing (not put yet, timed out, consumed, cancelled):
// set by borrow() where it returns nullopt, read by the caller to fill `last_error`.
thread_local Error t_miss;

// The exception object of `e` (the class raise() would raise), not raised.
nb::object exception_of(const Error& e) {
  PyObject* t = g_exc[static_cast<size_t>(e.code)];
  nb::object msg = nb::steal(PyUnicode_DecodeUTF8(e.message.data(), Py_ssize_t(e.message.size()), "replace"));
  if (!msg.is_valid()) throw nb::python_error();
  nb::object exc = nb::steal(capi::call1(t ? t : PyExc_RuntimeError, msg.ptr()));
  if (!exc.is_valid()) throw nb::python_error();
  return exc;
}

// A field name a connector's BindingFields gives, as an interned str kept for the interpreter's
// life (few: one per distinct name).
PyObject* field_str(std::string_view f) {
  if (f.empty()) return nullptr;
  static std::vector<std::pair<std::string, PyObject*>> made;  // under the GIL
  for (auto& [name, s] : made)
    if (name == f) return s;
  PyObject* s = PyUnicode_FromStringAndSize(f.data(), Py_ssize_t(f.size()));
  if (!s) throw nb::python_error();
  PyUnicode_InternInPlace(&s);
  made.emplace_back(std::string(f), s);
  return s;
}

// A put from Python: its size and its metadata as a dict.
struct PyPut {
  size_t size = 0;
  nb::object metadata;
};

PyPut put_payload(PyConnector& self, nb::handle from, nb::handle to, const std::string& key, const Payload& p,
                  size_t total, uint32_t readers, nb::handle request_id, DeviceStaging* ds) {
  std::string f = stage_str(from), t = stage_str(to);
  const std::string rid = rid_str(request_id);
  const std::shared_ptr<Connector> keep = self.get();  // raises ClosedError: must run while holding the GIL
  Connector& conn = *keep;
  Result<PutResult> r = make_error(Errc::io, "");
  // An inline frame becomes the metadata's bytes straight from the arena (PutHooks::inline_sink),
  // where this thread keeps the GIL through the put; else the connector copies it into the Value.
  // The sink captures one pointer: it fits std::function's own storage (no allocation per put).
  struct {
    nb::object bytes;
    bool failed = false;  // out of memory: raised below (the put is published)
  } inline_out;
  nb::object& inl = inline_out.bytes;
  PutHooks hooks;
  if (ds) hooks.hold = ds->hold();  // device slots: kept with the entry until its readers are done
  if (total > kGilReleaseBytes || self.networked || !self.inline_field) {  // the caller pinned the memory for this
    PutOptions po{readers, rid};
    if (hooks.hold) po.hooks = &hooks;
    nb::gil_scoped_release nogil;
    r = conn.put(f, t, key, p, po);
  } else {
    hooks.inline_sink = [out = &inline_out](std::span<const std::byte> frame) {
      out->bytes = nb::steal(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(frame.data()), Py_ssize_t(frame.size())));
      out->failed = !out->bytes.is_valid();
    };
    PutOptions po{readers, rid};
    po.hooks = &hooks;
    r = conn.put(f, t, key, p, po);
  }
  if (inline_out.failed) throw nb::python_error();
  PutResult pr = unwrap(std::move(r));
  PyPut out{pr.size, to_py(pr.metadata)};
  if (inl.is_valid() && PyDict_SetItem(out.metadata.ptr(), self.inline_field, inl.ptr()) != 0) throw nb::python_error();
  return out;
}

// Failures the vLLM-Omni contract reports (through the subclass's `_fail`: logged and kept in
// `last_error`, raised in strict mode) instead of raising: stagelink's errors and bad arguments.
// Anything else propagates.
void report_or_rethrow(nb::handle self, const char* op, nb::python_error& e) {
  if (!e.matches(g_base_exc) && !e.matches(PyExc_TypeError) && !e.matches(PyExc_ValueError) &&
      !e.matches(PyExc_BufferError))
    throw;
  self.attr("_fail")(op, e.value());
}

// Python's `Connector.put`: numpy arrays, torch tensors, bytes-likes and trees of them go straight
// through C++ as native frames (no Python frame, no pickle); anything else (a Loan, an object to
// pickle) through the subclass's `_put_slow`. Failures follow the contract: logged by `_fail` and
// returned as (False, 0, None), or raised in strict mode.
nb::object connector_put(nb::handle self_h, nb::handle from, nb::handle to, nb::handle key, nb::handle data,
                         nb::handle readers, nb::handle request_id) {
  try {
    uint32_t rd = 0;
    if (!readers.is_none()) {
      const long v = PyLong_AsLong(readers.ptr());
      if (v == -1 && PyErr_Occurred()) throw nb::python_error();
      if (v < 0 || v > long(UINT32_MAX)) raise(make_error(Errc::invalid_argument, "readers must be in [1, 8]"));
      rd = uint32_t(v);
    }
    if (!PyUnicode_Check(key.ptr())) {
      PyErr_SetString(PyExc_TypeError, "put_key must be a str");
      throw nb::python_error();
    }
    Payload p;
    BufferViews bv;
    size_t total = 0;
    PyConnector& self = *nb::inst_ptr<PyConnector>(self_h);
    DeviceStaging ds;
    ds.arena_bytes = self.device_slots;
    if (array_payload(data, bv, p, !self.networked)) {  // pinned when the GIL will be let go
      total = p.tensors[0].nbytes();
    } else {
      Encoding enc = encode_py(data, p, bv, -1, &ds);
      if (!enc.ok) return self_h.attr("_put_slow")(from, to, key, data, readers, request_id, enc.why);
      total = enc.total;
    }
    PyPut pr = put_payload(self, from, to, utf8(key.ptr()), p, total, rd, request_id, &ds);
    self.succeeded();
    return nb::make_tuple(true, pr.size, std::move(pr.metadata));
  } catch (nb::python_error& e) {
    report_or_rethrow(self_h, "put", e);
    return nb::make_tuple(false, 0, nb::none());
  }
}

nb::tuple put_parts(PyConnector& self, nb::handle from, nb::handle to, const std::string& key, int kind,
                    nb::list regions, uint32_t readers, nb::handle request_id) {
  Payload p;
  BufferViews bv;
  const size_t total = payload_from_parts(kind, regions, bv, p);
  PyPut pr = put_payload(self, from, to, key, p, total, readers, request_id, nullptr);
  return nb::make_tuple(pr.size, std::move(pr.metadata));
}

// A get's metadata as the connector reads it: the converted Value, and the bytes object of an
// inline payload (the shared-memory connector's "inline"), read in place rather than copied into
// the Value (GetHooks::metadata_inline). An inline payload's tensors view one or the other.
struct MetadataHold {
  Value value;
  nb::object inline_bytes;
};

// Borrow key's slot zero-copy (the slot is released when the result is dropped). nullopt when absent
// or timed out. A get that may block (keyless, with a timeout) releases the GIL; a lookup by
// metadata takes microseconds and keeps it. Must be entered holding the GIL. `md` receives the
// converted metadata and the bytes of an inline payload: its tensors view them, so the caller
// keeps `md` alive until it has copied them out.
std::optional<GetResult> borrow(PyConnector& self, nb::handle from, nb::handle to, const std::string& key,
                                nb::handle metadata, nb::handle timeout, MetadataHold& md, bool private_ok = false) {
  std::string f = stage_str(from), t = stage_str(to);
  const bool has_md = !metadata.is_none();
  // Our own metadata of an inline payload ({"size", "entry", "gen", "inline": bytes}): the frame is
  // read from the bytes object in place (held in `md` for the caller) instead of copied into the
  // Value. Any other shape goes through from_py whole.
  nb::object& inline_ref = md.inline_bytes;
  if (has_md && self.inline_field && PyDict_CheckExact(metadata.ptr())) {  // the shared-memory connector's
    PyObject* b = PyDict_GetItemWithError(metadata.ptr(), self.inline_field);
    if (!b && PyErr_Occurred()) throw nb::python_error();
    if (b && PyBytes_CheckExact(b) && capi::bytes_size(b) > 0) inline_ref = nb::borrow(b);
  }
  if (has_md) md.value = from_py(metadata, 0, inline_ref.ptr());
  // Our metadata is a direct lookup (microseconds: the GIL is kept); anything else (none, another
  // connector's) may wait for the key.
  const bool lookup = has_md && self.lookup_field && PyDict_Check(metadata.ptr()) &&
                      PyDict_GetItem(metadata.ptr(), self.lookup_field);
  double secs = -1;  // no timeout: no wait
  if (!timeout.is_none()) {
    secs = PyFloat_AsDouble(timeout.ptr());  // TypeError for a non-number
    if (secs == -1.0 && PyErr_Occurred()) throw nb::python_error();
    secs = timeout_secs(secs);
    if (secs < 0) secs = 1e9;  // infinite: as long as a deadline can say
  }
  const std::shared_ptr<Connector> keep = self.get();  // raises ClosedError: must run while holding the GIL
  Connector& conn = *keep;
  Result<GetResult> r = make_error(Errc::io, "");
  // Zero-copy, inline payloads viewing `md`, the tree left packed: the caller builds its objects.
  GetHooks hooks;
  hooks.view_metadata = hooks.raw_tree = true;
  hooks.private_ok = private_ok;  // a copying get: a connector may land the payload in memory the result owns
  GetOptions go;
  go.zero_copy = true;
  go.hooks = &hooks;
  if (inline_ref.is_valid())
    hooks.metadata_inline = std::span<const std::byte>(reinterpret_cast<const std::byte*>(capi::bytes_data(inline_ref.ptr())),
                                                    size_t(capi::bytes_size(inline_ref.ptr())));
  SignalCheck sig;  // a get that may wait for its key: Ctrl-C ends the wait
  if (secs > 0) go.keep_waiting = std::ref(sig);
  const Deadline dl = secs < 0 ? kNoWait : deadline_after(secs);
  if (self.networked || !lookup) {  // may cross a network, or wait for the key: without the GIL
    nb::gil_scoped_release nogil;
    r = conn.get(f, t, key, has_md ? &md.value : nullptr, dl, go);
  } else {  // our metadata: a direct lookup (microseconds)
    r = conn.get(f, t, key, has_md ? &md.value : nullptr, dl, go);
  }
  if (sig.raised) throw nb::python_error();
  if (!r.ok()) {
    const Errc c = r.error().code;  // absent, timed out, abandoned: None, as vLLM-Omni's get
    if (c == Errc::not_found || c == Errc::timeout || c == Errc::cancelled) {
      t_miss = std::move(r).error();
      return std::nullopt;
    }
    raise(r.error());
  }
  return std::move(r).value();
}

std::optional<Found> get_found(PyConnector& self, nb::handle from, nb::handle to, const std::string& key,
                               nb::handle metadata, nb::handle timeout, bool zero_copy) {
  // Always borrow the slot: copy mode copies each region exactly once, into the Python object,
  // and the slot is released when `g` goes out of scope below.
  MetadataHold md;  // outlives `got`: inline tensors view it
  std::optional<GetResult> got = borrow(self, from, to, key, metadata, timeout, md, !zero_copy);
  if (!got) return std::nullopt;
  return found_of(*got, zero_copy, self.allow_pickle, key, !self.networked);
}

// What a get's dict holding the key "__stagelink_kv__" passes through (stagelink.kv.unpack: a KV
// cache sent as its tensors becomes the cache object again). One dict lookup for dict results only.
PyObject* g_rebuild_hook = nullptr;

void set_hook(PyObject*& slot, nb::handle fn) {
  PyObject* f = fn.is_none() ? nullptr : fn.ptr();
  Py_XINCREF(f);
  PyObject* old = slot;  // (the limited API has no Py_XSETREF)
  slot = f;
  Py_XDECREF(old);
}

// Python's `Connector.get`: (data, size), or None when absent, timed out or failed (logged by
// `_fail`; raised in strict mode). A pickled payload is finished by the subclass's `_decode`.
nb::object connector_get(nb::handle self_h, nb::handle from, nb::handle to, nb::handle key, nb::handle metadata,
                         nb::handle timeout, bool zero_copy, nb::handle device) {
  std::optional<Found> f;
  // device=: where torch tensors land ("cpu", "cuda:N"; None: where they came from).
  DeviceWish wish(device.is_none() ? std::string() : nb::cast<std::string>(nb::str(device)));
  try {
    if (!PyUnicode_Check(key.ptr())) {
      PyErr_SetString(PyExc_TypeError, "get_key must be a str");
      throw nb::python_error();
    }
    static PyObject* const kDefaultTimeout = PyUnicode_InternFromString("default_get_timeout");  // immortal
    nb::object tmo = timeout.is_none() ? self_h.attr(kDefaultTimeout) : nb::borrow(timeout);
    f = get_found(*nb::inst_ptr<PyConnector>(self_h), from, to, utf8(key.ptr()), metadata, tmo, zero_copy);
  } catch (nb::python_error& e) {
    report_or_rethrow(self_h, "get", e);
    return nb::none();
  }
  if (!f) {  // None, as vLLM-Omni's get; `last_error` says why (strict mode raises it)
    self_h.attr("_miss")(exception_of(t_miss));
    return nb::none();
  }
  nb::inst_ptr<PyConnector>(self_h)->succeeded();
  if (f->kind == KIND_OBJECT) {
    if (!f->obj.is_valid()) throw nb::python_error();
    if (g_rebuild_hook && PyDict_Check(f->obj.ptr())) {
      static PyObject* const kMark = PyUnicode_InternFromString("__stagelink_kv__");  // immortal
      if (PyDict_GetItem(f->obj.ptr(), kMark)) {
        f->obj = nb::steal(PyObject_CallFunctionObjArgs(g_rebuild_hook, f->obj.ptr(), nullptr));
        if (!f->obj.is_valid()) throw nb::python_error();
      }
    }
    return nb::make_tuple(f->obj, f->size);
  }
  return self_h.attr("_decode")(key, f->kind, f->obj, f->size, zero_copy);
}

// get_into: copy the array (or bytes) of key straight into `out`, a writable contiguous buffer the
// caller owns and may reuse: one memcpy, no allocation. Returns the bytes written, None when absent.
nb::object get_into_parts(PyConnector& self, nb::handle from, nb::handle to, const std::string& key,
                          nb::handle metadata, nb::handle timeout, nb::handle out) {
  Py_buffer view;
  if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw nb::python_error();
  BufferViews hold;
  hold.views.push_back(view);
  MetadataHold md;  // outlives `got`: inline tensors view it
  std::optional<GetResult> got = borrow(self, from, to, key, metadata, timeout, md);
  if (!got) return nb::none();
  GetResult& g = *got;
  // A typed array (Python's or C++'s) or raw bytes (region 0) copy straight; a pickled object
  // needs unpickling.
  const size_t idx = 0;
  if (g.payload.ext_has("pickle"))
    raise(make_error(Errc::invalid_argument, "get_into: '" + key + "' holds a pickled object; use get()"));
  if (idx >= g.payload.tensors.size())
    raise(make_error(Errc::invalid_argument, "get_into: '" + key + "' has no array to copy"));
  const Tensor& tn = g.payload.tensors[idx];
  if (tn.nbytes() > size_t(view.len))
    raise(make_error(Errc::invalid_argument, "get_into: '" + key + "' holds " + std::to_string(tn.nbytes()) +
                                                 " bytes; the destination has " + std::to_string(view.len)));
  if (tn.nbytes() > kGilReleaseBytes) {
    nb::gil_scoped_release nogil;
    host_pool::copy_split(static_cast<std::byte*>(view.buf), tn.data.data(), tn.nbytes());
  } else if (tn.nbytes()) {
    std::memcpy(view.buf, tn.data.data(), tn.nbytes());
  }
  return nb::int_(tn.nbytes());
}


}  // namespace

// What some connectors offer beyond the contract (their capabilities, stagelink/connector.hpp):
// the methods stagelink.Connector builds its parity probes and transfer-engine wiring on.
void bind_connector_capabilities(nb::class_<PyConnector>& cls) {
  cls.def("_abandon_get", [](PyConnector& self, const std::string& key) -> size_t {
             auto* w = self.get()->capability<WaitingGets>();
             return w ? w->abandon_get(key) : 0;
           })
      .def("_reap_consumed", [](PyConnector& self) -> size_t {
             auto* r = self.get()->capability<ReleaseTracking>();
             return r ? r->reap_consumed() : 0;
           })
      .def("_arrival_epoch", [](PyConnector& self) -> nb::object {
             auto* a = self.c ? self.c->capability<ArrivalSignals>() : nullptr;
             if (!a) return nb::none();
             auto e = a->arrival_epoch();
             if (!e.ok()) return nb::none();
             return nb::int_(e.value());
           })
      .def("_wait_arrival", [](PyConnector& self, uint64_t seen, double timeout_s) {
             auto* a = self.c ? self.c->capability<ArrivalSignals>() : nullptr;
             if (!a) return false;
             const std::shared_ptr<Connector> c = self.c;  // keeps `a` alive
             // In slices (a Status: timeout while nothing arrived), so Ctrl-C ends the wait.
             Status st = sliced_nogil(std::max(timeout_s, 0.0), [&](double slice) -> Status {
               if (a->wait_arrival(seen, deadline_after(slice))) return {};
               return make_error(Errc::timeout, "no arrival");
             });
             return st.ok();
           })
      .def("_pending_key_list", [](PyConnector& self) -> nb::object {
             if (!self.c) return nb::list();
             auto* a = self.c->capability<ArrivalSignals>();
             if (!a) return nb::none();
             auto k = a->pending_keys();
             if (!k.ok()) return nb::none();
             nb::list out;
             for (auto& s : k.value()) out.append(nb::str(s.data(), s.size()));
             return out;
           })
      .def("_sender_info", [](PyConnector& self) {
             auto* l = self.c ? self.c->capability<SenderLink>() : nullptr;
             return l ? to_py(l->sender_info()) : nb::none();
           })
      .def("_connect", [](PyConnector& self, nb::handle info, nb::handle timeout) {
             const Value v = info.is_none() ? Value() : from_py(info);
             const Deadline dl = deadline_after(timeout_or(timeout, 1e9));  // None: for ever
             const std::shared_ptr<Connector> c = self.get();
             auto* l = c->capability<SenderLink>();
             if (!l) return;  // nothing to connect (shared memory, the store)
             Status st;
             {
               nb::gil_scoped_release nogil;
               st = l->connect(v, dl);
             }
             if (!st.ok()) raise(st.error());
           }, nb::arg("sender_info").none(), nb::arg("timeout").none())
      .def("_update_sender_info", [](PyConnector& self, const std::string& host, int port) {
             auto c = self.get();
             auto* l = c->capability<SenderLink>();
             if (!l) raise(make_error(Errc::unsupported, c->name() + " has no sender to update"));
             auto st = l->update_sender_info(host, port);
             if (!st.ok()) raise(st.error());
           });
}

void bind_connector(nb::module_& m) {
  m.def("_set_zero_copy_hook", [](nb::handle fn) { set_hook(g_zero_copy_hook, fn); }, nb::arg("fn").none(),
        "what each torch tensor of a zero_copy get passes through as the decoder makes it (None: nothing)");
  m.def("_detach_at_exit", [] { stagelink::shm::Directory::detach_all_at_exit(); },
        "at interpreter exit: leave every shared-memory namespace still attached (a zero-copy torch view "
        "alive then is never freed, and would keep the directory in /dev/shm)");
  m.def("_set_rebuild_hook", [](nb::handle fn) { set_hook(g_rebuild_hook, fn); }, nb::arg("fn").none(),
        "what a Connector.get's dict holding the key '__stagelink_kv__' passes through (None: nothing)");
  nb::class_<PyLoan>(m, "_Loan")
      .def("region", &PyLoan::region, nb::rv_policy::reference_internal)
      .def_prop_ro("count", [](PyLoan& l) { return l.loan.tensor_count(); })
      .def_prop_ro("frame_size", [](PyLoan& l) { return l.loan.frame_size(); })
      .def_prop_ro("valid", [](PyLoan& l) { return l.loan.valid(); });

  // The base of Python's `stagelink.Connector`: `put` and `get` run here without a Python frame
  // (the subclass supplies `_put_slow`, `_decode`, `_fail` and `default_get_timeout`); the
  // underscored methods are the subclass's building blocks.
  auto cls = nb::class_<PyConnector>(m, "_Connector", nb::type_slots(g_connector_slots))
      .def("__init__", [](PyConnector* self, const std::string& name, nb::handle extra, bool allow_pickle) {
             Value e = extra.is_none() ? Value(Value::Map{}) : from_py(extra);
             Result<std::unique_ptr<Connector>> made = make_error(Errc::io, "");
             {
               nb::gil_scoped_release nogil;  // a network connector connects (and asks its server) here
               made = create_connector(name, e);
             }
             auto c = unwrap(std::move(made));
             const auto desc = find_connector(name);
             const bool networked = !desc || !desc->has(ConnectorTrait::host_local);
             PyObject *inl = nullptr, *lookup = nullptr;
             size_t slots = 0;
             if (auto* f = c->capability<BindingFields>()) {
               inl = field_str(f->inline_frame_field());
               lookup = field_str(f->direct_lookup_field());
               slots = f->device_slots();
             }
             new (self) PyConnector{std::move(c), allow_pickle, networked, inl, lookup, slots};
           }, nb::arg("name"), nb::arg("extra").none(), nb::arg("allow_pickle") = true)
      .def("put", [](nb::handle self, nb::handle from, nb::handle to, nb::handle key, nb::handle data,
                     nb::handle readers, nb::handle request_id) {
             return connector_put(self, from, to, key, data, readers, request_id);
           },
           nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("put_key"), nb::arg("data").none(), nb::kw_only(),
           nb::arg("readers").none() = nb::none(), nb::arg("request_id").none() = nb::none(),
           "Publish ``data`` for ``get(from_stage, to_stage, put_key)``; returns ``(success, size, metadata)``.\n\n"
           "``readers``: how many gets may read it (fan-out); the memory is freed after the last one.\n"
           "``request_id``: ties the put to a request, so that ``cleanup(request_id)`` frees it (chunk\n"
           "keys of one request); without it only ``cleanup(put_key)`` does.\n"
           "numpy arrays, torch tensors (any dtype), bytes-likes and trees of dicts, lists, tuples,\n"
           "str, int, float, bool and None travel as native frames, readable from C++; ``Loan``\n"
           "objects are published in place; anything else is pickled (protocol 5, buffers out of\n"
           "band) where ``allow_pickle`` permits.")
      .def("get", [](nb::handle self, nb::handle from, nb::handle to, nb::handle key, nb::handle metadata,
                     nb::handle timeout, bool zero_copy, nb::handle device) {
             return connector_get(self, from, to, key, metadata, timeout, zero_copy, device);
           },
           nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("get_key"), nb::arg("metadata").none() = nb::none(),
           nb::arg("timeout").none() = nb::none(), nb::kw_only(), nb::arg("zero_copy") = false,
           nb::arg("device").none() = nb::none(),
           "Fetch what ``put`` published: ``(data, size)``, or ``None`` when absent, timed out or failed.\n\n"
           "``metadata``: what put returned (direct lookup); without it the key is looked up, waiting\n"
           "up to ``timeout`` seconds (None: ``extra.get_timeout_s``, else a single attempt).\n"
           "``zero_copy``: arrays and buffers are read-only views into shared memory that keep the\n"
           "slot alive until dropped; otherwise the data is copied out and the slot freed at once.\n"
           "``device``: where torch tensors land (``\"cpu\"``, ``\"cuda:N\"``); None: where they came\n"
           "from (a CUDA tensor back on its GPU, found by UUID).")
      .def("_put_parts", &put_parts, nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("key"), nb::arg("kind"),
           nb::arg("regions"), nb::arg("readers") = 0, nb::arg("request_id").none() = nb::none())
      .def("_get_into_parts", &get_into_parts, nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("key"),
           nb::arg("metadata").none(), nb::arg("timeout").none(), nb::arg("out"))
      .def("_loan_array", [](PyConnector& self, const std::string& dtype, std::vector<int64_t> shape) {
             // One typed region in the arena, read back as a numpy array (or a C++ tensor).
             TensorSpec spec;
             spec.dtype = unwrap(dtype_from_name(dtype));
             size_t n = dtype_size(spec.dtype);
             for (auto d : shape) {
               if (d < 0) raise(make_error(Errc::invalid_argument, "loan: negative dimension"));
               n *= size_t(d);
             }
             spec.nbytes = n;
             spec.shape = std::move(shape);
             return PyLoan{unwrap(lending(self).loan(Value(TensorRef{0}), std::span<const TensorSpec>(&spec, 1)))};
           })
      .def("_put_loan", [](PyConnector& self, nb::handle from, nb::handle to, const std::string& key, PyLoan& loan,
                           uint32_t readers, nb::handle request_id) {
             const std::string rid = rid_str(request_id);
             PutResult pr =
                 unwrap(lending(self).put_loan(stage_str(from), stage_str(to), key, std::move(loan.loan), PutOptions{readers, rid}));
             return nb::make_tuple(pr.size, to_py(pr.metadata));
           }, nb::arg("from_stage"), nb::arg("to_stage"), nb::arg("key"), nb::arg("loan"), nb::arg("readers") = 0,
           nb::arg("request_id").none() = nb::none())
      .def("_cleanup", [](PyConnector& self, const std::string& rid) {
             auto c = self.get();
             if (!self.networked) return c->cleanup(rid);
             nb::gil_scoped_release nogil;  // a store's cleanup is a few round trips
             return c->cleanup(rid);
           })
      .def_prop_ro("allow_pickle", [](PyConnector& self) { return self.allow_pickle; })
      .def_prop_rw("last_error", [](PyConnector& self) { return self.last_error; },
                   [](PyConnector& self, nb::handle e) { self.last_error = nb::borrow(e); }, nb::arg("error").none(),
                   "Why the last put or get failed or returned None (NotFoundError: nothing under the key, or "
                   "already read by every reader; TimeoutError; CancelledError: cleaned up), kept without its "
                   "traceback; None after a call that worked.")
      .def("_health", [](PyConnector& self) {
             if (!self.c) return nb::object(nb::dict());
             const std::shared_ptr<Connector> c = self.c;
             Value h;
             if (self.networked) {
               nb::gil_scoped_release nogil;  // asks the server (INFO)
               h = c->health();
             } else {
               h = c->health();
             }
             return to_py(h);
           })
      .def("close", [](PyConnector& self) {
             if (self.c) {
               const std::shared_ptr<Connector> c = std::move(self.c);  // later calls say closed
               nb::gil_scoped_release nogil;
               c->close();  // wakes calls in flight; they hold their own references
             }
           }, "Release everything this connector owns. Safe to call twice.")
      .def_prop_ro("closed", [](PyConnector& self) { return !self.c; });
  bind_connector_capabilities(cls);
}

}  // namespace stagelink::py
