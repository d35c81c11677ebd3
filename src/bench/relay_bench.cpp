// stagelink bench relay: one hop of the pipeline's data plane (relay put + control message, then
// the receiver's get), process to process, against memcpy and raw ZeroMQ in the same run.
//
// Harness: the parent (sender) and a forked child (receiver) ping-pong. Control messages go over
// shared memory (shm://, the default on one host), and once more over ZeroMQ ipc:// for comparison. The sender puts S bytes
// into the relay and sends `data_ready` with the metadata; the receiver wakes in its inbox, reads
// the payload (into a reused buffer, or as a zero-copy view), then answers the same way with 64
// bytes. One-way hop of S = round trip - hop(64 B), where hop(64 B) = the 64/64 round trip / 2.
// ZeroMQ: the same ping-pong with PUSH/PULL over ipc:// carrying the bytes themselves.
#include "bench/relay_bench.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <zmq.hpp>

#include "core/proc.hpp"
#include "stagelink/control.hpp"
#include "stagelink/relay.hpp"

namespace stagelink::bench {
namespace {

struct Ends {
  std::unique_ptr<ControlInbox> in;
  std::unique_ptr<ControlOutbox> out;
  std::unique_ptr<Relay> relay;
};

// `ipc`: control messages over ZeroMQ ipc:// (across hosts: tcp://); else over shared memory
// (shm://, the default on one host).
Result<Ends> open_ends(const std::string& dir, const char* me, const char* peer, const std::string& ns,
                       size_t max_size, bool ipc) {
  Ends e;
  const std::string tag = dir.substr(dir.rfind('/') + 1);
  SL_ASSIGN(e.in, ControlInbox::bind(ipc ? "ipc://" + dir + "/" + me : "shm://" + tag + "-" + me));
  SL_ASSIGN(e.out, ControlOutbox::connect(ipc ? "ipc://" + dir + "/" + peer : "shm://" + tag + "-" + peer));
  RelayConfig c;
  c.credits = 4;
  c.slot_size_mb = double(max_size) / double(1 << 20) + 1;
  c.timeout_s = 30;
  Value::Map x;
  x.emplace_back("namespace", ns);
  c.extra = Value(std::move(x));
  SL_ASSIGN(e.relay, Relay::create(c));
  return e;
}

Payload bytes_payload(std::span<const std::byte> b) {
  Payload p;
  p.tree = Value(TensorRef{0});
  p.tensors.push_back(Tensor::view_of(b));
  return p;
}

// Send `size` bytes of `src` through relay + control to the peer.
Status send_hop(Ends& e, std::span<const std::byte> src) {
  SL_ASSIGN(RelayOp op, e.relay->put_async(bytes_payload(src), {.request_id = "bench", .edge = "peer"}));
  ControlMessage m;
  m.type = ControlType::data_ready;
  m.request_id = "bench";
  m.metadata = op.metadata();
  return e.out->send(m, 30);
}

// Receive one hop: read the payload into `dest` (copy) or as a view (dropped at once).
Status recv_hop(Ends& e, std::span<std::byte> dest, bool view) {
  SL_ASSIGN(ControlMessage m, e.in->recv(30));
  RelayGetOptions o;
  o.request_id = "bench";
  if (view) o.zero_copy = true;
  else o.dest = dest;
  SL_ASSIGN(RelayOp g, e.relay->get_async(m.metadata, o));
  return {};
}

int iters_for(size_t size, int iters) {
  if (size >= (64u << 20)) return std::max(5, iters / 200);
  if (size >= (16u << 20)) return std::max(10, iters / 100);
  if (size >= (1u << 20)) return std::max(20, iters / 10);
  return iters;
}

// Modes: 0 = relay copy into dest, 1 = relay zero-copy view (control over shm), 2 = raw ZeroMQ,
// 3 = relay zero-copy view with control over ZeroMQ ipc.
constexpr int kModes = 4;
void child_main(const std::string& dir, const std::string& ns, const std::vector<size_t>& sizes, int iters,
                size_t max_size) {
  std::vector<std::byte> dest(max_size + 64), small(64);
  auto e = open_ends(dir, "b", "a", ns, max_size, false);
  auto ez = open_ends(dir, "bz", "az", ns + "z", max_size, true);
  if (!e.ok() || !ez.ok()) _exit(3);
  zmq::context_t ctx(1);
  zmq::socket_t zin(ctx, zmq::socket_type::pull), zout(ctx, zmq::socket_type::push);
  zin.bind("ipc://" + dir + "/zb");
  zout.connect("ipc://" + dir + "/za");
  for (int mode = 0; mode < kModes; ++mode) {
    Ends& E = mode == 3 ? ez.value() : e.value();
    for (size_t s : sizes) {
      const int n = iters_for(s, iters) + 3;  // + warm-up
      for (int i = 0; i < n; ++i) {
        if (mode == 2) {
          zmq::message_t m;
          if (!zin.recv(m, zmq::recv_flags::none)) _exit(4);
          if (!zout.send(zmq::const_buffer(small.data(), small.size()), zmq::send_flags::none)) _exit(5);
          continue;
        }
        if (!recv_hop(E, std::span<std::byte>(dest.data(), s), mode != 0).ok()) _exit(6);
        if (!send_hop(E, small).ok()) _exit(7);
      }
    }
  }
  for (Ends* x : {&e.value(), &ez.value()}) {
    x->relay.reset();
    x->in.reset();
    x->out.reset();
  }
  _exit(0);
}

}  // namespace

Result<std::vector<RelayRow>> bench_relay(const std::vector<size_t>& sizes, int iters, const std::string& ns,
                                          const std::function<void(const std::string&)>& progress) {
  if (sizes.empty()) return make_error(Errc::invalid_argument, "bench relay: no sizes");
  std::vector<size_t> all = sizes;
  if (std::find(all.begin(), all.end(), size_t(64)) == all.end()) all.insert(all.begin(), 64);
  const size_t max_size = *std::max_element(all.begin(), all.end());
  SL_ASSIGN(std::string dir, make_private_socket_dir("slbench"));
  std::vector<std::byte> src(max_size + 64), dest(max_size + 64), small(64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::byte(i * 131);
  pid_t pid = fork();
  if (pid == 0) child_main(dir, ns, all, iters, max_size);
  auto e = open_ends(dir, "a", "b", ns, max_size, false);
  auto ez = open_ends(dir, "az", "bz", ns + "z", max_size, true);
  zmq::context_t ctx(1);
  zmq::socket_t zin(ctx, zmq::socket_type::pull), zout(ctx, zmq::socket_type::push);
  zin.bind("ipc://" + dir + "/za");
  zout.connect("ipc://" + dir + "/zb");
  std::vector<RelayRow> rows(all.size());
  Status failed;
  for (size_t k = 0; k < all.size(); ++k) rows[k].size = all[k];
  for (int mode = 0; mode < kModes && e.ok() && ez.ok() && failed.ok(); ++mode) {
    static const char* kNames[] = {"relay (copy out)", "relay (zero-copy view)", "raw ZeroMQ",
                                   "relay (view, control over ZeroMQ)"};
    Ends& E = mode == 3 ? ez.value() : e.value();
    for (size_t k = 0; k < all.size() && failed.ok(); ++k) {
      const size_t s = all[k];
      if (progress) progress(std::string(kNames[mode]) + " " + std::to_string(s) + " B");
      const int n = iters_for(s, iters) + 3;
      std::vector<double> rtt;
      rtt.reserve(n);
      for (int i = 0; i < n; ++i) {
        const uint64_t t0 = mono_ns();
        if (mode == 2) {
          zmq::message_t m;
          if (!zout.send(zmq::const_buffer(src.data(), s), zmq::send_flags::none) ||
              !zin.recv(m, zmq::recv_flags::none)) {
            failed = make_error(Errc::io, "zeromq ping-pong failed");
            break;
          }
        } else {
          Status st = send_hop(E, std::span<const std::byte>(src.data(), s));
          if (st.ok()) st = recv_hop(E, small, false);
          if (!st.ok()) {
            failed = std::move(st);
            break;
          }
        }
        if (i >= 3) rtt.push_back(double(mono_ns() - t0) / 1e3);
      }
      Stat st = summarize(rtt);
      RelayRow& r = rows[k];
      (mode == 0 ? r.rtt_copy : mode == 1 ? r.rtt_view : mode == 2 ? r.rtt_zmq : r.rtt_view_zmqctl) = st;
    }
  }
  // memcpy into a warm buffer: the floor of any copy.
  for (auto& r : rows) {
    std::vector<double> t;
    const int n = iters_for(r.size, iters);
    for (int i = 0; i < n + 2; ++i) {
      const uint64_t t0 = mono_ns();
      std::memcpy(dest.data(), src.data(), r.size);
      if (i >= 2) t.push_back(double(mono_ns() - t0) / 1e3);
    }
    r.memcpy_ = summarize(t);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  for (auto* x : {&e, &ez})
    if (x->ok()) {
      x->value().relay.reset();
      x->value().in.reset();
      x->value().out.reset();
    }
  remove_private_socket_dir(dir);
  if (!e.ok()) return std::move(e).error();
  if (!ez.ok()) return std::move(ez).error();
  if (!failed.ok()) return std::move(failed).error();
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    return make_error(Errc::io, "bench relay: the receiving process failed (status " + std::to_string(st) + ")");
  return rows;
}

}  // namespace stagelink::bench
