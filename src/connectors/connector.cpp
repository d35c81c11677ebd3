// The Connector base: what every connector counts in its non-virtual put/get/cleanup, and those
// counts as health()'s common keys and as samples of the metrics tree.
#include <mutex>

#include "stagelink/connector.hpp"

namespace stagelink {
namespace {

using metrics::Family;
using metrics::Kind;

const Family kPuts{"stagelink_connector_puts_total", Kind::counter, "", "puts that succeeded", {"connector"}};
const Family kGets{"stagelink_connector_gets_total", Kind::counter, "", "gets that succeeded", {"connector"}};
const Family kPutBytes{"stagelink_connector_put_bytes_total", Kind::counter, "bytes",
                       "frame bytes of the puts that succeeded", {"connector"}};
const Family kGetBytes{"stagelink_connector_get_bytes_total", Kind::counter, "bytes",
                       "frame bytes of the gets that succeeded", {"connector"}};
const Family kErrors{"stagelink_connector_errors_total", Kind::counter, "",
                     "puts and gets that failed, by operation and error code (a get's not_found is a miss)",
                     {"connector", "op", "code"}};
const Family kMisses{"stagelink_connector_get_misses_total", Kind::counter, "",
                     "gets that found nothing in one attempt (not_found)", {"connector"}};
const Family kPutTime{"stagelink_connector_put_seconds", Kind::histogram, "seconds",
                      "time of a put that succeeded", {"connector"}};
const Family kGetTime{"stagelink_connector_get_seconds", Kind::histogram, "seconds",
                      "time of a get that succeeded, its wait for the key included", {"connector"}};
const Family kCleanups{"stagelink_connector_cleanups_total", Kind::counter, "", "cleanup() calls", {"connector"}};
const Family kCleaned{"stagelink_connector_cleaned_entries_total", Kind::counter, "",
                      "unread puts cleanup() released", {"connector"}};
const Family kOpen{"stagelink_connectors_open", Kind::gauge, "", "connectors of this process not yet destroyed",
                   {"connector"}};

}  // namespace

uint64_t ConnectorCounts::errors() const {
  uint64_t n = 0;
  for (size_t c = 0; c < 16; ++c) {
    if (c == size_t(Errc::timeout)) continue;
    n += put_errors[c].value();
    if (c != size_t(Errc::not_found)) n += get_errors[c].value();
  }
  return n;
}

uint64_t ConnectorCounts::timeouts() const {
  return put_errors[size_t(Errc::timeout)].value() + get_errors[size_t(Errc::timeout)].value();
}

class Connector::Metrics final : public metrics::Source {
 public:
  explicit Metrics(const ConnectorCounts& c) : c_(c), reg_(this) {}
  ~Metrics() override { reg_.reset(); }
  void set_label(std::string l) {
    std::lock_guard<std::mutex> g(mu_);
    label_ = std::move(l);
  }
  std::string label() const {
    std::lock_guard<std::mutex> g(mu_);
    return label_;
  }
  void collect(metrics::Sink& out) const override {
    std::string l;
    {
      std::lock_guard<std::mutex> g(mu_);
      l = label_;
    }
    out.value(kPuts, {l}, double(c_.puts()));
    out.value(kGets, {l}, double(c_.gets()));
    out.value(kPutBytes, {l}, double(c_.put_bytes.value()));
    out.value(kGetBytes, {l}, double(c_.get_bytes.value()));
    for (size_t i = 1; i < 16; ++i) {
      const char* code = errc_name(Errc(i));
      if (uint64_t n = c_.put_errors[i].value()) out.value(kErrors, {l, "put", code}, double(n));
      if (uint64_t n = c_.get_errors[i].value(); n && Errc(i) != Errc::not_found)
        out.value(kErrors, {l, "get", code}, double(n));
    }
    out.value(kMisses, {l}, double(c_.get_errors[size_t(Errc::not_found)].value()));
    out.timing(kPutTime, {l}, c_.put_time);
    out.timing(kGetTime, {l}, c_.get_time);
    out.value(kCleanups, {l}, double(c_.cleanups.value()));
    out.value(kCleaned, {l}, double(c_.cleaned.value()));
    out.value(kOpen, {l}, 1);
  }

 private:
  const ConnectorCounts& c_;
  mutable std::mutex mu_;
  std::string label_ = "unnamed";
  metrics::Registration reg_;  // last: registered once the rest is made, gone first
};

Connector::Connector() : metrics_(std::make_unique<Metrics>(counts_)) {}
Connector::~Connector() = default;

void Connector::set_metrics_label(std::string label) { metrics_->set_label(std::move(label)); }
std::string Connector::metrics_label() const { return metrics_->label(); }

void Connector::trace_call(const char* op, std::string_view traceparent, uint64_t w0, const std::string& from_stage,
                           const std::string& to_stage, const std::string& key, std::string_view request_id,
                           size_t bytes, const Error* error) const {
  if (!trace::recording()) return;
  Value::Map a;
  a.emplace_back("connector", metrics_label());
  a.emplace_back("from", from_stage);
  a.emplace_back("to", to_stage);
  a.emplace_back("key", key);
  a.emplace_back("bytes", uint64_t(bytes));
  if (error) a.emplace_back("error", error->to_string());
  trace::record_under(traceparent, op, "connector", w0, request_id, Value(std::move(a)));
}

void Connector::add_counts(Value::Map& m) const {
  m.emplace_back("puts", counts_.puts());
  m.emplace_back("gets", counts_.gets());
  m.emplace_back("bytes_transferred", counts_.put_bytes.value() + counts_.get_bytes.value());
  m.emplace_back("errors", counts_.errors());
  m.emplace_back("timeouts", counts_.timeouts());
  m.emplace_back("cleanups", counts_.cleanups.value());
}

}  // namespace stagelink
