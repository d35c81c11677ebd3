// The UCX engine's endpoints and requests (engine.hpp): connecting to a peer's worker, blocking
// sends, request messages and their handler, errors sent back, and what the engine reports.
#include "ucx/engine_impl.hpp"

namespace stagelink::ucx {

namespace {
// Runs `start(done)` (which posts operations whose completion calls `done` once, from any thread)
// and waits for `done`. At the deadline the progress thread cancels what is under way, which
// completes it; the 5 s beyond it only guard against a completion that never comes.
template <class Start>
Status await_done(Start&& start, Deadline deadline, const char* what) {
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status st;
  };
  auto d = std::make_shared<Done>();
  start([d](Status st) {
    {
      std::lock_guard<std::mutex> l(d->mu);
      d->done = true;
      d->st = std::move(st);
    }
    d->cv.notify_all();
  });
  std::unique_lock<std::mutex> l(d->mu);
  if (!d->cv.wait_until(l, later(deadline, std::chrono::seconds(5)), [&] { return d->done; }))
    return make_error(Errc::timeout, std::string(what) + ": not complete before the deadline");
  return d->st;
}
}  // namespace

Status Engine::send(std::span<const std::byte> peer, uint64_t token, std::span<const std::byte> src,
                    Deadline deadline) {
  return await_done([&](std::function<void(Status)> done) { send_async(peer, token, src, deadline, std::move(done)); },
                    deadline, "sending to the receiver");
}

Status Engine::connect(std::span<const std::byte> peer, unsigned lanes, Deadline deadline) {
  auto& I = *impl_;
  if (I.closed) return make_error(Errc::closed, "transfer engine closed");
  lanes = lanes == 0 ? std::max(1u, I.opts.lanes) : std::min(lanes, std::max(1u, I.opts.lanes));
  std::vector<std::shared_ptr<Impl::Ep>> eps;
  for (unsigned i = 0; i < lanes; ++i) {
    SL_ASSIGN(auto ep, I.endpoint(peer, i));
    eps.push_back(std::move(ep));
  }
  return await_done(
      [&](std::function<void(Status)> done) {
        auto b = I.new_batch(deadline, "connecting to the peer", std::move(done));
        b->eps = eps;
        b->left += int(2 * lanes);  // an empty message and a flush per lane
        ucp_request_param_t rp = I.batch_param(b.get()), am = rp;
        am.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        am.flags = UCP_AM_SEND_FLAG_EAGER;
        // An empty request is a ping (the peer's engine drops it): it makes UCX finish wiring the
        // endpoint up, which a flush of an endpoint nothing was sent on may not wait for.
        for (auto& e : eps) I.track(b.get(), ucp_am_send_nbx(e->ep, Impl::kReqId, nullptr, 0, nullptr, 0, &am));
        for (auto& e : eps) I.track(b.get(), ucp_ep_flush_nbx(e->ep, &rp));
        I.op_finished(b.get(), UCS_OK);  // posted
        ucp_worker_signal(I.worker);      // the progress thread may be asleep
      },
      deadline, "connecting to the peer");
}

void Engine::send_error(std::span<const std::byte> peer, uint64_t token, const Error& e) {
  auto& I = *impl_;
  if (I.closed) return;
  auto ep = I.endpoint(peer, 0);
  if (!ep.ok()) return;
  auto b = I.new_batch(deadline_after(5), "replying an error", nullptr);
  b->eps = {ep.value()};
  b->hdrs = {{token, Impl::kErrPart, 0}};
  const std::string text = e.message.substr(0, 4000);
  b->body.resize(1 + text.size());
  b->body[0] = std::byte(uint8_t(e.code));
  std::memcpy(b->body.data() + 1, text.data(), text.size());
  b->left += 1;
  ucp_request_param_t rp = I.batch_param(b.get());
  I.track(b.get(), ucp_am_send_nbx(ep.value()->ep, Impl::kAmId, &b->hdrs[0], sizeof(Impl::ChunkHdr), b->body.data(),
                                   b->body.size(), &rp));
  I.op_finished(b.get(), UCS_OK);
  ucp_worker_signal(I.worker);
}

void Engine::on_request(std::function<void(std::span<const std::byte>)> handler) {
  impl_->req_handler = std::move(handler);
}

Status Engine::request(std::span<const std::byte> peer, std::span<const std::byte> msg, Deadline deadline) {
  auto& I = *impl_;
  if (I.closed) return make_error(Errc::closed, "transfer engine closed");
  SL_ASSIGN(auto ep, I.endpoint(peer, 0));
  auto op = std::make_shared<Op>();
  auto b = I.new_batch(deadline, "sending a request", [op](Status st) {
    Impl::complete(op, st.ok() ? UCS_OK : UCS_ERR_IO_ERROR);
  });
  b->eps = {ep};
  b->body.assign(msg.begin(), msg.end());
  b->left += 1;
  ucp_request_param_t rp = I.batch_param(b.get());
  rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  I.track(b.get(), ucp_am_send_nbx(ep->ep, Impl::kReqId, nullptr, 0, b->body.data(), b->body.size(), &rp));
  I.op_finished(b.get(), UCS_OK);
  std::unique_lock<std::mutex> l(op->mu);
  if (!op->done) {
    ucp_worker_signal(I.worker);
    if (!op->cv.wait_until(l, later(deadline, std::chrono::seconds(5)), [&] { return op->done; }))
      return make_error(Errc::timeout, "sending a request: not complete before the deadline");
  }
  if (op->status != UCS_OK) return make_error(Errc::peer_dead, "sending a request to the peer failed");
  return {};
}

Value Engine::info() const {
  Value::Map m;
  m.emplace_back("protocol", impl_->opts.protocol);
  m.emplace_back("device", impl_->opts.device.empty() ? std::string("any") : impl_->opts.device);
  std::string tls;
  if (impl_->ctx) {
    // What UCX selected: its context report, condensed to the transport/device lines.
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f) {
      ucp_context_print_info(impl_->ctx, f);
      std::fclose(f);
      std::string all(buf, len);
      std::free(buf);
      size_t pos = 0;
      while ((pos = all.find("md ", pos)) != std::string::npos) {
        size_t end = all.find('\n', pos);
        std::string line = all.substr(pos, end - pos);
        tls += (tls.empty() ? "" : "; ") + line;
        pos = end;
      }
    }
  }
  m.emplace_back("transports", tls);
  m.emplace_back("pool_bytes", uint64_t(impl_->size));
  m.emplace_back("pool_used", uint64_t(pool_used()));
  m.emplace_back("writes", uint64_t(impl_->writes.load()));
  m.emplace_back("write_bytes", uint64_t(impl_->write_bytes.load()));
  m.emplace_back("write_errors", uint64_t(impl_->write_errors.load()));
  {
    std::lock_guard<std::mutex> l(impl_->ep_mu);
    m.emplace_back("endpoints", uint64_t(impl_->eps.size()));  // one per peer and lane
  }
  m.emplace_back("endpoints_discarded", uint64_t(impl_->eps_discarded.load()));
  // Parts received: rendezvous (UCX moved them straight into the pool) or eager (copied once).
  m.emplace_back("parts_rendezvous", uint64_t(impl_->parts_rndv.load()));
  m.emplace_back("parts_eager", uint64_t(impl_->parts_eager.load()));
  return Value(std::move(m));
}

}  // namespace stagelink::ucx
