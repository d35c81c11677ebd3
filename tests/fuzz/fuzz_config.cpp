// libFuzzer: the vLLM-Omni transfer config loader (YAML from users and deployment tools).
#include <cstdint>
#include <string>

#include "stagelink/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)stagelink::load_transfer_config_string(std::string(reinterpret_cast<const char*>(data), size), "<fuzz>");
  return 0;
}
