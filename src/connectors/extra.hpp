// Reading a connector's `extra` map (internal): a missing or null key keeps the default (true);
// a value of the wrong type is false (the caller names the keys in its error).
#pragma once
#include <cctype>
#include <cstdlib>
#include <string>

#include "stagelink/payload.hpp"

namespace stagelink {

inline bool extra_string(const Value& e, const char* k, std::string& out) {
  const Value* v = e.find(k);
  if (!v || v->is_nil()) return true;
  if (!v->is<std::string>()) return false;
  out = v->as<std::string>();
  return true;
}
inline bool extra_number(const Value& e, const char* k, double& out) {
  const Value* v = e.find(k);
  if (!v || v->is_nil()) return true;
  if (v->is<double>()) {
    out = v->as<double>();
    return true;
  }
  int64_t i;
  if (v->get_i64(i)) {
    out = double(i);
    return true;
  }
  if (v->is<std::string>()) {  // "64GB"-style sizes (the seed's memory_pool_size form), env-expanded numbers
    const std::string& s = v->as<std::string>();
    char* end = nullptr;
    double d = std::strtod(s.c_str(), &end);
    std::string unit(end ? end : "");
    for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
    const double mul = unit == "" || unit == "B"       ? 1
                       : unit == "KB" || unit == "KIB" ? 1024.0
                       : unit == "MB" || unit == "MIB" ? 1048576.0
                       : unit == "GB" || unit == "GIB" ? 1073741824.0
                                                       : -1;
    if (mul < 0 || end == s.c_str()) return false;
    out = d * mul;
    return true;
  }
  return false;
}

}  // namespace stagelink
