// TransferEngineConnector / MooncakeTransferEngineConnector: see te_connector.cpp.
#pragma once
#include <memory>
#include <string>

#include "stagelink/connector.hpp"

namespace stagelink {
Result<std::unique_ptr<Connector>> make_te_connector(const std::string& name, const Value& extra);
// Its `extra` read as make_te_connector reads it, without making anything.
Status check_te_options(const Value& extra);
}  // namespace stagelink
