// StoreConnector (Redis, Redis Cluster): see store_connector.cpp.
#pragma once
#include <memory>
#include <string>

#include "stagelink/connector.hpp"

namespace stagelink {
Result<std::unique_ptr<Connector>> make_store_connector(const std::string& name, const Value& extra);
}  // namespace stagelink
