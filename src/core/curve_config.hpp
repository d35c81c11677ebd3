// CURVE keys from a connector's or queue's `extra.curve` map (internal):
//   curve: {secret_key: Z85 | secret_key_file: PATH, public_key: Z85 (else derived),
//           server_key: Z85 (else this key's public: a key the whole deployment shares),
//           allowed_clients: [Z85, ...] (else this key's public)}
// A secret key file must be this user's and unreadable by others (as ssh insists).
#pragma once
#include <optional>
#include <string>

#include "stagelink/curve.hpp"
#include "stagelink/payload.hpp"

namespace stagelink {

struct CurveConfig {
  CurveServer server;  // for a socket that binds
  CurveClient client;  // for a socket that connects
};

// nullopt when `extra` has no `curve` (or it is null). Errors: invalid_argument naming the key,
// permission_denied (a key file others may read), unsupported (no CURVE in libzmq).
Result<std::optional<CurveConfig>> curve_from_extra(const Value& extra, const std::string& who);

}  // namespace stagelink
