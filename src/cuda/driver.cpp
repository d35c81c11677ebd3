// See driver.hpp.
#include "cuda/driver.hpp"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace stagelink::cuda {
namespace {

struct Loaded {
  Driver d{};
  bool ok = false;
  std::string why;  // when not ok
};

// Binds `name` (or, first, `name` + "_v2") from `lib` into `slot`; false when neither exists.
template <class F>
bool bind(void* lib, F& slot, const char* name, bool v2) {
  void* p = nullptr;
  if (v2) p = ::dlsym(lib, (std::string(name) + "_v2").c_str());
  if (!p) p = ::dlsym(lib, name);
  slot = reinterpret_cast<F>(p);
  return p != nullptr;
}

Loaded load() {
  Loaded L;
  // STAGELINK_CUDA=0 turns the GPU paths off (host staging and pickle-free copies still work).
  if (const char* env = std::getenv("STAGELINK_CUDA"); env && std::string(env) == "0") {
    L.why = "CUDA is turned off (STAGELINK_CUDA=0)";
    return L;
  }
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = ::dlerror();
    L.why = std::string("no CUDA driver here (libcuda.so.1 not loadable: ") + (e ? e : "not found") + ")";
    return L;
  }
  Driver& d = L.d;
  std::string missing;
  auto need = [&](auto& slot, const char* name, bool v2 = false) {
    if (!bind(lib, slot, name, v2)) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  // Each entry point named once: its member and the symbol it binds (SL_NEED_V2: the _v2 export
  // where the driver has both).
#define SL_NEED(f) need(d.f, #f)
#define SL_NEED_V2(f) need(d.f, #f, true)
  SL_NEED(cuInit); SL_NEED(cuDriverGetVersion); SL_NEED(cuDeviceGetCount); SL_NEED(cuDeviceGet);
  SL_NEED(cuDeviceGetName); SL_NEED(cuDevicePrimaryCtxRetain); SL_NEED(cuCtxSetCurrent);
  SL_NEED(cuCtxGetCurrent); SL_NEED(cuMemHostUnregister); SL_NEED(cuMemcpyAsync); SL_NEED(cuStreamCreate);
  SL_NEED(cuStreamSynchronize); SL_NEED(cuStreamWaitEvent); SL_NEED(cuEventCreate); SL_NEED(cuEventRecord);
  SL_NEED(cuEventSynchronize); SL_NEED(cuEventQuery); SL_NEED(cuIpcGetMemHandle); SL_NEED(cuIpcCloseMemHandle);
  SL_NEED(cuIpcGetEventHandle); SL_NEED(cuIpcOpenEventHandle); SL_NEED(cuPointerGetAttribute);
  SL_NEED(cuGetErrorName); SL_NEED(cuGetErrorString); SL_NEED(cuDeviceCanAccessPeer);
  SL_NEED_V2(cuMemGetAddressRange);
  SL_NEED_V2(cuDeviceGetUuid); SL_NEED_V2(cuDeviceTotalMem); SL_NEED_V2(cuDevicePrimaryCtxRelease);
  SL_NEED_V2(cuMemAlloc); SL_NEED_V2(cuMemFree); SL_NEED_V2(cuMemHostRegister); SL_NEED_V2(cuMemcpyDtoDAsync);
  SL_NEED_V2(cuMemcpyHtoDAsync); SL_NEED_V2(cuMemcpyDtoHAsync); SL_NEED_V2(cuStreamDestroy);
  SL_NEED_V2(cuEventDestroy); SL_NEED_V2(cuIpcOpenMemHandle);
#undef SL_NEED
#undef SL_NEED_V2
  if (!missing.empty()) {
    L.why = "the CUDA driver lacks " + missing + " (too old?)";
    return L;  // the library stays loaded: unloading a driver is not worth its risks
  }
  if (CUresult r = d.cuInit(0); r != kSuccess) {
    const char* name = nullptr;
    d.cuGetErrorName(r, &name);
    L.why = std::string("the CUDA driver did not start (cuInit: ") + (name ? name : std::to_string(r).c_str()) + ")";
    return L;
  }
  d.cuDriverGetVersion(&d.version);
  if (d.cuDeviceGetCount(&d.device_count) != kSuccess || d.device_count <= 0) {
    L.why = "the CUDA driver sees no device";
    return L;
  }
  L.ok = true;
  return L;
}

const Loaded& loaded() {
  static const Loaded L = load();
  return L;
}

}  // namespace

Result<const Driver*> driver() {
  const Loaded& L = loaded();
  if (!L.ok) return make_error(Errc::unsupported, L.why);
  return &L.d;
}

Status check(CUresult r, const std::string& what) {
  if (r == kSuccess) return {};
  const Loaded& L = loaded();
  const char *name = nullptr, *text = nullptr;
  if (L.d.cuGetErrorName) L.d.cuGetErrorName(r, &name);
  if (L.d.cuGetErrorString) L.d.cuGetErrorString(r, &text);
  // Out of device memory is exhaustion; everything else the device or driver refused.
  const Errc code = r == 2 ? Errc::exhausted : Errc::io;
  return make_error(code, what + ": " + (name ? name : "CUDA error " + std::to_string(r)) + (text ? std::string(" (") + text + ")" : ""));
}

std::string uuid_string(const CUuuid& u) {
  char s[64];
  const unsigned char* b = u.bytes;
  std::snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return s;
}

std::vector<DeviceInfo> devices() {
  std::vector<DeviceInfo> out;
  auto d = driver();
  if (!d.ok()) return out;
  const Driver& D = **d;
  for (int i = 0; i < D.device_count; ++i) {
    CUdevice dev = 0;
    if (D.cuDeviceGet(&dev, i) != kSuccess) continue;
    DeviceInfo info;
    info.ordinal = i;
    char name[256] = {};
    if (D.cuDeviceGetName(name, sizeof name - 1, dev) == kSuccess) info.name = name;
    CUuuid u{};
    if (D.cuDeviceGetUuid(&u, dev) == kSuccess) {
      info.uuid = uuid_string(u);
      info.raw = u;
    }
    D.cuDeviceTotalMem(&info.total_bytes, dev);
    out.push_back(std::move(info));
  }
  return out;
}

Value status() {
  Value::Map m;
  auto d = driver();
  m.emplace_back("available", d.ok());
  if (!d.ok()) {
    m.emplace_back("reason", d.error().message);
    return Value(std::move(m));
  }
  m.emplace_back("driver_version", int64_t((*d)->version));
  Value::List devs;
  for (auto& i : devices()) {
    Value::Map e;
    e.emplace_back("ordinal", int64_t(i.ordinal));
    e.emplace_back("name", i.name);
    e.emplace_back("uuid", i.uuid);
    e.emplace_back("total_bytes", uint64_t(i.total_bytes));
    devs.emplace_back(Value(std::move(e)));
  }
  m.emplace_back("devices", Value(std::move(devs)));
  return Value(std::move(m));
}

}  // namespace stagelink::cuda
