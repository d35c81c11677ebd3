// Host addressing (internal): the address other hosts reach this one on.
#pragma once
#include <string>

namespace stagelink::net {
// This host's address for peers on other hosts, found without sending anything: the
// STAGELINK_HOST_IP or VLLM_HOST_IP environment variable when set, else the first IPv4 address
// of an interface that is up and not loopback, else 127.0.0.1.
std::string host_address();
}  // namespace stagelink::net
