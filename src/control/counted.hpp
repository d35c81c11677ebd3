// What a control inbox received, counted once (core/counts.hpp): a message by its type, or a
// malformed one dropped.
#pragma once
#include "core/counts.hpp"
#include "stagelink/control.hpp"

namespace stagelink {

inline Result<ControlMessage> counted(Result<ControlMessage> r) {
  if (r.ok())
    counts::control_received(size_t(r->type));
  else if (r.error().code == Errc::corrupt)
    counts::control_dropped();
  return r;
}

}  // namespace stagelink
