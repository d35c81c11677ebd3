// The broadcast MessageQueue (`_MessageQueue`).
#include "python/bindings.hpp"

#include "python/arrays.hpp"
#include "python/codec.hpp"

namespace stagelink::py {

namespace {

// ---- MessageQueue ----
// shared_ptr: an enqueue/dequeue blocked with the GIL released keeps the queue alive even if
// another thread closes it (close shuts it down first, which wakes that call with cancelled).
struct PyMq {
  std::shared_ptr<MessageQueue> q;
  // A writer with remote readers: an enqueue that times out after the local readers got the
  // message leaves a gap for the remote ones, so it is not cut into slices (Ctrl-C waits for
  // its timeout there).
  bool remote_writer = false;
  explicit PyMq(std::unique_ptr<MessageQueue> m) : q(std::move(m)) {
    remote_writer = q->is_writer() && !q->export_handle().remote_addr.empty();
  }
  // A writer's enqueue: in slices (signal handlers run between them) unless remote_writer.
  // `hold`: the device slots the payload's records name (MessageQueue::enqueue_held).
  void enqueue(const Payload& p, double t, const std::shared_ptr<const void>& hold = nullptr) {
    auto w = get();
    if (hold) {
      check_sliced(t, [&](double slice) { return w->enqueue_held(p, slice, hold); });
      return;
    }
    if (remote_writer) {
      Status st;
      {
        nb::gil_scoped_release nogil;
        st = w->enqueue(p, t);
      }
      if (!st.ok()) raise(st.error());
      return;
    }
    check_sliced(t, [&](double slice) { return w->enqueue(p, slice); });  // a full ring blocks until readers catch up
  }
  std::shared_ptr<MessageQueue> get() {
    if (!q) raise(make_error(Errc::closed, "message queue is closed"));
    return q;
  }
};


void mq_enqueue_parts(PyMq& self, int kind, nb::list regions, nb::handle timeout) {
  Payload p;
  BufferViews bv;
  payload_from_parts(kind, regions, bv, p);
  self.enqueue(p, timeout_arg(timeout));
}

// A numpy array, torch tensor, bytes-like or tree of them as a native frame; False when it needs
// the pickle path.
bool mq_enqueue_obj(PyMq& self, nb::handle obj, nb::handle timeout) {
  Payload p;
  BufferViews bv;
  DeviceStaging ds;  // CUDA tensors left on their GPU where every reader is local (vLLM's tensor arena)
  ds.arena_bytes = self.get()->device_slots();
  if (!array_payload(obj, bv, p, false)) {
    if (!encode_py(obj, p, bv, -1, &ds).ok) return false;
  }
  self.enqueue(p, timeout_arg(timeout), ds.hold());
  return true;
}

// Returns (kind, [regions]) (or (KIND_OBJECT, object) for a native frame); each region copied once,
// straight from shared memory into a Python object, while the chunk is held.
nb::tuple mq_dequeue_parts(PyMq& self, nb::handle timeout) {
  const double t = timeout_arg(timeout);
  auto q = self.get();
  nb::object out;
  Error decode_err{Errc::ok, ""};
  Status st = sliced_nogil(t, [&](double slice) {
    return q->dequeue_with(slice, [&](std::span<const std::byte> frame) {
      nb::gil_scoped_acquire gil;
      try {  // nothing may be thrown through the queue's code
        out = frame_parts(frame, !q->is_remote_reader());  // a remote reader's crossed a network
      } catch (nb::python_error& e) {
        decode_err = Error{Errc::corrupt, std::string("message could not be read: ") + e.what()};
      }
    });
  });
  if (!st.ok()) raise(st.error());
  if (decode_err.code != Errc::ok) raise(decode_err);
  return nb::borrow<nb::tuple>(out);
}


}  // namespace

void bind_mq(nb::module_& m) {
  nb::class_<PyMq>(m, "_MessageQueue")
      .def_static("create", [](uint32_t n_reader, uint32_t n_local_reader, std::vector<uint32_t> local_ranks,
                               size_t max_chunk_bytes, uint32_t max_chunks, const std::string& connect_ip, int remote_port,
                               size_t overflow_bytes, double warn_interval_s, bool drop_dead_readers, uint64_t spin_us,
                               const std::string& shm_dir, nb::handle curve) {
             MessageQueueOptions o;
             if (auto cc = mq_curve(curve)) o.curve = cc->server;
             o.n_reader = n_reader;
             o.n_local_reader = n_local_reader;
             o.local_reader_ranks = std::move(local_ranks);
             o.max_chunk_bytes = max_chunk_bytes;
             o.max_chunks = max_chunks;
             o.connect_ip = connect_ip;
             o.remote_port = remote_port;
             o.overflow_bytes = overflow_bytes;
             o.warn_interval_s = warn_interval_s;
             o.drop_dead_readers = drop_dead_readers;
             o.spin_us = spin_us;
             o.shm_dir = shm_dir;
             return PyMq(unwrap(MessageQueue::create(o)));
           }, nb::arg("n_reader"), nb::arg("n_local_reader"), nb::arg("local_ranks"), nb::arg("max_chunk_bytes"),
           nb::arg("max_chunks"), nb::arg("connect_ip"), nb::arg("remote_port"), nb::arg("overflow_bytes"),
           nb::arg("warn_interval_s"), nb::arg("drop_dead_readers"), nb::arg("spin_us"), nb::arg("shm_dir"),
           nb::arg("curve").none() = nb::none())
      .def_static("create_from_handle", [](nb::bytes handle, int64_t rank, nb::handle curve) {
             auto h = unwrap(MessageQueueHandle::from_msgpack(
                 std::span<const std::byte>(reinterpret_cast<const std::byte*>(handle.c_str()), handle.size())));
             auto cc = mq_curve(curve);
             return PyMq(unwrap(MessageQueue::create_from_handle(h, rank, cc ? &cc->client : nullptr)));
           }, nb::arg("handle"), nb::arg("rank"), nb::arg("curve").none() = nb::none())
      .def("export_handle", [](PyMq& self) {
             auto b = self.get()->export_handle().to_msgpack();
             return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def("wait_until_ready", [](PyMq& self, nb::handle timeout) {
             const double t = timeout_arg(timeout);
             auto q = self.get();
             check_sliced(t, [&](double slice) { return q->wait_until_ready(slice); });
           }, nb::arg("timeout").none())
      .def("enqueue_parts", &mq_enqueue_parts, nb::arg("kind"), nb::arg("regions"), nb::arg("timeout").none())
      .def("enqueue_obj", &mq_enqueue_obj, nb::arg("obj").none(), nb::arg("timeout").none())
      .def("dequeue_parts", &mq_dequeue_parts, nb::arg("timeout").none())
      .def("wait_message", [](PyMq& self, nb::handle timeout) {
             const double t = timeout_arg(timeout);
             auto q = self.get();
             Result<bool> r = t == 0 ? q->wait_message(0) : [&] {  // a poll needs no GIL release
               nb::gil_scoped_release nogil;
               return q->wait_message(t);
             }();
             return unwrap(std::move(r));
           }, nb::arg("timeout").none())
      .def("drop_reader", [](PyMq& self, uint32_t rank) {
             auto st = self.get()->drop_reader(rank);
             if (!st.ok()) raise(st.error());
           })
      .def("shutdown", [](PyMq& self, bool everyone) { if (self.q) self.q->shutdown(everyone); },
           nb::arg("everyone") = false)
      .def("stats", [](PyMq& self) { return self.q ? to_py(self.q->stats()) : nb::object(nb::dict()); })
      .def_prop_ro("is_writer", [](PyMq& self) { return self.get()->is_writer(); })
      .def_prop_ro("rank", [](PyMq& self) { return self.get()->rank(); })
      .def_prop_ro("shutting_down", [](PyMq& self) { return !self.q || self.q->shutting_down(); })
      .def_prop_ro("closed", [](PyMq& self) { return !self.q; })
      .def("close", [](PyMq& self) {
             std::shared_ptr<MessageQueue> q = std::move(self.q);
             if (q) {
               nb::gil_scoped_release nogil;  // the writer's socket may flush (bounded linger)
               q->shutdown(true);  // a closed writer has ended the queue for its readers
               q.reset();
             }
           });
}

}  // namespace stagelink::py
