// TransferEngineConnector / MooncakeTransferEngineConnector: see te_connector.cpp.
#pragma once
#include <memory>
#include <string>

#include "stagelink/connector.hpp"

namespace stagelink {
Result<std::unique_ptr<Connector>> make_te_connector(const std::string& name, const Value& extra);
}  // namespace stagelink
