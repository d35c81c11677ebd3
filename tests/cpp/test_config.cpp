#include <gtest/gtest.h>

#include "stagelink/config.hpp"

#include <algorithm>

#include "core/options.hpp"
#include "stagelink/connector.hpp"
#include "stagelink/relay.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

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
  const ConnectorSpec spec = c->connector_for_edge("0", "1");  // by value: find() points into it
  const Value* thr = spec.extra.find("shm_threshold_bytes");
  ASSERT_TRUE(thr);
  int64_t v;
  ASSERT_TRUE(thr->get_i64(v));
  EXPECT_EQ(v, 65536);
  auto* e = c->edge("1", "2");
  ASSERT_TRUE(e);
  EXPECT_TRUE(e->defaulted);
  EXPECT_EQ(e->connector.name, "SharedMemoryConnector");
  // As vLLM-Omni's loader: a defaulted edge's extra carries the default threshold, which the
  // loader takes (its default_shm_threshold).
  const Value* dthr = e->connector.extra.find("shm_threshold_bytes");
  ASSERT_TRUE(dthr && dthr->get_i64(v));
  EXPECT_EQ(v, 65536);
  auto small = load_transfer_config_string(kSeedShm, "seed.yaml", 1024);
  ASSERT_TRUE(small.ok()) << small.error().message;
  ASSERT_TRUE(small->edge("1", "2")->connector.extra.find("shm_threshold_bytes")->get_i64(v));
  EXPECT_EQ(v, 1024);
  ASSERT_TRUE(small->connector_for_edge("0", "1").extra.find("shm_threshold_bytes")->get_i64(v));
  EXPECT_EQ(v, 65536);  // a declared connector keeps its own
  ASSERT_TRUE(small->connector_for_edge("7", "8").extra.find("shm_threshold_bytes")->get_i64(v));
  EXPECT_EQ(v, 1024);
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

TEST(Config, ValuesAlreadyReadLoadAsTheirTextWould) {
  // Issue 62: a caller that parsed its file itself hands the values over, not text.
  auto m = [](std::initializer_list<std::pair<std::string, Value>> kv) {
    Value::Map out;
    for (auto& [k, v] : kv) out.emplace_back(k, v);
    return Value(std::move(out));
  };
  const Value root = m({{"connectors", m({{"c1", m({{"name", Value("SharedMemoryConnector")},
                                                    {"extra", m({{"namespace", Value("123")},
                                                                 {"ttl_s", Value(60.5)},
                                                                 {"readers", Value(int64_t(2))}})}})}})},
                        {"edges", Value(Value::List{m({{"from", Value("a")}, {"to", Value("b")},
                                                       {"connector", Value("c1")}})})}});
  auto c = load_transfer_config_value(root, "p.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const ConnectorSpec spec = c->connector_for_edge("a", "b");
  ASSERT_EQ(spec.name, "SharedMemoryConnector");
  const Value* ns = spec.extra.find("namespace");
  ASSERT_TRUE(ns && ns->is<std::string>());  // a string that looks like a number stays a string
  EXPECT_EQ(ns->as<std::string>(), "123");
  const Value* ttl = spec.extra.find("ttl_s");
  ASSERT_TRUE(ttl && ttl->is<double>());
  EXPECT_EQ(ttl->as<double>(), 60.5);
  int64_t readers = 0;
  ASSERT_TRUE(spec.extra.find("readers")->get_i64(readers));
  EXPECT_EQ(readers, 2);
  // An error names the source and the key, and no line (the values carry none).
  const Value bad = m({{"edges", Value(Value::List{m({{"from", Value("a")}, {"to", Value("b")},
                                                      {"connector", Value("nope")}})})}});
  auto e = load_transfer_config_value(bad, "p.yaml");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().message.rfind("p.yaml: ", 0), 0u) << e.error().message;
  EXPECT_NE(e.error().message.find("nope"), std::string::npos) << e.error().message;
  EXPECT_FALSE(load_transfer_config_value(m({{"edges", Value::copy_bytes(std::vector<std::byte>(3))}}), "p.yaml").ok());
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
  for (const char* want : {"bad.yaml", "edge 0 -> 1", "stage 0", "stage 1", "name (SharedMemoryConnector vs MooncakeStoreConnector)"})
    EXPECT_NE(c.error().message.find(want), std::string::npos) << c.error().message;
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
      // A partial entry is an error only where it is referenced.
      {"runtime:\n  connectors:\n    c: {extra: {}}\nstage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: c}\n",
       "w.yaml", {"w.yaml", "runtime.connectors.c.name", "referenced by stage_args[0].output_connectors.to_stage_1"}},
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

TEST(Config, PartialUnreferencedConnectorIsNotAnError) {
  auto c = load_transfer_config_string("runtime:\n  connectors:\n    c: {extra: {}}\n", "p.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
}

TEST(Config, UserRoleIsKeptMissingRoleIsInjected) {
  const char* y = R"(
runtime:
  connectors:
    te: {name: MooncakeTransferEngineConnector, extra: {role: receiver, zmq_port: 50051}}
    plain: {name: MooncakeTransferEngineConnector, extra: {zmq_port: 50052}}
stage_args:
  - stage_id: 0
    output_connectors: {to_stage_1: te, to_stage_2: plain}
)";
  auto c = load_transfer_config_string(y, "r.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  for (auto& sc : c->stage_connectors("0")) {
    const std::string role = sc.connector.extra.find("role")->as<std::string>();
    if (sc.peer == "1") {
      EXPECT_EQ(role, "receiver");  // regression: was overwritten with "sender"
      EXPECT_EQ(sc.role, Role::receiver);
    } else {
      EXPECT_EQ(role, "sender");
    }
  }
}

TEST(Config, AnEdgeDeclaredTwiceMergesWhenEqualAndFailsNamingTheDifference) {
  auto two = [](const char* out_extra, const char* in_extra) {
    return std::string("stage_args:\n  - stage_id: 0\n    output_connectors:\n      to_stage_1: {name: SharedMemoryConnector, extra: ") +
           out_extra + "}\n  - stage_id: 1\n    input_connectors:\n      from_stage_0: {name: SharedMemoryConnector, extra: " +
           in_extra + "}\n";
  };
  auto ok = load_transfer_config_string(two("{shm_threshold_bytes: 1024, role: sender}", "{shm_threshold_bytes: 1024, role: receiver}"), "m.yaml");
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  ASSERT_EQ(ok->edges.size(), 1u);
  EXPECT_EQ(ok->edges[0].connector.extra.find("role")->as<std::string>(), "sender");  // first in stage order
  // The first declaration is kept as it stands (vLLM-Omni 0.30.0): a role only a later one sets
  // is not taken over; each side gets its direction's.
  auto role_from_second = load_transfer_config_string(two("{a: 1}", "{a: 1, role: receiver}"), "m2.yaml");
  ASSERT_TRUE(role_from_second.ok());
  const Value* r2 = role_from_second->edges[0].connector.extra.find("role");
  EXPECT_TRUE(!r2 || r2->is_nil());
  EXPECT_EQ(role_from_second->stage_connectors("0").at(0).role, Role::sender);
  EXPECT_EQ(role_from_second->stage_connectors("1").at(0).role, Role::receiver);
  struct Case { const char *out, *in, *key; };
  for (const Case& k : {Case{"{shm_threshold_bytes: 1024}", "{shm_threshold_bytes: 2048}", "extra.shm_threshold_bytes"},
                        Case{"{a: 1}", "{a: 1, b: null}", "extra.b"},  // missing vs None: different
                        Case{"{a: 1, c: x}", "{a: 1}", "extra.c"}}) {
    auto bad = load_transfer_config_string(two(k.out, k.in), "d.yaml");
    ASSERT_FALSE(bad.ok()) << k.key;
    for (const char* want : {"edge 0 -> 1", "stage 0", "stage 1", k.key})
      EXPECT_NE(bad.error().message.find(want), std::string::npos) << bad.error().message;
  }
}

TEST(Config, AReceivingStageListedFirstIsNeverToldTheSendersRole) {
  // Issue 53: the input side first in stage order, `role: sender` only on the output side. Both
  // declarations are otherwise equal; the receiving stage used to be told role=sender.
  const char* y = R"(
stage_args:
  - stage_id: 1
    input_connectors:
      from_stage_0: {name: MooncakeTransferEngineConnector, extra: {zmq_port: 50051}}
  - stage_id: 0
    output_connectors:
      to_stage_1: {name: MooncakeTransferEngineConnector, extra: {zmq_port: 50051, role: sender}}
)";
  auto cfg = load_transfer_config_string(y, "r.yaml");
  ASSERT_TRUE(cfg.ok()) << cfg.error().message;
  auto rx = cfg->stage_connectors("1");
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].role, Role::receiver);
  EXPECT_EQ(rx[0].connector.extra.find("role")->as<std::string>(), "receiver");
  auto tx = cfg->stage_connectors("0");
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].role, Role::sender);
}

TEST(Config, TopLevelEdgesAndRuntimeConnectorsWin) {
  const char* y = R"(
connectors:
  shared: {name: SharedMemoryConnector, extra: {shm_threshold_bytes: 1}}
  only_top: {name: SharedMemoryConnector, extra: {shm_threshold_bytes: 3}}
runtime:
  connectors:
    shared: {name: SharedMemoryConnector, extra: {shm_threshold_bytes: 2}}
stages:
  - stage_id: 0
  - stage_id: 1
  - stage_id: 2
edges:
  - {from: 0, to: 1, connector: shared}
  - {from_stage: 1, to_stage: 2, connector: only_top}
  - {from: 2, to: 3}
)";
  auto c = load_transfer_config_string(y, "e.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_EQ(c->edges.size(), 3u);
  int64_t v = 0;
  ASSERT_TRUE(c->connector_for_edge("0", "1").extra.find("shm_threshold_bytes")->get_i64(v));
  EXPECT_EQ(v, 2);  // runtime.connectors wins
  ASSERT_TRUE(c->connector_for_edge("1", "2").extra.find("shm_threshold_bytes")->get_i64(v));
  EXPECT_EQ(v, 3);
  EXPECT_TRUE(c->edge("2", "3")->defaulted);
  ASSERT_EQ(c->notes.size(), 1u);
  EXPECT_NE(c->notes[0].find("'shared'"), std::string::npos) << c->notes[0];
  EXPECT_NE(c->notes[0].find("runtime.connectors.shared is used"), std::string::npos) << c->notes[0];
}

TEST(Config, EnvironmentVariablesAreExpanded) {
  setenv("SL_TEST_PORT", "50123", 1);
  setenv("SL_TEST_HOST", "10.1.2.3", 1);
  unsetenv("SL_TEST_UNSET");
  const char* y = R"(
runtime:
  connectors:
    te:
      name: MooncakeTransferEngineConnector
      extra:
        zmq_port: ${SL_TEST_PORT}
        host: "${SL_TEST_HOST}"
        proto: ${SL_TEST_UNSET:-tcp}
        note: "a-${SL_TEST_PORT}-b"
stage_args:
  - stage_id: 0
    output_connectors: {to_stage_1: te}
)";
  auto c = load_transfer_config_string(y, "env.yaml");
  ASSERT_TRUE(c.ok()) << c.error().message;
  const Value& x = c->connector_for_edge("0", "1").extra;
  int64_t port = 0;
  ASSERT_TRUE(x.find("zmq_port")->get_i64(port));  // a number once expanded
  EXPECT_EQ(port, 50123);
  EXPECT_EQ(x.find("host")->as<std::string>(), "10.1.2.3");
  EXPECT_EQ(x.find("proto")->as<std::string>(), "tcp");
  EXPECT_EQ(x.find("note")->as<std::string>(), "a-50123-b");
  // The YAML loaders take only ${...}: a bare $ (a password, say) stays as written.
  auto lit = load_transfer_config_string("runtime:\n  connectors:\n    a:\n      name: X\n      extra: {pw: \"p$SL_TEST_HOST\"}\n"
                                         "stage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: a}\n", "lit.yaml");
  ASSERT_TRUE(lit.ok()) << lit.error().message;
  EXPECT_EQ(lit->connector_for_edge("0", "1").extra.find("pw")->as<std::string>(), "p$SL_TEST_HOST");
  // One value, as MooncakeStoreConnector's host takes it (bare: vLLM-Omni's $VAR too).
  EXPECT_EQ(expand_env_value("10.2.1.$SL_TEST_PORT", "host", "x", true).value(), "10.2.1.50123");
  EXPECT_EQ(expand_env_value("$SL_TEST_HOST:${SL_TEST_UNSET:-7}", "host", "x", true).value(), "10.1.2.3:7");
  EXPECT_EQ(expand_env_value("$SL_TEST_HOST", "host", "x", false).value(), "$SL_TEST_HOST");
  EXPECT_EQ(expand_env_value("a$ b$1 c$", "host", "x", true).value(), "a$ b$1 c$");
  EXPECT_EQ(expand_env_value("$SL_TEST_UNSET", "host", "x", true).error().code, Errc::invalid_argument);
  EXPECT_EQ(expand_env_value("${SL_TEST_HOST", "host", "x", true).error().code, Errc::invalid_argument);
  auto bad = load_transfer_config_string("runtime:\n  connectors:\n    a:\n      name: X\n      extra:\n        port: ${SL_TEST_UNSET}\n", "u.yaml");
  ASSERT_FALSE(bad.ok());
  for (const char* want : {"u.yaml", "runtime.connectors.a.extra.port", "SL_TEST_UNSET"})
    EXPECT_NE(bad.error().message.find(want), std::string::npos) << bad.error().message;
}

TEST(Config, BaseConfigOverlaysMergeRelativeToTheFileAndRefuseCycles) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("slcfg" + std::to_string(getpid()));
  fs::create_directories(dir / "deploy");
  auto write = [&](const fs::path& p, const char* text) { std::ofstream(p) << text; };
  write(dir / "base.yaml", R"(
runtime:
  connectors:
    te: {name: MooncakeTransferEngineConnector, extra: {zmq_port: 50051, protocol: rdma}}
stage_args:
  - stage_id: 0
    output_connectors: {to_stage_1: te}
  - stage_id: 1
    input_connectors: {from_stage_0: te}
)");
  write(dir / "deploy" / "tcp.yaml", R"(
base_config: ../base.yaml
runtime:
  connectors:
    te: {extra: {protocol: tcp}}
    unused: {extra: {x: 1}}
stage_args:
  - stage_id: 1
    output_connectors: {to_stage_2: te}
)");
  auto c = load_transfer_config_file((dir / "deploy" / "tcp.yaml").string());
  ASSERT_TRUE(c.ok()) << c.error().message;
  const Value& x = c->connector_for_edge("0", "1").extra;
  EXPECT_EQ(c->connector_for_edge("0", "1").name, "MooncakeTransferEngineConnector");
  EXPECT_EQ(x.find("protocol")->as<std::string>(), "tcp");  // the overlay wins
  int64_t port = 0;
  ASSERT_TRUE(x.find("zmq_port")->get_i64(port));
  EXPECT_EQ(port, 50051);  // the base's, kept
  EXPECT_EQ(c->edges.size(), 2u);  // stage 1 merged by id: its input kept, an output added
  EXPECT_EQ(c->connector_for_edge("1", "2").name, "MooncakeTransferEngineConnector");
  write(dir / "a.yaml", "base_config: b.yaml\n");
  write(dir / "b.yaml", "base_config: a.yaml\n");
  auto cyc = load_transfer_config_file((dir / "a.yaml").string());
  ASSERT_FALSE(cyc.ok());
  EXPECT_NE(cyc.error().message.find("cycle"), std::string::npos) << cyc.error().message;
  write(dir / "c.yaml", "base_config: missing.yaml\n");
  auto missing = load_transfer_config_file((dir / "c.yaml").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("missing.yaml"), std::string::npos);
  fs::remove_all(dir);
}

// Found by tests/fuzz/fuzz_config: `base_config` naming a directory threw std::ios_base::failure
// out of yaml-cpp's LoadFile (no YAML::Exception), which ended the process. The fuzzer's input.
TEST(Config, BaseConfigNamingADirectoryIsAnErrorNotACrash) {
  const std::string crash("base_config:\n  / \n\xff\xff" "a~\xff\xff\xff: []\nlare\xff" "d", 36);
  auto r = load_transfer_config_string(crash, "<fuzz>");
  ASSERT_FALSE(r.ok());
  auto d = load_transfer_config_string("base_config: /tmp\n", "<string>");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.error().code, Errc::invalid_argument) << d.error().to_string();
  EXPECT_NE(d.error().message.find("is not a file"), std::string::npos) << d.error().message;
}

// Issue 53: one reader of option maps, one error style naming the owner and the key.
TEST(Options, OneReaderOneErrorStyleForEveryOwner) {
  using namespace stagelink::options;
  static constexpr Key keys[] = {
      {"threshold_bytes", Type::size, "64 KiB", "t", 0, 1u << 30},
      {"readers", Type::integer, "1", "r", 1, 8},
      {"timeout_s", Type::number, "5", "s", 0, 1e9},
      {"mode", Type::choice, "a", "m", 0, 0, "a|b"},
      {"on", Type::boolean, "false", "o"},
      {"name", Type::string, "", "n"},
  };
  static constexpr Schema open_schema{"Thing", "extra.", keys};
  static constexpr Schema closed_schema{"thing config", "", keys, true};
  auto map = [](Value::Map m) { return Value(std::move(m)); };
  // Types, ranges, choices: each error names owner and key, what it must be and what it got.
  struct Bad { Value::Map m; const char* want; };
  for (const Bad& b : {Bad{{{"readers", Value(int64_t(9))}}, "Thing: extra.readers must be an integer in [1, 8], got 9"},
                       Bad{{{"readers", Value(2.5)}}, "extra.readers must be an integer in [1, 8], got 2.5"},
                       Bad{{{"timeout_s", Value("soon")}}, "extra.timeout_s must be a number in [0, 1000000000], got 'soon'"},
                       Bad{{{"mode", Value("c")}}, "extra.mode must be one of: a b, got 'c'"},
                       Bad{{{"on", Value(int64_t(1))}}, "extra.on must be true or false, got 1"},
                       Bad{{{"name", Value(int64_t(1))}}, "extra.name must be a string, got 1"},
                       Bad{{{"threshold_bytes", Value("lots")}}, "extra.threshold_bytes must be a size in bytes"}}) {
    auto r = Reader::open(open_schema, map(b.m));
    ASSERT_TRUE(r.ok());
    double d = 0;
    std::string s;
    bool o = false;
    Status st = r->read("readers", d);
    if (st.ok()) st = r->read("timeout_s", d);
    if (st.ok()) st = r->read("threshold_bytes", d);
    if (st.ok()) st = r->read("mode", s);
    if (st.ok()) st = r->read("on", o);
    if (st.ok()) st = r->read("name", s);
    ASSERT_FALSE(st.ok()) << b.want;
    EXPECT_EQ(st.error().code, Errc::invalid_argument);
    EXPECT_NE(st.error().message.find(b.want), std::string::npos) << st.error().message;
  }
  // Numbers as strings (a config's "${PORT}"), sizes with units; a missing or null key keeps the default.
  auto r = Reader::open(open_schema, map({{"readers", Value("4")}, {"threshold_bytes", Value("2MiB")},
                                          {"timeout_s", Value()}}));
  ASSERT_TRUE(r.ok());
  uint32_t readers = 1;
  size_t thr = 0;
  double t = 5;
  ASSERT_TRUE(r->read_int("readers", readers).ok());
  ASSERT_TRUE(r->read_int("threshold_bytes", thr).ok());
  ASSERT_TRUE(r->read("timeout_s", t).ok());
  EXPECT_EQ(readers, 4u);
  EXPECT_EQ(thr, size_t(2) << 20);
  EXPECT_EQ(t, 5.0);
  // A near miss of a known key is a typo: refused with the key meant. Another key is left alone
  // (vLLM-Omni's callers add their own, e.g. stage_id) and reported; a closed schema refuses it.
  auto typo = Reader::open(open_schema, map({{"treshold_bytes", Value(int64_t(1))}}));
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.error().message.find("Thing: unknown key 'extra.treshold_bytes'; did you mean 'threshold_bytes'?"),
            std::string::npos) << typo.error().message;
  auto other = Reader::open(open_schema, map({{"stage_id", Value(int64_t(3))}}));
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->unused(), std::vector<std::string>{"stage_id"});
  auto closed = Reader::open(closed_schema, map({{"stage_id", Value(int64_t(3))}}));
  ASSERT_FALSE(closed.ok());
  EXPECT_NE(closed.error().message.find("thing config: unknown key 'stage_id' (known: threshold_bytes, readers"),
            std::string::npos) << closed.error().message;
  EXPECT_FALSE(Reader::open(open_schema, Value("x")).ok());
  EXPECT_TRUE(Reader::open(open_schema, Value()).ok());
  // Every connector and the relay declared theirs.
  std::vector<std::string> owners;
  for (const auto& d : connectors())
    if (d.schema) owners.emplace_back(d.schema->owner);
  owners.emplace_back(relay_schema().owner);
  for (const char* o : {"SharedMemoryConnector", "TransferEngineConnector", "StoreConnector", "relay config"})
    EXPECT_NE(std::find(owners.begin(), owners.end(), o), owners.end()) << o;
}

TEST(Options, ConnectorsReportTheKeysTheyDoNotRead) {
  auto c = create_connector("SharedMemoryConnector",
                            Value(Value::Map{{"namespace", Value("optsreport" + std::to_string(getpid()))},
                                             {"stage_id", Value(int64_t(2))}, {"vendor_knob", Value(true)}}));
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  const Value h = c.value()->health();
  const Value* ig = h.find("ignored_extra_keys");
  ASSERT_TRUE(ig && ig->is<Value::List>());
  ASSERT_EQ(ig->as<Value::List>().size(), 1u);  // stage_id is a known key (vLLM-Omni's)
  EXPECT_EQ(ig->as<Value::List>()[0].as<std::string>(), "vendor_knob");
  auto typo = create_connector("SharedMemoryConnector", Value(Value::Map{{"shm_treshold_bytes", Value(int64_t(1))}}));
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.error().message.find("did you mean 'shm_threshold_bytes'"), std::string::npos) << typo.error().message;
  c.value()->close();
}
