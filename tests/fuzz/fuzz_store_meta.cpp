// libFuzzer: the record a store get reads first (any client of the Redis server may write it).
#include <cstdint>
#include <string_view>

#include "connectors/store_connector.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)stagelink::check_store_meta(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
