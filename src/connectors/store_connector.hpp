// StoreConnector (Redis, Redis Cluster): see store_connector.cpp.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "stagelink/connector.hpp"

namespace stagelink {
Result<std::unique_ptr<Connector>> make_store_connector(const std::string& name, const Value& extra);
// Its descriptor (names, schema, traits, factory), registered by factory.cpp.
ConnectorDescriptor store_connector_descriptor();
// Whether `bytes` is a put's meta record as a get reads it from the store (untrusted: any client
// of the server may have written it). Errors: corrupt. The fuzz target's entry point.
Status check_store_meta(std::string_view bytes);
}  // namespace stagelink
