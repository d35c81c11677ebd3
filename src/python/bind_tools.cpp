// Module functions: configuration, option schemas, shared-memory administration, CUDA status, the
// payload codec as bytes (the C++ benchmarks: bind_bench.cpp).
#include "python/bindings.hpp"

#include <cmath>

#include "core/counts.hpp"
#include "core/net.hpp"
#include "core/options.hpp"
#include "cuda/driver.hpp"
#include "cuda/arena.hpp"
#include "python/codec.hpp"
#include "python/torch.hpp"
#include "stagelink/relay.hpp"
#include "stagelink/trace.hpp"

namespace stagelink::py {

namespace {

nb::dict spec_dict(const ConnectorSpec& s) {
  nb::dict d;
  d["name"] = s.name;
  d["extra"] = to_py(s.extra);
  d["ref"] = s.ref;
  return d;
}

nb::dict config_dict(const TransferConfig& cfg) {
  nb::dict out;
  nb::list edges;
  for (auto& e : cfg.edges) {
    nb::dict d;
    d["from"] = e.from;
    d["to"] = e.to;
    d["connector"] = spec_dict(e.connector);
    d["defaulted"] = e.defaulted;
    edges.append(d);
  }
  out["edges"] = edges;
  nb::dict conns;
  for (auto& [k, v] : cfg.connectors) conns[nb::str(k.c_str())] = spec_dict(v);
  out["connectors"] = conns;
  nb::list stages;
  nb::dict per_stage;
  for (auto& s : cfg.stages) {
    stages.append(s);
    nb::list l;
    for (auto& sc : cfg.stage_connectors(s)) {
      nb::dict d;
      d["peer"] = sc.peer;
      d["direction"] = sc.input ? "input" : "output";
      d["role"] = role_name(sc.role);
      d["connector"] = spec_dict(sc.connector);
      l.append(d);
    }
    per_stage[nb::str(s.c_str())] = l;
  }
  out["stages"] = stages;
  out["stage_connectors"] = per_stage;
  out["default_shm_threshold_bytes"] = cfg.default_shm_threshold_bytes;
  out["source"] = cfg.source;
  nb::list notes;
  for (auto& n : cfg.notes) notes.append(n);
  out["notes"] = notes;
  return out;
}



}  // namespace

void bind_tools(nb::module_& m) {
  // A frame as C++ sees it (tree with tensor leaves as (dtype, shape, bytes), and the ext a C++ reader
  // ignores): what tests use to check that Python payloads are native frames.
  m.def("_torch_routes", [](bool exchange_api, bool dlpack) {
        const TorchRoutes was = g_torch_routes;
        g_torch_routes = TorchRoutes{exchange_api, dlpack};
        return nb::make_tuple(was.exchange_api, was.dlpack);
      }, nb::arg("exchange_api"), nb::arg("dlpack"),
      "For tests: which of torch's routes tensors may take (DLPack's C exchange API, DLPack capsules; "
      "off: the attribute and numpy routes an older torch leaves). Returns the previous setting.");
  m.def("_frame_as_cpp_sees_it", [](nb::bytes frame) {
    auto p = unwrap(decode_frame(std::span<const std::byte>(reinterpret_cast<const std::byte*>(frame.c_str()), frame.size())));
    std::vector<nb::object> leaves;
    for (auto& t : p.tensors) {
      nb::list shape;
      for (auto d : t.shape) shape.append(d);
      leaves.push_back(nb::make_tuple(dtype_name(t.dtype), nb::tuple(shape),
                                      nb::bytes(reinterpret_cast<const char*>(t.data.data()), t.nbytes())));
    }
    nb::dict d;
    d["tree"] = to_py(p.tree, &leaves);
    d["ext"] = to_py(p.ext);
    return d;
  });
  m.def("_frame_from_parts", [](nb::handle ext, nb::list regions) {
        // What any producer (a C++ stage, a forger) may send: uint8 regions, the tree naming them
        // in order, and `ext` as given.
        Payload p;
        Value::List refs;
        for (size_t i = 0; i < regions.size(); ++i) {
          nb::bytes b = nb::cast<nb::bytes>(regions[i]);
          p.tensors.push_back(Tensor::copy_of(std::span<const std::byte>(reinterpret_cast<const std::byte*>(b.c_str()), b.size()),
                                              DType::u8, {int64_t(b.size())}));
          refs.emplace_back(TensorRef{uint32_t(i)});
        }
        p.tree = refs.size() == 1 ? refs[0] : Value(std::move(refs));
        p.ext = from_py(ext);
        return frame_bytes(p);
      }, "For tests: a frame built from its parts, as a C++ producer (or a forger) could send it.");
  m.def("cuda_drain", [](double timeout_s) {
        nb::gil_scoped_release nogil;
        return cuda::DeviceImports::instance().drain(timeout_s);
      }, nb::arg("timeout_s") = 30.0,
      "Wait until the device slots this process read were released (the work it queued on them finished).");
  m.def("cuda_arenas", [] { return to_py(cuda::DeviceArenas::instance().health()); },
        "This process's device arenas (CUDA tensors it put through a connector that keeps them on their GPU).");
  m.def("cuda_status", [] { return to_py(cuda::status()); },
        "Whether this process can use CUDA (the driver is loaded at run time): {'available': bool, "
        "'reason': why not, or 'driver_version' and 'devices' [{ordinal, name, uuid, total_bytes}]}.");
  m.def("mq_handle_info", [](nb::bytes handle) {
    auto h = unwrap(MessageQueueHandle::from_msgpack(
        std::span<const std::byte>(reinterpret_cast<const std::byte*>(handle.c_str()), handle.size())));
    nb::dict d;
    nb::list ranks;
    for (auto r : h.local_reader_ranks) ranks.append(r);
    d["local_reader_ranks"] = ranks;
    d["n_reader"] = h.n_reader;
    d["ring_name"] = h.ring_name;
    d["overflow_name"] = h.overflow_name;
    d["shm_dir"] = h.shm_dir;
    d["remote_addr"] = h.remote_addr;
    d["server_key"] = h.server_key;
    d["chunk_bytes"] = h.chunk_bytes;
    d["max_chunks"] = h.max_chunks;
    return d;
  });
  m.def("host_address", &net::host_address);
  m.def("host_pool_stats", [] {  // the pool of host buffers copying gets land in (tests, diagnosis)
    const auto s = host_pool::stats();
    nb::dict d;
    d["cached_bytes"] = s.cached_bytes;
    d["cached_buffers"] = s.cached_buffers;
    d["limit_bytes"] = s.limit_bytes;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    return d;
  });
  m.def("expand_env", [](const std::string& value, const std::string& key, const std::string& source, bool bare) {
    return unwrap(expand_env_value(value, key, source, bare));
  }, nb::arg("value"), nb::arg("key"), nb::arg("source"), nb::arg("bare") = false);
  // vLLM-Omni's serialize_obj/deserialize_obj: one frame in a bytes object.
  // `limit` >= 0: None too when the tensors, bytes and packed tree add up to more than `limit`
  // bytes, found before anything is copied (the pipeline's payloads inside control messages).
  m.def("encode_object", [](nb::handle obj, int64_t limit) -> nb::object {
    Payload p;
    BufferViews bv;
    Encoding enc = encode_py(obj, p, bv, limit);
    if (!enc.ok) return nb::none();  // needs pickle (or over the limit): the caller sends parts
    if (limit >= 0 && enc.total + p.packed_tree.size() > uint64_t(limit)) return nb::none();
    return frame_bytes(p);
  }, nb::arg("obj").none(), nb::arg("limit") = -1);
  m.def("encode_parts", [](int kind, nb::list regions) {
    Payload p;
    BufferViews bv;
    payload_from_parts(kind, regions, bv, p);
    return frame_bytes(p);
  });
  m.def("decode_frame_parts", [](nb::bytes data) {
    return frame_parts(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.c_str()), data.size()));
  });
  auto schema_dict = [](const options::Schema& s) {
    nb::list keys;
    for (const options::Key* k : s.all()) {
      nb::dict d;
      d["name"] = std::string(k->name);
      d["type"] = options::type_name(k->type);
      d["default"] = std::string(k->def);
      d["doc"] = std::string(k->doc);
      if (!std::isinf(k->min)) d["min"] = k->min;
      if (!std::isinf(k->max)) d["max"] = k->max;
      if (!k->choices.empty()) d["choices"] = std::string(k->choices);
      keys.append(d);
    }
    nb::dict sd;
    sd["owner"] = std::string(s.owner);
    sd["prefix"] = std::string(s.prefix);
    sd["closed"] = s.closed;
    sd["keys"] = keys;
    return sd;
  };
  m.def("option_schemas", [schema_dict] {
    nb::list out;
    for (const ConnectorDescriptor& d : connectors())
      if (d.schema) out.append(schema_dict(*d.schema));
    out.append(schema_dict(relay_schema()));
    return out;
  }, "Every connector's and the relay's option schema (key, type, default, range, meaning): the source of the "
     "configuration reference.");
  m.def("connectors", [] {
    static const std::pair<ConnectorTrait, const char*> kTraits[] = {
        {ConnectorTrait::host_local, "host_local"},     {ConnectorTrait::side_channel, "side_channel"},
        {ConnectorTrait::pickle_default, "pickle_default"}, {ConnectorTrait::device_slots, "device_slots"},
        {ConnectorTrait::lookup_gets, "lookup_gets"},   {ConnectorTrait::python_made, "python_made"}};
    nb::dict out;
    for (const ConnectorDescriptor& d : connectors()) {
      nb::dict e;
      e["name"] = d.name;
      nb::list aliases;
      for (const auto& a : d.aliases) aliases.append(nb::str(a.c_str()));
      e["aliases"] = aliases;
      nb::list traits;
      for (auto [t, n] : kTraits)
        if (d.has(t)) traits.append(nb::str(n));
      e["traits"] = traits;
      e["schema"] = d.schema ? nb::object(nb::str(std::string(d.schema->owner).c_str())) : nb::none();
      e["python"] = d.python.empty() ? nb::object(nb::none()) : nb::object(nb::str(d.python.c_str()));
      e["doc"] = d.doc;
      out[nb::str(d.name.c_str())] = e;
      for (const auto& a : d.aliases) out[nb::str(a.c_str())] = e;
    }
    return out;
  }, "Every registered connector's descriptor by name and alias: {name, aliases, traits (host_local, "
     "side_channel, pickle_default, device_slots, lookup_gets, python_made), schema, python, doc}.");
  m.def("relay_backends", [] {
    nb::dict out;
    for (const RelayBackend& b : relay_backends()) {
      nb::dict e;
      e["name"] = std::string(b.name);
      e["connector"] = b.connector.empty() ? nb::object(nb::none()) : nb::object(nb::str(std::string(b.connector).c_str()));
      e["host_local"] = b.host_local;
      e["doc"] = std::string(b.doc);
      out[nb::str(std::string(b.name).c_str())] = e;
    }
    return out;
  }, "The relay's backends: {name: {connector it makes (None: local, or named by the config), host_local, doc}}.");
  m.def("check_connector_options", [](const std::string& name, nb::handle extra) {
        const Status st = check_connector_options(name, extra.is_none() ? Value(Value::Map{}) : from_py(extra));
        if (!st.ok()) raise(st.error());
      }, nb::arg("name"), nb::arg("extra").none(),
      "For configuration checks: `extra` read by connector `name`'s own option reader, as when it is "
      "made, without making it.");
  m.def("make_private_socket_dir", [](const std::string& tag) { return unwrap(make_private_socket_dir(tag)); },
        nb::arg("tag") = "stagelink");
  m.def("remove_private_socket_dir", &remove_private_socket_dir);
  m.def("registered_connectors", &registered_connectors);
  m.def("load_config_file", [](const std::string& path, uint64_t default_shm_threshold) {
    return config_dict(unwrap(load_transfer_config_file(path, default_shm_threshold)));
  }, nb::arg("path"), nb::arg("default_shm_threshold") = kDefaultShmThresholdBytes);
  m.def("load_config_value", [](nb::handle obj, const std::string& source, uint64_t default_shm_threshold) {
    return config_dict(unwrap(load_transfer_config_value(from_py(obj), source, default_shm_threshold)));
  }, nb::arg("obj"), nb::arg("source"), nb::arg("default_shm_threshold") = kDefaultShmThresholdBytes,
     "The transfer-config loader on values already read (a dict), not text: errors name `source` and the key.");
  m.def("load_config_string", [](const std::string& text, const std::string& source, uint64_t default_shm_threshold) {
    return config_dict(unwrap(load_transfer_config_string(text, source, default_shm_threshold)));
  }, nb::arg("text"), nb::arg("source"), nb::arg("default_shm_threshold") = kDefaultShmThresholdBytes);
  m.def("transfer_engine_port", [](int base, const std::string& purpose, int from_stage, int dp_index, int tp_size, int tp_rank) {
    PortPurpose p = purpose == "kv_transfer" ? PortPurpose::kv_transfer
                    : purpose == "orchestrator" ? PortPurpose::orchestrator
                    : purpose == "request_forwarding" ? PortPurpose::request_forwarding
                    : (throw nb::value_error("purpose must be request_forwarding, kv_transfer or orchestrator"), PortPurpose::kv_transfer);
    return transfer_engine_port(base, p, from_stage, dp_index, tp_size, tp_rank);
  }, nb::arg("base"), nb::arg("purpose"), nb::arg("from_stage"), nb::arg("dp_index") = 0, nb::arg("tp_size") = 1, nb::arg("tp_rank") = 0);
  m.def("shm_list", [](const std::string& dir) {
    nb::list l;
    for (auto& r : shm::list_resources(dir)) {
      nb::dict d;
      d["name"] = r.name; d["kind"] = r.kind; d["owner_pid"] = r.owner_pid; d["owner_alive"] = r.owner_alive;
      d["size"] = r.size; d["held"] = r.held; d["age_s"] = r.age_s; d["live_entries"] = r.live_entries;
      d["attached"] = r.attached;
      l.append(d);
    }
    return l;
  }, nb::arg("shm_dir") = "/dev/shm");
  // The metrics tree (include/stagelink/metrics.hpp), read by stagelink.metrics.
  static constexpr auto ok_or_raise = [](const Status& st) {
    if (!st.ok()) raise(st.error());
  };
  m.def("metrics_time_every", [] { return metrics::time_every(); });
  m.def("metrics_set_time_every", [](uint32_t n) { metrics::set_time_every(n); }, nb::arg("n"),
        "time one put and get in n per thread (1: every one); calls are counted exactly all the same");
  m.def("count_pickle_refused", [] { counts::pickle_refused(); },
        "count a payload holding a pickle refused unread (stagelink_pickle_refused_total)");
  // Trace spans (include/stagelink/trace.hpp), read by stagelink.trace.
  m.def("trace_set_recording", [](bool on) { trace::set_recording(on); }, nb::arg("on"));
  m.def("trace_recording", [] { return trace::recording(); });
  m.def("trace_new_id", [] { return trace::new_id(); });
  m.def("trace_now_ns", [] { return trace::now_ns(); });
  m.def("trace_dropped", [] { return trace::dropped(); });
  m.def("trace_record", [](const std::string& name, const std::string& cat, uint64_t start_ns, uint64_t end_ns,
                           uint64_t trace_hi, uint64_t trace_lo, uint64_t span_id, uint64_t parent_id,
                           const std::string& request_id, nb::handle args) {
        trace::Span s;
        s.name = name;
        s.cat = cat;
        s.start_ns = start_ns;
        s.end_ns = end_ns;
        s.trace_hi = trace_hi;
        s.trace_lo = trace_lo;
        s.span_id = span_id;
        s.parent_id = parent_id;
        s.request_id = request_id;
        if (!args.is_none()) s.args = from_py(args);
        s.tid = trace::this_thread_id();
        trace::record(std::move(s));
      }, nb::arg("name"), nb::arg("cat"), nb::arg("start_ns"), nb::arg("end_ns"), nb::arg("trace_hi"),
        nb::arg("trace_lo"), nb::arg("span_id"), nb::arg("parent_id"), nb::arg("request_id"), nb::arg("args").none(),
        "keep one span in this process's trace buffer (stagelink.trace records through it)");
  m.def("trace_drain", [] {
        std::vector<trace::Span> spans;
        {
          nb::gil_scoped_release nogil;
          spans = trace::drain();
        }
        nb::list out;
        for (auto& s : spans)
          out.append(nb::make_tuple(s.name, s.cat, s.start_ns, s.end_ns, s.trace_hi, s.trace_lo, s.span_id,
                                    s.parent_id, s.request_id, s.args.is_nil() ? nb::object(nb::none()) : to_py(s.args),
                                    s.tid));
        return out;
      }, "take every span this process recorded: (name, cat, start_ns, end_ns, trace_hi, trace_lo, span_id, "
         "parent_id, request_id, args, tid)");
  m.def("metrics_collect", [] {
        Value v;
        {
          // Collecting takes the owners' locks (a connector's, a relay's): never with the GIL held,
          // or a thread that holds one of them and waits for the GIL would wait for ever.
          nb::gil_scoped_release nogil;
          v = metrics::collect_value();
        }
        return to_py(v);
      },
        "every sample of this process's metrics tree: [{name, kind, unit, help, labels, samples}]");
  m.def("metric_families", [] {
    const char* kinds[] = {"counter", "gauge", "histogram"};
    nb::list out;
    for (const auto* f : metrics::families()) {
      nb::dict d;
      d["name"] = f->name;
      d["kind"] = kinds[int(f->kind)];
      d["unit"] = f->unit;
      d["help"] = f->help;
      d["labels"] = f->labels;
      out.append(d);
    }
    return out;
  }, "every metric family declared in this process, by name");
  nb::class_<metrics::Dynamic>(m, "_Metric")
      .def_static("get", [](const std::string& name, const std::string& kind, const std::string& unit,
                            const std::string& help, const std::vector<std::string>& labels) {
        const metrics::Kind k = kind == "counter" ? metrics::Kind::counter
                                : kind == "gauge" ? metrics::Kind::gauge
                                : kind == "histogram" ? metrics::Kind::histogram
                                : (raise(make_error(Errc::invalid_argument, "metric kind: counter, gauge or histogram, not " + kind)), metrics::Kind::counter);
        return unwrap(metrics::Dynamic::get(name, k, unit, help, labels));
      }, nb::rv_policy::reference)
      .def("add", [](metrics::Dynamic& d, const std::vector<std::string>& l, double v) { ok_or_raise(d.add(l, v)); })
      .def("set", [](metrics::Dynamic& d, const std::vector<std::string>& l, double v) { ok_or_raise(d.set(l, v)); })
      .def("observe", [](metrics::Dynamic& d, const std::vector<std::string>& l, double v) { ok_or_raise(d.observe(l, v)); })
      .def("cell", [](metrics::Dynamic& d, const std::vector<std::string>& l) { return unwrap(d.cell(l)); },
           nb::rv_policy::reference);
  // One label set's cell: counted with no lock, lookup or allocation (it lives as long as the process).
  nb::class_<metrics::DynamicCell>(m, "_MetricCell")
      .def("add", [](metrics::DynamicCell& c, double v) { ok_or_raise(c.add(v)); })
      .def("set", [](metrics::DynamicCell& c, double v) { ok_or_raise(c.set(v)); })
      .def("observe", [](metrics::DynamicCell& c, double v) { ok_or_raise(c.observe(v)); })
      .def_prop_ro("value", [](metrics::DynamicCell& c) { return c.value(); });
  m.def("shm_reap", [](const std::string& dir) { return shm::reap(dir); }, nb::arg("shm_dir") = "/dev/shm");
  m.def("shm_user_prefix", &shm::user_prefix);
  m.def("curve_keypair", [] {
    auto k = unwrap(curve_keypair());
    return nb::make_tuple(k.public_key, k.secret_key);
  }, "A fresh CurveZMQ key pair, (public_key, secret_key), each 40 Z85 characters.");
  bind_bench(m);
}

}  // namespace stagelink::py
