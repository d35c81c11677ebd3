// The metrics tree (include/stagelink/metrics.hpp): what the Connector base counts, what the
// tree gathers, what a connector that goes leaves behind, run-time metrics.
#include <gtest/gtest.h>

#include <random>

#include "shm_test_util.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using namespace shm_test;

namespace {
// The value of `name`'s sample with these label values (0 when absent); a histogram's count.
double sample(const std::string& name, const std::vector<std::string>& labels) {
  for (const auto& s : metrics::collect())
    if (s.family->name == name && s.labels == labels) return s.value;
  return 0;
}
bool has_sample(const std::string& name, const std::vector<std::string>& labels) {
  for (const auto& s : metrics::collect())
    if (s.family->name == name && s.labels == labels) return true;
  return false;
}
}  // namespace

TEST(Metrics, TimingBucketsCoverEveryDuration) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t dt = rng() >> (rng() % 64);
    const int b = metrics::Timing::index(dt);
    ASSERT_GE(b, 0);
    ASSERT_LT(b, metrics::Timing::kBuckets);
    if (b == metrics::Timing::kBuckets - 1) continue;  // the last bucket takes everything above
    ASSERT_LT(dt, metrics::Timing::upper(b)) << dt;
    if (b > 0) ASSERT_GE(dt, metrics::Timing::upper(b - 1)) << dt;
    // At most 25% wide (four per power of two).
    if (dt >= 4) ASSERT_LE(double(metrics::Timing::upper(b)), 1.25 * double(dt) + 1) << dt;
  }
}

namespace {
// Every put and get timed for one test (the default times one in metrics::time_every()).
struct TimeEveryCall {
  uint32_t was = metrics::time_every();
  TimeEveryCall() { metrics::set_time_every(1); }
  ~TimeEveryCall() { metrics::set_time_every(was); }
};
}  // namespace

TEST(Metrics, ConnectorCountsEveryPutGetAndErrorOnce) {
  TimeEveryCall every;
  const std::string ns = unique_ns("met");
  const double puts0 = sample("stagelink_connector_puts_total", {"SharedMemoryConnector"});
  const double gets0 = sample("stagelink_connector_gets_total", {"SharedMemoryConnector"});
  const double bytes0 = sample("stagelink_connector_put_bytes_total", {"SharedMemoryConnector"});
  const double miss0 = sample("stagelink_connector_get_misses_total", {"SharedMemoryConnector"});
  const double bad0 = sample("stagelink_connector_errors_total", {"SharedMemoryConnector", "put", "invalid_argument"});
  {
    auto c = make(extra(ns));
    ASSERT_TRUE(c);
    auto data = pattern(4096, 1);
    size_t frame_bytes = 0;
    for (int i = 0; i < 10; ++i) {
      auto p = c->put("a", "b", "k" + std::to_string(i), payload_of(data, 1));
      ASSERT_TRUE(p.ok()) << p.error().message;
      frame_bytes += p->size;
    }
    for (int i = 0; i < 7; ++i) ASSERT_TRUE(c->get("a", "b", "k" + std::to_string(i), nullptr).ok());
    EXPECT_EQ(c->get("a", "b", "absent", nullptr).error().code, Errc::not_found);
    EXPECT_EQ(c->put("a", "b", "", payload_of(data, 1)).error().code, Errc::invalid_argument);
    EXPECT_EQ(c->cleanup("k9"), 1u);

    EXPECT_EQ(sample("stagelink_connector_puts_total", {"SharedMemoryConnector"}) - puts0, 10);
    EXPECT_EQ(sample("stagelink_connector_gets_total", {"SharedMemoryConnector"}) - gets0, 7);
    EXPECT_EQ(sample("stagelink_connector_put_bytes_total", {"SharedMemoryConnector"}) - bytes0, double(frame_bytes));
    EXPECT_EQ(sample("stagelink_connector_get_misses_total", {"SharedMemoryConnector"}) - miss0, 1);
    EXPECT_EQ(sample("stagelink_connector_errors_total", {"SharedMemoryConnector", "put", "invalid_argument"}) - bad0, 1);
    EXPECT_GE(sample("stagelink_connector_put_seconds", {"SharedMemoryConnector"}), 10);  // a histogram's count
    EXPECT_EQ(sample("stagelink_shm_outstanding_entries", {"SharedMemoryConnector"}), 2);  // k7, k8 unread
    EXPECT_GT(sample("stagelink_shm_arena_used_bytes", {"SharedMemoryConnector"}), 0);
    EXPECT_EQ(sample("stagelink_connectors_open", {"SharedMemoryConnector"}), 1);

    // health() reads the same cells.
    Value h = c->health();
    EXPECT_EQ(h.find("puts")->as<uint64_t>(), 10u);
    EXPECT_EQ(h.find("gets")->as<uint64_t>(), 7u);
    EXPECT_EQ(h.find("errors")->as<uint64_t>(), 1u);  // the bad key; a miss is not an error
    EXPECT_EQ(h.find("cleanups")->as<uint64_t>(), 1u);
  }
  // Gone: its counters stay (no counter goes back), its gauges go.
  EXPECT_EQ(sample("stagelink_connector_puts_total", {"SharedMemoryConnector"}) - puts0, 10);
  EXPECT_EQ(sample("stagelink_connector_gets_total", {"SharedMemoryConnector"}) - gets0, 7);
  EXPECT_FALSE(has_sample("stagelink_connectors_open", {"SharedMemoryConnector"}));
  EXPECT_FALSE(has_sample("stagelink_shm_outstanding_entries", {"SharedMemoryConnector"}));
}

TEST(Metrics, HistogramBucketsAreCumulativeAndInSeconds) {
  TimeEveryCall every;
  const std::string ns = unique_ns("meth");
  auto c = make(extra(ns));
  ASSERT_TRUE(c);
  auto data = pattern(1024, 2);
  const double before = sample("stagelink_connector_put_seconds", {"SharedMemoryConnector"});  // earlier tests'
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(c->put("a", "b", "k" + std::to_string(i), payload_of(data, 2)).ok());
  for (const auto& s : metrics::collect()) {
    if (s.family->name != "stagelink_connector_put_seconds") continue;
    ASSERT_EQ(s.buckets.size(), metrics::bounds().size());
    for (size_t i = 1; i < s.buckets.size(); ++i) EXPECT_GE(s.buckets[i], s.buckets[i - 1]);
    EXPECT_EQ(double(s.buckets.back()), s.value);
    EXPECT_EQ(s.value - before, 50);
    EXPECT_GT(s.sum, 0);
    EXPECT_LT(s.sum, 1.0);  // puts of 1 KiB: far under a second in all
    return;
  }
  FAIL() << "no put histogram";
}

TEST(Metrics, DynamicMetricsCheckKindAndLabels) {
  auto c = metrics::Dynamic::get("test_requests_total", metrics::Kind::counter, "", "requests", {"stage"});
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->add({"a"}, 2).ok());
  ASSERT_TRUE((*c)->add({"a"}, 3).ok());
  EXPECT_EQ(sample("test_requests_total", {"a"}), 5);
  EXPECT_EQ((*c)->add({"a"}, -1).error().code, Errc::invalid_argument);  // a counter only goes up
  EXPECT_EQ((*c)->add({}, 1).error().code, Errc::invalid_argument);      // one value per label
  EXPECT_EQ((*c)->set({"a"}, 1).error().code, Errc::invalid_argument);   // not a gauge
  auto same = metrics::Dynamic::get("test_requests_total", metrics::Kind::counter, "", "requests", {"stage"});
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, *c);
  EXPECT_FALSE(metrics::Dynamic::get("test_requests_total", metrics::Kind::gauge, "", "", {"stage"}).ok());
  EXPECT_FALSE(metrics::Dynamic::get("stagelink_connector_puts_total", metrics::Kind::counter, "", "", {}).ok());
  EXPECT_FALSE(metrics::Dynamic::get("bad name", metrics::Kind::counter, "", "", {}).ok());
  // A cell found once counts into the same sample as the calls that look it up.
  auto cell = (*c)->cell({"b"});
  ASSERT_TRUE(cell.ok());
  EXPECT_EQ((*c)->cell({"b"}).value(), *cell);
  ASSERT_TRUE((*cell)->add(4).ok());
  ASSERT_TRUE((*c)->add({"b"}, 1).ok());
  EXPECT_EQ(sample("test_requests_total", {"b"}), 5);
  EXPECT_EQ((*cell)->add(-1).error().code, Errc::invalid_argument);
  EXPECT_FALSE((*c)->cell({"b", "c"}).ok());
  auto h = metrics::Dynamic::get("test_stage_seconds", metrics::Kind::histogram, "seconds", "", {});
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE((*h)->observe({}, 0.003).ok());
  ASSERT_TRUE((*h)->observe({}, 2.0).ok());
  EXPECT_EQ(sample("test_stage_seconds", {}), 2);
}

TEST(Metrics, EveryBuiltInFamilyFollowsPrometheusNaming) {
  auto fams = metrics::families();
  EXPECT_GE(fams.size(), 20u);
  for (const auto* f : fams) {
    if (f->name.rfind("test_", 0) == 0) continue;
    EXPECT_EQ(f->name.rfind("stagelink_", 0), 0u) << f->name;
    const bool total = f->name.size() > 6 && f->name.compare(f->name.size() - 6, 6, "_total") == 0;
    EXPECT_EQ(total, f->kind == metrics::Kind::counter) << f->name;
    if (f->kind == metrics::Kind::histogram) EXPECT_EQ(f->unit, "seconds") << f->name;
    if (!f->unit.empty()) EXPECT_NE(f->name.find("_" + f->unit), std::string::npos) << f->name;
    EXPECT_FALSE(f->help.empty()) << f->name;
  }
}

namespace {
// The sample of `name` whose labels start with `first` (a queue's own, whatever its tag).
double sample_where(const std::string& name, const std::string& label, size_t at, const std::string& value) {
  for (const auto& s : metrics::collect())
    if (s.family->name == name && s.labels.size() > at && s.labels[at] == value &&
        (label.empty() || s.labels[0] == label))
      return s.value;
  return -1;
}
std::string newest_queue() {
  std::string last;
  for (const auto& s : metrics::collect())
    if (s.family->name == "stagelink_mq_messages_total") last = s.labels[0];
  return last;  // the newest queue's (labels are per-process unique tags)
}
}  // namespace

TEST(Metrics, AQueueCountsItsDepthAndEachReadersLag) {
  MessageQueueOptions o;
  o.n_reader = o.n_local_reader = 2;
  o.max_chunks = 16;
  auto w = MessageQueue::create(o);
  ASSERT_TRUE(w.ok()) << w.error().message;
  auto r0 = MessageQueue::create_from_handle((*w)->export_handle(), 0);
  auto r1 = MessageQueue::create_from_handle((*w)->export_handle(), 1);
  ASSERT_TRUE(r0.ok() && r1.ok());
  ASSERT_TRUE((*w)->wait_until_ready(10).ok());
  const std::string q = newest_queue();
  ASSERT_FALSE(q.empty());
  std::vector<std::byte> msg(100, std::byte{7});
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*w)->enqueue_bytes(msg, 5).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*r0)->dequeue(5).ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE((*r1)->dequeue(5).ok());
  EXPECT_EQ(sample_where("stagelink_mq_messages_total", "", 0, q), 5);
  EXPECT_GE(sample_where("stagelink_mq_bytes_total", "", 0, q), 500);
  EXPECT_EQ(sample_where("stagelink_mq_depth", "", 0, q), 3);  // the slowest reader's backlog
  EXPECT_EQ(sample_where("stagelink_mq_reader_lag", q, 1, "0"), 0);
  EXPECT_EQ(sample_where("stagelink_mq_reader_lag", q, 1, "1"), 3);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*r1)->dequeue(5).ok());
  EXPECT_EQ(sample_where("stagelink_mq_depth", "", 0, q), 0);
  r0->reset();
  r1->reset();
  w->reset();
  EXPECT_EQ(sample_where("stagelink_mq_depth", "", 0, q), -1);  // a gauge goes with its queue
  EXPECT_EQ(sample_where("stagelink_mq_messages_total", "", 0, q), 5);  // a counter stays (never goes back)
}

TEST(Metrics, ControlInboxesCountWhatTheyReceiveAndDrop) {
  const std::string ep = "shm://tmet" + std::to_string(getpid());
  auto in = ControlInbox::bind(ep);
  ASSERT_TRUE(in.ok()) << in.error().message;
  auto out = ControlOutbox::connect(ep);
  ASSERT_TRUE(out.ok()) << out.error().message;
  const double sub0 = sample("stagelink_control_messages_received_total", {"submit"});
  const double bad0 = sample("stagelink_control_messages_dropped_total", {});
  ControlMessage m;
  m.type = ControlType::submit;
  m.request_id = "r";
  ASSERT_TRUE((*out)->send(m, 5).ok());
  ASSERT_TRUE((*out)->send(m, 5).ok());
  const std::byte junk[] = {std::byte{0xc1}, std::byte{0xff}};
  ASSERT_TRUE((*out)->send_bytes(junk, 5).ok());
  ASSERT_TRUE((*in)->recv(5).ok());
  ASSERT_TRUE((*in)->recv(5).ok());
  EXPECT_EQ((*in)->recv(5).error().code, Errc::corrupt);
  EXPECT_EQ(sample("stagelink_control_messages_received_total", {"submit"}) - sub0, 2);
  EXPECT_EQ(sample("stagelink_control_messages_dropped_total", {}) - bad0, 1);
  EXPECT_TRUE(has_sample("stagelink_curve_peers_refused_total", {}));
  EXPECT_TRUE(has_sample("stagelink_pickle_refused_total", {}));
}

TEST(Metrics, PutsAndGetsAreCountedExactlyAndTimedOneInEight) {
  ASSERT_EQ(metrics::time_every(), 8u);  // the default (no STAGELINK_METRICS_TIME_EVERY in the tests)
  const std::string ns = unique_ns("mets");
  auto c = make(extra(ns));
  ASSERT_TRUE(c);
  auto data = pattern(512, 3);
  const double puts0 = sample("stagelink_connector_puts_total", {"SharedMemoryConnector"});
  const double timed0 = sample("stagelink_connector_put_seconds", {"SharedMemoryConnector"});
  for (int i = 0; i < 800; ++i) {
    ASSERT_TRUE(c->put("a", "b", "k", payload_of(data, 3)).ok());
    ASSERT_TRUE(c->get("a", "b", "k", nullptr).ok());
  }
  EXPECT_EQ(sample("stagelink_connector_puts_total", {"SharedMemoryConnector"}) - puts0, 800);
  // Puts and gets have a count each per thread (alternating, one count would time only gets):
  // one put in 8 timed.
  const double timed = sample("stagelink_connector_put_seconds", {"SharedMemoryConnector"}) - timed0;
  EXPECT_GE(timed, 800 / 8 - 1);
  EXPECT_LE(timed, 800 / 8 + 1);
}
