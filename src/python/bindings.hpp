// The binding's facades, one translation unit each, and what they share.
#pragma once
#include "core/curve_config.hpp"
#include "python/common.hpp"

namespace stagelink::py {

void bind_connector(nb::module_& m);
void bind_mq(nb::module_& m);
void bind_control(nb::module_& m);
void bind_relay(nb::module_& m);
void bind_tools(nb::module_& m);  // calls bind_bench
void bind_bench(nb::module_& m);

// A MessageQueue's `curve=` dict as its CURVE settings (bind_control.cpp); nullopt for None.
std::optional<CurveConfig> mq_curve(nb::handle d);

}  // namespace stagelink::py
