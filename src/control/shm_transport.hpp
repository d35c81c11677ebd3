// The shared-memory control transport (`shm://NAME`): see shm_transport.cpp.
#pragma once
#include <memory>
#include <string>

#include "stagelink/control.hpp"

namespace stagelink {
Result<std::unique_ptr<ControlInbox>> bind_shm_inbox(const std::string& endpoint);
Result<std::unique_ptr<ControlOutbox>> connect_shm_outbox(const std::string& endpoint);
}  // namespace stagelink
