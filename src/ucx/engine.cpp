// See engine.hpp.
#include "ucx/engine.hpp"

#include "ucx/engine_impl.hpp"

namespace stagelink::ucx {

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { close(); }
void Engine::close() { impl_->shutdown(); }

Result<std::shared_ptr<Engine>> Engine::create(const EngineOptions& o) {
  if (o.protocol != "tcp" && o.protocol != "rdma" && o.protocol != "shm" && o.protocol != "any")
    return make_error(Errc::invalid_argument, "protocol '" + o.protocol + "' is not one of tcp, rdma, shm, any");
  if (o.pool_bytes == 0) return make_error(Errc::invalid_argument, "memory_pool_size must be positive");
  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  Status st = impl->init();
  if (!st.ok()) {
    impl->shutdown();
    return std::move(st).error();
  }
  return std::shared_ptr<Engine>(new Engine(std::move(impl)));
}

std::byte* Engine::pool_base() const { return impl_->base; }
size_t Engine::pool_size() const { return impl_->size; }
bool Engine::cuda_memory() const {
  ucp_context_attr_t a{};
  a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  return impl_->ctx && ucp_context_query(impl_->ctx, &a) == UCS_OK && (a.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
}
const std::vector<std::byte>& Engine::worker_address() const { return impl_->addr; }

size_t Engine::pool_used() const {
  std::lock_guard<std::mutex> l(impl_->pool_mu);
  return impl_->alloc ? impl_->alloc->used() : 0;
}

Result<size_t> Engine::allocate(size_t n, Deadline deadline) {
  std::unique_lock<std::mutex> l(impl_->pool_mu);
  for (;;) {
    if (impl_->closed) return make_error(Errc::closed, "transfer engine closed");
    if (n > impl_->size)
      return make_error(Errc::exhausted, "a payload of " + std::to_string(n) + " bytes exceeds the memory pool (" +
                                             std::to_string(impl_->size) + " bytes; raise memory_pool_size)");
    auto r = impl_->alloc->allocate(n);
    if (r.ok()) return r;
    if (impl_->pool_cv.wait_until(l, deadline) == std::cv_status::timeout)
      return make_error(Errc::exhausted, "memory pool has no room for " + std::to_string(n) + " bytes (" +
                                             std::to_string(impl_->alloc->used()) + " of " +
                                             std::to_string(impl_->size) + " in use)");
  }
}

void Engine::free(size_t offset, size_t n) {
  {
    std::lock_guard<std::mutex> l(impl_->pool_mu);
    if (impl_->alloc) {
      auto st = impl_->alloc->free(offset, n);
      if (!st.ok()) SL_LOG_ERROR("pool free: %s", st.error().to_string().c_str());
    }
  }
  impl_->pool_cv.notify_all();
}

void Engine::expect(uint64_t token, std::byte* dst, size_t len, std::shared_ptr<void> keep) {
  auto p = std::make_shared<Impl::Pending>();
  p->dst = dst;
  p->len = len;
  p->keep = std::move(keep);
  if (len >= Impl::kBusyMinBytes) {
    p->awaited.store(true);
    impl_->awaiting.fetch_add(1);
  }
  std::lock_guard<std::mutex> l(impl_->pend_mu);
  auto& slot = impl_->pending[token];
  if (slot) impl_->settle(*slot);
  slot = std::move(p);
}

void Engine::forget(uint64_t token) {
  std::lock_guard<std::mutex> l(impl_->pend_mu);
  auto it = impl_->pending.find(token);
  if (it == impl_->pending.end()) return;
  impl_->settle(*it->second);
  impl_->pending.erase(it);  // a receive under way keeps its own reference (and the keep)
}

Status Engine::wait_landed(uint64_t token, Deadline deadline, std::span<const std::byte> watch) {
  std::shared_ptr<Impl::Pending> p;
  {
    std::lock_guard<std::mutex> l(impl_->pend_mu);
    auto it = impl_->pending.find(token);
    if (it == impl_->pending.end()) return make_error(Errc::not_found, "no transfer expected for this token");
    p = it->second;
  }
  Status st;
  {
    std::unique_lock<std::mutex> l(p->op->mu);
    bool dead = false;
    while (!p->op->done && !dead && Clock::now() < deadline) {
      // In slices while a peer is watched: its endpoint failing ends the wait.
      const Deadline until = watch.empty() ? deadline : std::min(deadline, Clock::now() + std::chrono::milliseconds(20));
      p->op->cv.wait_until(l, until, [&] { return p->op->done; });
      if (!p->op->done && !watch.empty()) {
        l.unlock();
        dead = impl_->ep_failed(watch);
        l.lock();
      }
    }
    if (!p->op->done && dead)
      st = make_error(Errc::peer_dead, "the sender's engine is unreachable");
    else if (!p->op->done)
      st = make_error(Errc::timeout, "the payload did not arrive before the deadline");
    else if (p->remote)
      st = *p->remote;
    else if (p->op->status != UCS_OK)
      st = ucs_error("receiving the payload", p->op->status);
  }
  forget(token);
  return st;
}

void Engine::send_async(std::span<const std::byte> peer, uint64_t token, std::span<const std::byte> src,
                        Deadline deadline, std::function<void(Status)> done) {
  auto& I = *impl_;
  if (I.closed) return done(make_error(Errc::closed, "transfer engine closed"));
  // Parts: one per lane, each at least lane_min_bytes (a small payload goes whole on lane 0).
  const size_t lanes = std::max<size_t>(1, std::min<size_t>(I.opts.lanes, src.size() / std::max<size_t>(1, I.opts.lane_min_bytes)));
  const size_t part = (src.size() + lanes - 1) / lanes;
  std::vector<std::shared_ptr<Impl::Ep>> eps;
  for (size_t i = 0; i < lanes; ++i) {
    auto ep = I.endpoint(peer, unsigned(i));
    if (!ep.ok()) return done(std::move(ep).error());
    eps.push_back(std::move(ep).value());
  }
  auto b = I.new_batch(deadline, "sending to the receiver", std::move(done), src.size());
  b->eps = eps;
  b->hdrs.resize(lanes);
  b->left += int(2 * lanes);  // a send and a flush per lane
  ucp_request_param_t rp = I.batch_param(b.get());
  for (size_t i = 0; i < lanes; ++i) {
    const size_t off = std::min(src.size(), i * part), n = std::min(part, src.size() - off);
    b->hdrs[i] = {token, off, src.size()};
    I.track(b.get(), ucp_am_send_nbx(eps[i]->ep, Impl::kAmId, &b->hdrs[i], sizeof(Impl::ChunkHdr), src.data() + off,
                                     n, &rp));
  }
  for (size_t i = 0; i < lanes; ++i) I.track(b.get(), ucp_ep_flush_nbx(eps[i]->ep, &rp));
  I.op_finished(b.get(), UCS_OK);  // posted
  ucp_worker_signal(I.worker);      // the progress thread may be asleep
}

}  // namespace stagelink::ucx
