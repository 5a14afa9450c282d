#include "nvml_device.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace steptrace::detail::nvml {
namespace {

// The CUDA driver entry points the device choice needs, through cuGetProcAddress_v2. The
// driver the process already loaded (torch's) is used; else it is loaded, as the CUDA timer
// does. CUDA's numbering is the one the user means (after CUDA_VISIBLE_DEVICES,
// CUDA_DEVICE_ORDER and the container's cgroup filter); NVML's indices are not.
class CudaDriver {
 public:
  CudaDriver() {
    using GetProc = CuResult (*)(const char*, void**, int, std::uint64_t, int*);
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      why_ = "no libcuda.so.1";
      return;
    }
    auto get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
    auto resolve = [&](auto& fn, const char* name) {
      void* p = nullptr;
      int status = 0;
      if (get_proc != nullptr && get_proc(name, &p, 12000, 0, &status) == 0) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      }
    };
    CuResult (*cu_init)(unsigned) = nullptr;
    resolve(cu_init, "cuInit");
    resolve(device_get_, "cuDeviceGet");
    resolve(bus_id_, "cuDeviceGetPCIBusId");
    resolve(device_count_, "cuDeviceGetCount");
    resolve(ctx_device_, "cuCtxGetDevice");
    if (cu_init == nullptr || device_get_ == nullptr || bus_id_ == nullptr) {
      why_ = "libcuda.so.1 has no cuDeviceGetPCIBusId";
      return;
    }
    if (const CuResult r = cu_init(0); r != 0) {
      why_ = fmt::format("cuInit failed: CUDA error {}", r);
      return;
    }
    ok_ = true;
  }

  // The devices CUDA shows this process; -1 when unknown.
  int visible() const {
    int n = 0;
    return ok_ && device_count_ != nullptr && device_count_(&n) == 0 ? n : -1;
  }
  // The device of the calling thread's current context; -1 without one.
  int current() const {
    int device = -1;
    return ok_ && ctx_device_ != nullptr && ctx_device_(&device) == 0 ? device : -1;
  }
  // The PCI bus id of CUDA device `cuda_index` ("" with `why` when there is none):
  // cuDeviceGetPCIBusId gives "[domain]:[bus]:[device].[function]" in hex, which
  // nvmlDeviceGetHandleByPciBusId_v2 accepts; the bus id is the same to CUDA and NVML.
  std::string pci_bus_id(int cuda_index, std::string* why) const {
    if (!ok_) {
      *why = why_;
      return {};
    }
    int device = 0;
    char id[32] = {};
    CuResult r = device_get_(&device, cuda_index);
    if (r == 0) r = bus_id_(id, sizeof(id), device);
    if (r != 0) {
      *why = fmt::format("cuDeviceGetPCIBusId({}) failed: CUDA error {}", cuda_index, r);
      return {};
    }
    return id;
  }

 private:
  using CuResult = int;
  CuResult (*device_get_)(int*, int) = nullptr;
  CuResult (*bus_id_)(char*, int, int) = nullptr;
  CuResult (*device_count_)(int*) = nullptr;
  CuResult (*ctx_device_)(int*) = nullptr;
  bool ok_ = false;  // loaded and initialized
  std::string why_;  // why not
};

// The entries of $CUDA_VISIBLE_DEVICES; empty when it is unset or empty.
std::vector<std::string> visible_entries() {
  std::vector<std::string> out;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || *visible == '\0') return out;
  const std::string list = visible;
  std::size_t pos = 0;
  while (true) {
    const std::size_t comma = list.find(',', pos);
    out.push_back(list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (comma == std::string::npos) return out;
    pos = comma + 1;
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A GPU UUID from CUDA_VISIBLE_DEVICES, whole or abbreviated ("GPU-8932f937": CUDA takes
// any unique prefix, NVML's lookup only the whole UUID): the one NVML device whose UUID
// starts with it. "" on success.
std::string by_uuid_prefix(const Api& api, const std::string& entry, Device* out) {
  if (api.get_handle_by_uuid != nullptr && api.get_handle_by_uuid(entry.c_str(), out) == kSuccess) {
    return {};
  }
  unsigned count = 0;
  if (api.get_uuid == nullptr || api.get_count(&count) != kSuccess) {
    return fmt::format("nvmlDeviceGetHandleByUUID({}) found no device", entry);
  }
  int matches = 0;
  for (unsigned i = 0; i < count; ++i) {
    Device d = nullptr;
    char uuid[96] = {};
    // a device the cgroup hides answers NO_PERMISSION: not ours, skipped
    if (api.get_handle(i, &d) != kSuccess || api.get_uuid(d, uuid, sizeof(uuid)) != kSuccess) {
      continue;
    }
    if (lower(uuid).rfind(lower(entry), 0) == 0) {
      *out = d;
      ++matches;
    }
  }
  if (matches == 1) return {};
  return matches == 0
             ? fmt::format("no NVML device has a UUID starting {}", entry)
             : fmt::format("{} is ambiguous: {} NVML devices' UUIDs start with it", entry, matches);
}

// The NVML device of CUDA device `cuda_index`; `*mig` set when the device is a MIG slice
// (the handle is then its parent board's). "" on success.
std::string nvml_device(const Api& api, const CudaDriver& cuda, int cuda_index, Device* out,
                        std::string* how, bool* mig) {
  // 1. through the PCI bus id, where the CUDA driver is there
  std::string cuda_why;
  const std::string bus =
      api.get_handle_by_pci != nullptr ? cuda.pci_bus_id(cuda_index, &cuda_why) : std::string();
  if (!bus.empty()) {
    if (const Return r = api.get_handle_by_pci(bus.c_str(), out); r != kSuccess) {
      return fmt::format("nvmlDeviceGetHandleByPciBusId_v2({}) failed: {}", bus, api.error(r));
    }
    *how += fmt::format(", PCI {}", bus);
  } else {
    // 2. without the CUDA driver: CUDA_VISIBLE_DEVICES' entry for the device
    const std::vector<std::string> visible = visible_entries();
    std::string entry;
    if (!visible.empty()) {
      if (cuda_index < static_cast<int>(visible.size())) entry = visible[cuda_index];
      if (entry.empty()) {
        return fmt::format("CUDA device {} is not in CUDA_VISIBLE_DEVICES={}", cuda_index,
                           std::getenv("CUDA_VISIBLE_DEVICES"));
      }
    }
    if (entry.rfind("MIG-", 0) == 0) {
      // a MIG device: its handle, then its parent board's
      Device slice = nullptr;
      if (api.get_handle_by_uuid == nullptr || api.mig_parent == nullptr) {
        return fmt::format("{} is a MIG device and this NVML cannot look it up", entry);
      }
      if (const Return r = api.get_handle_by_uuid(entry.c_str(), &slice); r != kSuccess) {
        return fmt::format("nvmlDeviceGetHandleByUUID({}) failed: {}", entry, api.error(r));
      }
      if (const Return r = api.mig_parent(slice, out); r != kSuccess) {
        return fmt::format("nvmlDeviceGetDeviceHandleFromMigDeviceHandle({}) failed: {}", entry,
                           api.error(r));
      }
      *mig = true;
      *how += fmt::format(", {} in CUDA_VISIBLE_DEVICES", entry);
    } else if (entry.rfind("GPU-", 0) == 0) {
      if (std::string why = by_uuid_prefix(api, entry, out); !why.empty()) return why;
      *how += fmt::format(", {} in CUDA_VISIBLE_DEVICES", entry);
    } else {
      // an index: NVML's numbering is taken for CUDA's (PCI order; CUDA's default order
      // is fastest first, which agrees on machines of one GPU model)
      unsigned index = static_cast<unsigned>(cuda_index);
      if (!entry.empty()) {
        char* end = nullptr;
        const long parsed = std::strtol(entry.c_str(), &end, 10);
        if (*end != '\0' || parsed < 0) {
          return fmt::format("CUDA_VISIBLE_DEVICES entry {:?} is neither an index nor a UUID",
                             entry);
        }
        index = static_cast<unsigned>(parsed);
      }
      unsigned count = 0;
      if (const Return r = api.get_count(&count); r != kSuccess) {
        return fmt::format("nvmlDeviceGetCount_v2 failed: {}", api.error(r));
      }
      if (count == 0) return "NVML sees no GPU on this machine";
      if (index >= count)
        return fmt::format("NVML device {} does not exist ({} visible)", index, count);
      if (const Return r = api.get_handle(index, out); r != kSuccess) {
        return fmt::format("nvmlDeviceGetHandleByIndex_v2({}) failed: {}", index, api.error(r));
      }
      *how += fmt::format(", NVML device {} by index ({})", index, cuda_why);
    }
  }
  char uuid[96] = {};
  if (api.get_uuid != nullptr && api.get_uuid(*out, uuid, sizeof(uuid)) == kSuccess) {
    *how += fmt::format(", {}", uuid);
  }
  unsigned current = 0, pending = 0;
  if (api.mig_mode != nullptr && api.mig_mode(*out, &current, &pending) == kSuccess &&
      current == kMigEnabled) {
    *mig = true;
  }
  if (*mig) *how += ", MIG: board-wide figures";
  return {};
}

// The rank's CUDA device when none is configured, by the rule the counters (CUPTI's
// choose_device) and the Python step hooks follow: $LOCAL_RANK (torchrun) when it is among
// the visible devices, else the current CUDA context's device, else 0. With one GPU per rank
// (CUDA_VISIBLE_DEVICES naming one), every rank but local rank 0 would otherwise ask for a
// device it cannot see.
int rank_device(const CudaDriver& cuda, std::string* how) {
  int rank = -1;
  if (const char* local = std::getenv("LOCAL_RANK"); local != nullptr && *local != '\0') {
    char* end = nullptr;
    const long v = std::strtol(local, &end, 10);
    if (*end == '\0' && v >= 0 && v < 4096) rank = static_cast<int>(v);
  }
  // without the driver, CUDA_VISIBLE_DEVICES' entries are the devices CUDA would show
  int visible = cuda.visible();
  if (visible < 0 && !visible_entries().empty()) {
    visible = static_cast<int>(visible_entries().size());
  }
  std::string note;
  if (rank >= 0) {
    if (visible < 0 || rank < visible) {
      *how = fmt::format("LOCAL_RANK={}", rank);
      return rank;
    }
    note = fmt::format("LOCAL_RANK={} is not among the {} visible devices; ", rank, visible);
  }
  if (const int current = cuda.current(); current >= 0) {
    *how = note + "the current CUDA context's";
    return current;
  }
  *how = note + (rank >= 0 ? "no current CUDA context: the first device" : "default");
  return 0;
}

}  // namespace

std::string choose_device(const Api& api, int device_index, Device* out, std::string* detail,
                          bool* mig) {
  const CudaDriver cuda;
  std::string how = "device_index";
  const int cuda_index = device_index >= 0 ? device_index : rank_device(cuda, &how);
  *detail = fmt::format("device {} ({}", cuda_index, how);
  return nvml_device(api, cuda, cuda_index, out, detail, mig);
}

}  // namespace steptrace::detail::nvml
