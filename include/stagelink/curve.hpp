// CurveZMQ keys for the sockets that leave the host (control plane over TCP, the transfer
// engine's side channel, the message queue's remote readers): each end has a key pair; a server
// admits only the client public keys it lists, and a client checks the server's public key, so
// both ends are authenticated and every message is encrypted.
#pragma once
#include <string>
#include <vector>

#include "stagelink/result.hpp"

namespace stagelink {

// Keys are Z85 text: 40 characters for 32 bytes.
struct CurveKeyPair {
  std::string public_key, secret_key;
  bool operator==(const CurveKeyPair&) const = default;
};

// A fresh key pair. Errors: unsupported (libzmq built without CURVE).
Result<CurveKeyPair> curve_keypair();
// The public key of a secret key. Errors: invalid_argument (not 40 Z85 characters), unsupported.
Result<std::string> curve_public_of(const std::string& secret_key);

// A serving (bound) socket: its own key pair and the public keys of the clients it admits (at
// least one). A client with any other key is refused at the handshake and counted.
struct CurveServer {
  CurveKeyPair keys;
  std::vector<std::string> allowed_clients;
};
// A connecting socket: its own key pair and the public key of the server it expects.
struct CurveClient {
  CurveKeyPair keys;
  std::string server_key;
};

// Errors: invalid_argument naming the key that is not 40 Z85 characters, or an empty allow list.
Status check_curve(const CurveServer& s);
Status check_curve(const CurveClient& c);

}  // namespace stagelink
