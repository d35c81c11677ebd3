#include "core/counts.hpp"

#include "stagelink/control.hpp"
#include "stagelink/metrics.hpp"

namespace stagelink::counts {

namespace {
using metrics::Family;
using metrics::Kind;
const Family kCurveRefused{"stagelink_curve_peers_refused_total", Kind::counter, "",
                           "peers refused at the CURVE handshake (a key not allowed, or none) on any CURVE socket "
                           "of this process: control inboxes, queue readers' sockets, transfer-engine side channels",
                           {}};
const Family kConnRefused{"stagelink_zmq_connections_refused_total", Kind::counter, "",
                          "connections shut at once, over a socket's connection limit (what strangers can hold "
                          "is bounded)",
                          {}};
const Family kControlIn{"stagelink_control_messages_received_total", Kind::counter, "",
                        "control messages this process's inboxes received, by type", {"type"}};
const Family kControlDropped{"stagelink_control_messages_dropped_total", Kind::counter, "",
                             "control messages received malformed or over the size limit, and dropped (the "
                             "inbox goes on)",
                             {}};
const Family kPickleRefused{"stagelink_pickle_refused_total", Kind::counter, "",
                            "payloads holding a pickled object refused unread (allow_pickle off)", {}};

struct Counts : metrics::Source {
  metrics::Counter curve, conn, dropped, pickle;
  metrics::Counter received[kControlTypeCount];
  metrics::Registration reg{this};
  void collect(metrics::Sink& out) const override {
    out.value(kCurveRefused, {}, double(curve.value()));
    out.value(kConnRefused, {}, double(conn.value()));
    out.value(kControlDropped, {}, double(dropped.value()));
    out.value(kPickleRefused, {}, double(pickle.value()));
    for (int i = 0; i < kControlTypeCount; ++i)
      if (const uint64_t n = received[i].value())
        out.value(kControlIn, {control_type_name(ControlType(i))}, double(n));
  }
};
Counts& c() {
  static Counts* p = new Counts;  // never destroyed: sockets may count during exit
  return *p;
}
const bool kRegistered = (c(), true);  // in the tree from the start (zeros are samples too)
}  // namespace

void curve_refused() noexcept { c().curve.add(); }
void connection_refused() noexcept { c().conn.add(); }
void control_received(size_t type) noexcept {
  if (type < size_t(kControlTypeCount)) c().received[type].add();
}
void control_dropped() noexcept { c().dropped.add(); }
void pickle_refused() noexcept { c().pickle.add(); }

}  // namespace stagelink::counts
