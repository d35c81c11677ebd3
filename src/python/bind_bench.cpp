// The C++ benchmarks behind `stagelink bench shm|mq|relay` (libstagelink_bench).
#include "python/bindings.hpp"

#include "bench/mq_bench.hpp"
#include "bench/relay_bench.hpp"
#include "bench/shm_bench.hpp"

namespace stagelink::py {
namespace {

nb::dict stat_dict(const bench::Stat& s) {
  nb::dict d;
  d["median_us"] = s.median_us;
  d["p99_us"] = s.p99_us;
  return d;
}

}  // namespace

void bind_bench(nb::module_& m) {
  m.def("bench_mq_cpp", [](uint64_t latency_msgs, uint64_t throughput_msgs, uint64_t bandwidth_msgs, uint64_t idle_msgs,
                           double idle_gap_s, nb::object progress) {
    bench::MqBenchOptions o{latency_msgs, throughput_msgs, bandwidth_msgs, idle_msgs, idle_gap_s};
    Value v;
    {
      nb::gil_scoped_release nogil;
      v = bench::bench_mq(o, [&](const std::string& msg) {
        nb::gil_scoped_acquire gil;
        if (!progress.is_none()) progress(msg);
      });
    }
    return to_py(v);
  });
  m.def("bench_relay_cpp", [](std::vector<size_t> sizes, int iters, const std::string& ns, nb::object progress) {
    Result<std::vector<bench::RelayRow>> rows = make_error(Errc::io, "");
    {
      nb::gil_scoped_release nogil;
      rows = bench::bench_relay(sizes, iters, ns, [&](const std::string& what) {
        nb::gil_scoped_acquire gil;
        if (!progress.is_none()) progress(what);
      });
    }
    nb::list l;
    for (auto& r : unwrap(std::move(rows))) {
      nb::dict d;
      d["size"] = r.size;
      d["rtt_copy"] = stat_dict(r.rtt_copy); d["rtt_view"] = stat_dict(r.rtt_view);
      d["rtt_zmq"] = stat_dict(r.rtt_zmq); d["memcpy"] = stat_dict(r.memcpy_);
      d["rtt_view_zmqctl"] = stat_dict(r.rtt_view_zmqctl);
      l.append(d);
    }
    return l;
  }, nb::arg("sizes"), nb::arg("iters"), nb::arg("ns"), nb::arg("progress").none());
  m.def("bench_seam_ns", [](int iters, int rounds) {
    nb::gil_scoped_release nogil;
    return bench::seam_ns_per_put_get(iters, rounds);
  }, nb::arg("iters") = 1000000, nb::arg("rounds") = 7,
        "what the metrics seam adds to one put + get, in ns (median of rounds)");
  m.def("bench_shm_cpp", [](std::vector<size_t> sizes, int iters, const std::string& ns, size_t arena) {
    std::vector<bench::ShmRow> rows;
    {
      nb::gil_scoped_release nogil;
      rows = bench::bench_shm(sizes, iters, ns, arena);
    }
    nb::list l;
    for (auto& r : rows) {
      nb::dict d;
      d["size"] = r.size; d["iters"] = r.iters;
      d["put"] = stat_dict(r.put); d["get"] = stat_dict(r.get); d["get_view"] = stat_dict(r.get_view);
      d["get_into"] = stat_dict(r.get_into);
      d["roundtrip"] = stat_dict(r.roundtrip); d["memcpy"] = stat_dict(r.memcpy_);
      l.append(d);
    }
    return l;
  });
}

}  // namespace stagelink::py
