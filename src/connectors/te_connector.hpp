// TransferEngineConnector / MooncakeTransferEngineConnector: see te_connector.cpp.
#pragma once
#include <memory>
#include <string>

#include "stagelink/connector.hpp"

namespace stagelink {
Result<std::unique_ptr<Connector>> make_te_connector(const std::string& name, const Value& extra);
// Its descriptor (names, schema, traits, factory), registered by factory.cpp.
ConnectorDescriptor te_connector_descriptor();
}  // namespace stagelink
