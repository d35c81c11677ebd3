// SharedMemoryConnector's loans (shm_impl.hpp): room in the arena written in place, then published;
// a loan may outlive its connector (LoanGate).
#include "connectors/shm_impl.hpp"

namespace stagelink {

// ---- Loans ----
struct Loan::Impl {
  std::shared_ptr<LoanGate> gate;
  FramePlan plan;
  std::byte* base = nullptr;
  size_t offset = 0, length = 0;
  std::shared_ptr<Segment> dedicated;  // a segment of its own; else `arena` holds the mapping
  std::shared_ptr<Segment> arena;      // keeps region() writable after the connector closed
  // Only for a segment of its own: to remove it if the connector is gone when the loan drops.
  std::shared_ptr<Directory> dir;
  std::string shm_dir;
  uint32_t arena_idx = 0, arena_gen = 0;
  bool published = false;
  ForkStamp fork;  // a loan inherited through fork() is the parent's memory
  ~Impl() {
    if (published || !gate || fork.inherited()) return;
    std::lock_guard<std::mutex> g(gate->mu);  // close() cannot finish meanwhile
    if (gate->owner) {
      gate->owner->return_loan(offset, length, dedicated, arena_idx, arena_gen);
    } else if (dedicated) {  // the connector is gone: its arena went with it, this segment did not
      dir->unregister_arena(arena_idx, arena_gen);
      Segment::unlink(shm_dir, dedicated->name());
    }
  }
};

Loan::Loan() = default;
Loan::Loan(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Loan::Loan(Loan&&) noexcept = default;
Loan& Loan::operator=(Loan&&) noexcept = default;
Loan::~Loan() = default;
size_t Loan::tensor_count() const { return impl_ ? impl_->plan.offsets.size() : 0; }
std::span<std::byte> Loan::region(size_t i) {
  if (!impl_ || i >= impl_->plan.offsets.size()) return {};
  return std::span<std::byte>(impl_->base + impl_->plan.offsets[i], impl_->plan.lengths[i]);
}
size_t Loan::frame_size() const { return impl_ ? impl_->plan.total : 0; }

Result<Loan> ShmConnector::loan(const Value& tree, std::span<const TensorSpec> specs) {
  SL_ASSIGN(FramePlan plan, plan_frame(tree, specs));
  std::unique_lock<std::mutex> lock(mu_);
  if (!open_locked()) return make_error(Errc::closed, "loan on a closed SharedMemoryConnector");
  SL_ASSIGN(Region reg, allocate_locked(lock, plan.total, mono_ns()));
  auto impl = std::make_unique<Loan::Impl>();
  impl->gate = gate_;
  if (reg.dedicated) {
    impl->dir = dir_;
    impl->shm_dir = opts_.shm_dir;
  } else {
    impl->arena = arena_;
  }
  impl->base = reg.base;
  impl->offset = reg.offset;
  impl->length = reg.length;
  impl->dedicated = reg.dedicated;
  impl->arena_idx = reg.arena_idx;
  impl->arena_gen = reg.arena_gen;
  write_frame_head(plan, reg.base);
  impl->plan = std::move(plan);
  return Loan(std::move(impl));
}

Result<PutResult> ShmConnector::put_loan(const std::string& from, const std::string& to, const std::string& key,
                                         Loan&& loan, const PutOptions& po) {
  const uint64_t t0 = metrics::timed_start(0);
  auto r = put_loan_impl(from, to, key, std::move(loan), po);
  count_put(r, t0);
  return r;
}

Result<PutResult> ShmConnector::put_loan_impl(const std::string& from, const std::string& to, const std::string& key,
                                              Loan&& loan, const PutOptions& po) {
  auto* impl = loan.impl();
  if (!impl || impl->gate != gate_)
    return make_error(Errc::invalid_argument, "loan is empty or belongs to another connector");
  SL_TRY(validate_edge(from, to, key, po.request_id));
  const uint32_t readers = po.readers ? po.readers : opts_.readers;
  if (readers < 1 || readers > shm::kMaxFanout)
    return make_error(Errc::invalid_argument, "readers must be in [1, 8]");
  const InternalKey ikey(key, from, to);
  if (impl->fork.inherited())
    return make_error(Errc::invalid_argument, "put_loan: the loan was taken before fork(), in the parent process, "
                                              "whose memory it is; take a new loan in this process");
  std::unique_lock<std::mutex> lock(mu_);
  if (!open_locked()) return make_error(Errc::closed, "put_loan on a closed SharedMemoryConnector");
  const uint64_t now = mono_ns();
  SL_ASSIGN(Claim cl, reserve_locked(ikey, uint16_t(key.size()), po.request_id, now));
  impl->published = true;
  Region reg{impl->base, impl->offset, impl->length, impl->dedicated, impl->arena_idx, impl->arena_gen};
  std::span<const std::byte> inl;
  if (impl->plan.total <= opts_.shm_threshold_bytes) inl = std::span<const std::byte>(impl->base, impl->plan.total);
  auto r = publish_locked(cl, reg, impl->plan.total, readers, inl, now, po.hooks ? &po.hooks->inline_sink : nullptr);
  lock.unlock();
  loan = Loan();
  return r;
}

std::unique_ptr<Loan::Impl> Loan::release_impl() { return std::move(impl_); }

}  // namespace stagelink
