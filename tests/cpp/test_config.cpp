#include <gtest/gtest.h>

#include "stagelink/config.hpp"

using namespace stagelink;

static const char* kSeedShm = R"(
runtime:
  connectors:
    connector_of_shared_memory:
      name: SharedMemoryConnector
      extra:
        shm_threshold_bytes: 65536
stage_args:
  - stage_id: 0
    output_connectors:
      to_stage_1: connector_of_shared_memory
  - stage_id: 1
    engine_input_source: [0]
    input_connectors:
      from_stage_0: connector_of_shared_memory
  - stage_id: 2
    engine_input_source: [1]
)";

TEST(Config, SeedSharedMemoryExampleAndDefaultFill) {
  auto c = load_transfer_config_string(kSeedShm, "seed.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_EQ(c->edges.size(), 2u);
  EXPECT_EQ(c->connector_for_edge("0", "1").name, "SharedMemoryConnector");
  EXPECT_EQ(c->connector_for_edge("0", "1").ref, "connector_of_shared_memory");
  const Value* thr = c->connector_for_edge("0", "1").extra.find("shm_threshold_bytes");
  ASSERT_TRUE(thr);
  int64_t v;
  ASSERT_TRUE(thr->get_i64(v));
  EXPECT_EQ(v, 65536);
  auto* e = c->edge("1", "2");
  ASSERT_TRUE(e);
  EXPECT_TRUE(e->defaulted);
  EXPECT_EQ(e->connector.name, "SharedMemoryConnector");
}

TEST(Config, SeedTransferEngineRolesAndPorts) {
  const char* y = R"(
runtime:
  connectors:
    rdma_connector:
      name: MooncakeTransferEngineConnector
      extra: {host: "auto", zmq_port: 50051, protocol: "rdma", memory_pool_size: 4294967296, memory_pool_device: "cpu"}
stage_args:
  - stage_id: 0
    output_connectors: {to_stage_1: rdma_connector}
  - stage_id: 1
    input_connectors: {from_stage_0: rdma_connector}
    output_connectors: {to_stage_2: rdma_connector}
  - stage_id: 2
    input_connectors: {from_stage_1: rdma_connector}
)";
  auto c = load_transfer_config_string(y, "te.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  auto s0 = c->stage_connectors("0");
  ASSERT_EQ(s0.size(), 1u);
  EXPECT_EQ(s0[0].role, Role::sender);
  EXPECT_EQ(s0[0].connector.extra.find("role")->as<std::string>(), "sender");
  auto s1 = c->stage_connectors("1");
  ASSERT_EQ(s1.size(), 2u);
  for (auto& sc : s1) EXPECT_EQ(sc.role, Role::dual);
  auto s2 = c->stage_connectors("2");
  EXPECT_EQ(s2[0].role, Role::receiver);
  EXPECT_EQ(transfer_engine_port(50051, PortPurpose::kv_transfer, 0, 1, 2, 1), 50154);
  EXPECT_EQ(transfer_engine_port(50051, PortPurpose::orchestrator, 0), 50251);
}

TEST(Config, NewSchemaInlineConnectorsAndRuntimeEdges) {
  const char* y = R"(
connectors:
  store: {name: MooncakeStoreConnector, extra: {host: 127.0.0.1, master: "127.0.0.1:50051"}}
stages:
  - stage_id: encoder
    output_connectors:
      to_stage_thinker: {name: SharedMemoryConnector, extra: {shm_threshold_bytes: 1024}}
  - stage_id: thinker
    output_connectors: {to_stage_talker: store}
runtime:
  edges:
    - {from: talker, to: vocoder}
)";
  auto c = load_transfer_config_string(y, "new.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->edges.size(), 3u);
  EXPECT_EQ(c->connector_for_edge("encoder", "thinker").ref, "");
  EXPECT_EQ(c->connector_for_edge("thinker", "talker").name, "MooncakeStoreConnector");
  EXPECT_TRUE(c->edge("talker", "vocoder")->defaulted);
}

TEST(Config, MismatchedEndsAreAnError) {
  const char* y = R"(
runtime:
  connectors:
    a: {name: SharedMemoryConnector}
    b: {name: MooncakeStoreConnector}
stage_args:
  - stage_id: 0
    output_connectors: {to_stage_1: a}
  - stage_id: 1
    input_connectors: {from_stage_0: b}
)";
  auto c = load_transfer_config_string(y, "bad.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("same connector type"), std::string::npos);
  EXPECT_NE(c.error().message.find("bad.yaml"), std::string::npos);
}

TEST(Config, ErrorsQuoteKeyAndFile) {
  struct Case {
    const char* yaml;
    const char* file;
    std::vector<const char*> expected;  // substrings of the message
  };
  const Case cases[] = {
      {"runtime: [unclosed", "x.yaml", {"x.yaml"}},
      {"stage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: nope}\n", "y.yaml",
       {"y.yaml:3", "stage_args[0].output_connectors.to_stage_1", "'nope'"}},
      {"stage_args:\n  - stage_id: 0\n    output_connectors: {stage1: {name: X}}\n", "z.yaml", {"z.yaml:3", "to_stage_"}},
      {"runtime:\n  connectors:\n    c: {extra: {}}\n", "w.yaml", {"w.yaml", "runtime.connectors.c.name"}},
      {"runtime: 3\n", "v.yaml", {"v.yaml:1", "'runtime'", "must be a map"}},
  };
  for (const Case& c : cases) {
    auto r = load_transfer_config_string(c.yaml, c.file);
    ASSERT_FALSE(r.ok()) << c.file;
    EXPECT_EQ(r.error().code, Errc::invalid_argument) << c.file;
    for (const char* want : c.expected) EXPECT_NE(r.error().message.find(want), std::string::npos) << r.error().message;
  }
  auto missing = load_transfer_config_file("/nonexistent/stagelink.yaml");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Errc::not_found);
}
