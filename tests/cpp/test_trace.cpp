// Trace context and spans (include/stagelink/trace.hpp): W3C traceparent parsing, the spans the
// Connector base and the relay record for sampled calls (and only those), the control message's
// traceparent field.
#include <gtest/gtest.h>

#include <thread>

#include "shm_test_util.hpp"
#include "stagelink/stagelink.hpp"

using namespace stagelink;
using namespace shm_test;

namespace {
const std::string kSampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const std::string kUnsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

// Recording on for one test, and nothing left over from another.
struct Recording {
  Recording() {
    trace::set_recording(true);
    trace::drain();
  }
  ~Recording() {
    trace::set_recording(false);
    trace::drain();
  }
};
}  // namespace

TEST(Trace, ParsesAndFormatsW3CTraceparent) {
  auto c = trace::parse(kSampled);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->trace_hi, 0x4bf92f3577b34da6ULL);
  EXPECT_EQ(c->trace_lo, 0xa3ce929d0e0e4736ULL);
  EXPECT_EQ(c->span, 0x00f067aa0ba902b7ULL);
  EXPECT_TRUE(c->sampled());
  EXPECT_EQ(trace::format(*c), kSampled);
  EXPECT_FALSE(trace::parse(kUnsampled)->sampled());
  // What the specification calls invalid: ignored.
  for (const std::string bad :
       {"", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",          // short
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",           // another version
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",           // uppercase
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",           // zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",           // zero span id
        "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",           // separator
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01"})          // not hex
    EXPECT_FALSE(trace::parse(bad)) << bad;
  EXPECT_NE(trace::new_id(), 0u);
  EXPECT_NE(trace::new_id(), trace::new_id());
}

TEST(Trace, ConnectorRecordsSpansOfSampledCallsOnly) {
  Recording on;
  const std::string ns = unique_ns("trc");
  auto c = make(extra(ns));
  ASSERT_TRUE(c);
  auto data = pattern(4096, 3);
  PutOptions po;
  po.traceparent = kSampled;
  po.request_id = "req-7";
  ASSERT_TRUE(c->put("a", "b", "k1", payload_of(data, 1), po).ok());
  PutOptions unsampled;
  unsampled.traceparent = kUnsampled;
  ASSERT_TRUE(c->put("a", "b", "k2", payload_of(data, 1), unsampled).ok());
  ASSERT_TRUE(c->put("a", "b", "k3", payload_of(data, 1)).ok());
  GetOptions go;
  go.traceparent = kSampled;
  ASSERT_TRUE(c->get("a", "b", "k1", nullptr, kNoWait, go).ok());
  EXPECT_EQ(c->get("a", "b", "absent", nullptr, kNoWait, go).error().code, Errc::not_found);
  auto spans = trace::drain();
  ASSERT_EQ(spans.size(), 3u);  // the sampled put, get and failed get; nothing for k2 and k3
  const auto& put = spans[0];
  EXPECT_EQ(put.name, "connector.put");
  EXPECT_EQ(put.cat, "connector");
  EXPECT_EQ(put.trace_hi, 0x4bf92f3577b34da6ULL);
  EXPECT_EQ(put.parent_id, 0x00f067aa0ba902b7ULL);
  EXPECT_NE(put.span_id, 0u);
  EXPECT_EQ(put.request_id, "req-7");
  EXPECT_LE(put.start_ns, put.end_ns);
  EXPECT_EQ(put.args.find("key")->as<std::string>(), "k1");
  EXPECT_EQ(put.args.find("connector")->as<std::string>(), "SharedMemoryConnector");
  EXPECT_GT(put.args.find("bytes")->as<uint64_t>(), 4096u);
  EXPECT_EQ(spans[1].name, "connector.get");
  EXPECT_LE(put.end_ns, spans[1].start_ns);
  EXPECT_EQ(spans[2].name, "connector.get");
  ASSERT_NE(spans[2].args.find("error"), nullptr);
  EXPECT_NE(spans[2].args.find("error")->as<std::string>().find("not_found"), std::string::npos);

  // Recording off: a sampled call records nothing.
  trace::set_recording(false);
  ASSERT_TRUE(c->put("a", "b", "k4", payload_of(data, 1), po).ok());
  EXPECT_TRUE(trace::drain().empty());
}

TEST(Trace, RelayRecordsACreditWait) {
  Recording on;
  RelayConfig rc;
  rc.credits = 1;
  rc.timeout_s = 5;
  rc.slot_size_mb = 1;
  Value::Map e;
  e.emplace_back("namespace", unique_ns("trr"));
  rc.extra = Value(std::move(e));
  auto relay = Relay::create(rc);
  ASSERT_TRUE(relay.ok()) << relay.error().message;
  auto& r = *relay.value();
  auto data = pattern(100000, 5);
  RelayPutOptions o{.request_id = "r1", .traceparent = kSampled, .edge = "x"};
  auto first = r.put_async(payload_of(data, 1), o);
  ASSERT_TRUE(first.ok());
  const Value md = first->metadata();
  std::thread reader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    RelayGetOptions go{.request_id = "r1"};
    go.traceparent = kSampled;
    ASSERT_TRUE(r.get_async(md, go).ok());
  });
  auto second = r.put_async(payload_of(data, 1), o);  // waits for the first's credit
  reader.join();
  ASSERT_TRUE(second.ok());
  auto spans = trace::drain();
  int waits = 0, puts = 0, gets = 0;
  for (const auto& s : spans) {
    if (s.name == "relay.credit_wait") {
      ++waits;
      EXPECT_GE(s.end_ns - s.start_ns, 50'000'000u);  // the reader's 100 ms, less a scheduling margin
      EXPECT_EQ(s.args.find("outcome")->as<std::string>(), "credit");
      EXPECT_EQ(s.args.find("edge")->as<std::string>(), "x");
    }
    puts += s.name == "connector.put";
    gets += s.name == "connector.get";
  }
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(puts, 2);
  EXPECT_EQ(gets, 1);
}

TEST(Trace, ControlMessagesCarryAValidTraceparentOnly) {
  ControlMessage m;
  m.type = ControlType::data_ready;
  m.request_id = "r";
  m.traceparent = kSampled;
  auto wire = encode_control(m);
  ASSERT_TRUE(wire.ok());
  auto back = decode_control(*wire);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->traceparent, kSampled);
  EXPECT_EQ(*back, m);
  m.traceparent = "00-nothex";
  EXPECT_EQ(encode_control(m).error().code, Errc::invalid_argument);
  // A malformed one on the wire (another sender's) is dropped; the message is kept.
  Value::Map v;
  v.emplace_back("v", uint64_t(1));
  v.emplace_back("t", "data_ready");
  v.emplace_back("rid", "r");
  v.emplace_back("tp", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01");
  auto raw = value_to_msgpack(Value(std::move(v)));
  auto got = decode_control(raw);
  ASSERT_TRUE(got.ok()) << got.error().message;
  EXPECT_EQ(got->request_id, "r");
  EXPECT_TRUE(got->traceparent.empty());
}
