// A stand-in libnvidia-ml.so.1 for tests (loaded through STEPTRACE_NVML_LIBRARY). It
// plays a scripted series chosen by $STEPTRACE_FAKE_NVML_SCENARIO, read at nvmlInit_v2
// (a comma-separated list is one GPU per entry, the handle opened picks its series, so that
// each of torchrun's ranks plays its own: "steady,hot").
// Scripted time: each power reading (an nvmlDeviceGetPowerUsage call, or an
// nvmlDeviceGetFieldValues request that the device answers for field 185 or 186) after init
// starts the next reading; reading k is scripted time k x $STEPTRACE_FAKE_NVML_READING_MS
// (default 1000: reading k is second k), so tests drive it without waiting on time; every
// other call answers for the current reading's time. A series has one value per scripted
// second i, which holds over (i-1 s, i s] (a reading at second i stands for the second
// before it); before 0 s the series' second-0 value holds.
//   steady    650 W (+-2), 65-66 C, 1980 MHz, no throttling; PCIe TX 2,000,000 / RX
//             1,000,000 KB/s, memory 2619 MHz and 70 C, NVLink links 0..3 active with
//             flat error counters (5 CRC, 7 replay each) and data counters growing by
//             1,000,000 KiB TX / 500,000 KiB RX per link per reading, 3 corrected
//             remapped rows
//   sag       650 W for 20 s, then -5 W/s down to 350 W (below 70% of 700 W from 53 s)
//   cooling   60 C for 20 s, then up to 85 C in 30 s (50 C/min)
//   drop      700 W for 40 s, then 200 W
//   xid       steady; XID 79 at reading 25; uncorrectable ECC 0 -> 2 at reading 30
//   throttle  steady; hw_thermal_slowdown at readings 30..39, sw_power_cap at 50..59
//   nvlink    steady; link 2's CRC count grows by one per reading from reading 30
//   nvlink_blip steady; link 2's CRC count rises once, at reading 30
//   remap     steady; an uncorrectable remapped row (pending) at reading 40
//   nolinkerrors steady, but the NVLink error counters answer NVML_ERROR_NOT_SUPPORTED
//   hot       steady, but 10 C hotter (75-76 C) at the same power: a GPU with poor cooling
//   nodevice  NVML loads, but sees no GPU
//   mig       steady, but the GPU is in MIG mode with one MIG device (MIG-<uuid> below);
//             utilization answers NVML_ERROR_NOT_SUPPORTED
// A series name ending "_ga100" ("steady_ga100", "drop_ga100") plays that series on an A100
// (GA100) whose driver's NVML predates the power fields: nvmlDeviceGetPowerUsage returns the
// instantaneous power, and fields 185 and 186 answer NOT_SUPPORTED in their nvmlReturn.
// What a real device may lack is answered NVML_ERROR_NOT_SUPPORTED, as NVML does.
//
// Device identity: GPU i (the i-th scenario entry) sits at PCI bus id 00000000:<1B+16i>:00.0
// and has UUID GPU-<i>932f937-5b4c-4a2e-9d5e-01234567890<i>; a "mig" GPU i has one MIG
// device, MIG-<i>a5e3c91-7d2b-5f0e-8c4a-fedcba98765<i>.
//
// Vendor behaviour modelled, with its source (NVML API Reference, docs.nvidia.com/deploy/
// nvml-api, and nvml.h, whose comments it is generated from):
// - nvmlDeviceGetPowerUsage: "On Ampere (except GA100) or newer GPUs, the API returns power
//   averaged over 1 sec interval. On GA100 and older architectures, instantaneous power is
//   returned. See NVML_FI_DEV_POWER_AVERAGE and NVML_FI_DEV_POWER_INSTANT to query specific
//   power values." The fake device is an H100 (Hopper): it returns the trailing 1 s mean of
//   the series at the reading's time; a "_ga100" series the value at that time.
// - nvmlDeviceGetFieldValues, NVML_FI_DEV_POWER_AVERAGE (185): "GPU power averaged over 1 sec
//   interval, supported on Ampere (except GA100) or newer architectures"; NVML_FI_DEV_POWER_
//   INSTANT (186): "Current GPU power, supported on all architectures"; both in milliwatts,
//   and "scopeId needs to be specified ... 0 - GPU Only Scope ... 1 - Module scope (e.g.
//   CPU + GPU) ... x86 or non-NVIDIA ARM is not supported" (nvml.h): scope 0 answers, any
//   other NOT_SUPPORTED. Each field's own outcome is in its nvmlReturn, the call's SUCCESS.
//   What a driver older than a field answers for it is not documented: "_ga100" answers
//   NOT_SUPPORTED there (the backend takes any per-field failure at start for "absent").
// - nvmlDeviceGetPcieThroughput "is querying a byte counter over a 20ms interval and thus
//   is the PCIe throughput over that interval" (Device Queries): the call blocks for the
//   interval. $STEPTRACE_FAKE_NVML_PCIE_MS sets how long it sleeps (default 0, so that
//   scripted runs do not wait; the timing test sets 20).
// - NVLink throughput fields (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, 138/139): "Link ID
//   needs to be specified in the scopeId field in nvmlFieldValue_t. A scopeId of UINT_MAX
//   returns aggregate value summed up across all links" (nvml.h, "NVLink throughput
//   counters field values"). Drivers answer a per-link scopeId with that same all-links
//   figure on every link (reported for 12-link A100s: every link showed the GPU's total;
//   github.com/XuehaiPan/nvitop/pull/87), so summing the links overcounts by the link
//   count; the fake answers every scope with the all-links total.
// - nvmlDeviceGetHandleByPciBusId_v2 accepts "domain:bus:device.function",
//   "domain:bus:device" or "bus:device.function", all hexadecimal; NOT_FOUND otherwise.
// - nvmlDeviceGetHandleByUUID takes "the UUID of the target GPU or MIG instance" and returns
//   "the device handle or MIG device handle"; a UUID matching no device is NOT_FOUND (an
//   abbreviated one included: CUDA_VISIBLE_DEVICES accepts prefixes, NVML does not).
// - nvmlDeviceGetDeviceHandleFromMigDeviceHandle: the parent GPU of a MIG device handle.
// - nvmlDeviceGetMigMode: current and pending mode, NVML_DEVICE_MIG_ENABLE (1) or _DISABLE.
// - nvmlDeviceGetUtilizationRates: "On MIG-enabled GPUs, querying device utilization rates
//   is not currently supported" (NOT_SUPPORTED).
// - nvmlDeviceGetMemoryInfo (nvmlMemory_t: total, free, used bytes): device-wide, every
//   process's allocations.
// Test hook: fake_nvml_power_read_ns(i), the CLOCK_MONOTONIC time at which reading i's
// nvmlDeviceGetPowerUsage returned (-1 when unknown), for the sampler-timing test.
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

using Return = int;
constexpr Return kSuccess = 0;
constexpr Return kInvalidArgument = 2;
constexpr Return kNotSupported = 3;
constexpr unsigned kActiveLinks = 4;

struct FieldValue {  // nvmlFieldValue_t
  unsigned field_id;
  unsigned scope_id;
  long long timestamp;
  long long latency_usec;
  unsigned value_type;
  Return nvml_return;
  union {
    double d;
    unsigned ui;
    unsigned long ul;
    unsigned long long ull;
    long long sll;
    int si;
  } value;
};
constexpr Return kTimeout = 10;

struct EventData {
  void* device;
  unsigned long long event_type;
  unsigned long long event_data;
  unsigned gpu_instance_id;
  unsigned compute_instance_id;
};

constexpr Return kNotFound = 6;
constexpr unsigned kAllLinks = 0xFFFFFFFFu;  // UINT_MAX: the all-links scope

struct Gpu {
  int index;
};
Gpu g_gpus[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
Gpu g_mig[8] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};  // each GPU's MIG device
int g_pcie_sleep_ms = 0;                                  // $STEPTRACE_FAKE_NVML_PCIE_MS
constexpr long kReadLog = 1 << 14;
std::atomic<long long> g_power_read_ns[kReadLog];

std::string g_list = "steady";      // $STEPTRACE_FAKE_NVML_SCENARIO
std::string g_scenario = "steady";  // the series played: the opened GPU's entry
bool g_ga100 = false;               // ... played on an A100 ("_ga100")
long g_reading = -1;                // the current reading; -1: none yet
long long g_reading_ms = 1000;      // $STEPTRACE_FAKE_NVML_READING_MS: scripted time per reading
double g_energy_mj = 0;
bool g_xid_delivered = false;
int g_device = 0;        // the handle's target
unsigned g_devices = 1;  // entries in the scenario list

std::string series_of(unsigned index) {
  std::size_t begin = 0;
  for (unsigned i = 0; i < index; ++i) begin = g_list.find(',', begin) + 1;
  return g_list.substr(begin, g_list.find(',', begin) - begin);
}

// The series' power in scripted second i.
double power_w(long i) {
  if (i < 0) i = 0;
  if (g_scenario == "sag") {
    if (i < 20) return 650;
    const double w = 650 - 5.0 * static_cast<double>(i - 20);
    return w < 350 ? 350 : w;
  }
  if (g_scenario == "drop") return i < 40 ? 700 : 200;
  return 650 + static_cast<double>((i * 7) % 5) - 2;
}
double temp_c(long i) {
  if (g_scenario == "cooling") {
    if (i < 20) return 60;
    const double t = 60 + 25.0 * static_cast<double>(i - 20) / 30.0;
    return t > 85 ? 85 : t;
  }
  return (g_scenario == "hot" ? 75 : 65) + static_cast<double>(i % 2);
}
unsigned long long reasons(long i) {
  if (g_scenario == "throttle") {
    if (i >= 30 && i < 40) return 0x40;  // hw_thermal_slowdown
    if (i >= 50 && i < 60) return 0x4;   // sw_power_cap
  }
  return 0;
}
// The current reading's scripted time, and the scripted second it falls in.
long long now_ms() { return g_reading < 0 ? 0 : g_reading * g_reading_ms; }
long second_of(long long t_ms) { return t_ms <= 0 ? 0 : static_cast<long>((t_ms + 999) / 1000); }
long current() { return second_of(now_ms()); }
// The series' energy over (a, b] of scripted time, J: second by second.
double joules(long long a_ms, long long b_ms) {
  double j = 0;
  if (a_ms < 0) {
    const long long end = b_ms < 0 ? b_ms : 0;
    j += power_w(0) * static_cast<double>(end - a_ms) / 1000;
    a_ms = end;
  }
  while (a_ms < b_ms) {
    long long end = (a_ms / 1000 + 1) * 1000;  // (a, end] lies in one second
    if (end > b_ms) end = b_ms;
    j += power_w(second_of(end)) * static_cast<double>(end - a_ms) / 1000;
    a_ms = end;
  }
  return j;
}
// Power at the current reading's time, and averaged over the second before it, mW.
unsigned instant_mw() { return static_cast<unsigned>(power_w(current()) * 1000); }
unsigned average_mw() { return static_cast<unsigned>(joules(now_ms() - 1000, now_ms()) * 1000); }
// The next power reading: scripted time moves on, the energy counter with it.
void next_reading() {
  const long long before = now_ms();
  ++g_reading;
  g_energy_mj += joules(before, now_ms()) * 1000;
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  if (g_reading < kReadLog) {
    g_power_read_ns[g_reading].store(static_cast<long long>(ts.tv_sec) * 1'000'000'000 +
                                     ts.tv_nsec);
  }
}
// Plays a scenario entry: its series, on an A100 where it ends "_ga100".
void play(const std::string& entry) {
  const std::string suffix = "_ga100";
  g_ga100 = entry.size() > suffix.size() &&
            entry.compare(entry.size() - suffix.size(), suffix.size(), suffix) == 0;
  g_scenario = g_ga100 ? entry.substr(0, entry.size() - suffix.size()) : entry;
}
std::string uuid_of(unsigned i) {
  char b[64];
  std::snprintf(b, sizeof b, "GPU-%u932f937-5b4c-4a2e-9d5e-01234567890%u", i, i);
  return b;
}
std::string mig_uuid_of(unsigned i) {
  char b[64];
  std::snprintf(b, sizeof b, "MIG-%ua5e3c91-7d2b-5f0e-8c4a-fedcba98765%u", i, i);
  return b;
}
unsigned bus_of(unsigned i) { return 0x1B + 16 * i; }
bool is_mig_handle(void* d) { return d >= static_cast<void*>(g_mig) && d < g_mig + 8; }
Return open_gpu(unsigned index, void** device) {
  if (index >= g_devices || index >= 8) return kInvalidArgument;
  play(series_of(index));  // this process plays the series of the GPU it opened
  *device = &g_gpus[index];
  return kSuccess;
}
unsigned long long crc_flits(unsigned link, long i) {
  unsigned long long n = 5;
  if (link == 2 && g_scenario == "nvlink" && i >= 30) n += static_cast<unsigned long long>(i - 29);
  if (link == 2 && g_scenario == "nvlink_blip" && i >= 30) n += 1;
  return n;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) Return nvmlInit_v2() {
  const char* s = std::getenv("STEPTRACE_FAKE_NVML_SCENARIO");
  g_list = s != nullptr && *s != '\0' ? s : "steady";
  g_devices = 1;
  for (char c : g_list) g_devices += c == ',' ? 1 : 0;
  play(series_of(0));
  g_reading = -1;
  const char* reading_ms = std::getenv("STEPTRACE_FAKE_NVML_READING_MS");
  g_reading_ms =
      reading_ms != nullptr && std::atoll(reading_ms) > 0 ? std::atoll(reading_ms) : 1000;
  g_energy_mj = 1e9;  // the counter runs since driver load, not since the run started
  g_xid_delivered = false;
  const char* pcie = std::getenv("STEPTRACE_FAKE_NVML_PCIE_MS");
  g_pcie_sleep_ms = pcie != nullptr ? std::atoi(pcie) : 0;
  for (auto& t : g_power_read_ns) t.store(-1);
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlShutdown() { return kSuccess; }
__attribute__((visibility("default"))) const char* nvmlErrorString(Return r) {
  return r == kTimeout ? "Timeout" : "Fake error";
}
__attribute__((visibility("default"))) Return nvmlDeviceGetCount_v2(unsigned* count) {
  *count = g_scenario == "nodevice" ? 0 : g_devices;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetHandleByIndex_v2(unsigned index,
                                                                            void** device) {
  return open_gpu(index, device);
}
__attribute__((visibility("default"))) Return nvmlDeviceGetHandleByPciBusId_v2(const char* id,
                                                                               void** device) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  unsigned domain = 0, bus = 0, dev = 0, fn = 0;
  int used = 0;
  if (std::sscanf(id, "%x:%x:%x.%x%n", &a, &b, &c, &d, &used) == 4 && id[used] == '\0') {
    domain = a, bus = b, dev = c, fn = d;  // domain:bus:device.function
  } else if (std::sscanf(id, "%x:%x.%x%n", &a, &b, &c, &used) == 3 && id[used] == '\0') {
    bus = a, dev = b, fn = c;  // bus:device.function
  } else if (std::sscanf(id, "%x:%x:%x%n", &a, &b, &c, &used) == 3 && id[used] == '\0') {
    domain = a, bus = b, dev = c;  // domain:bus:device
  } else {
    return kInvalidArgument;
  }
  for (unsigned i = 0; i < g_devices && i < 8; ++i) {
    if (domain == 0 && bus == bus_of(i) && dev == 0 && fn == 0) return open_gpu(i, device);
  }
  return kNotFound;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetHandleByUUID(const char* uuid,
                                                                        void** device) {
  for (unsigned i = 0; i < g_devices && i < 8; ++i) {
    if (uuid_of(i) == uuid) return open_gpu(i, device);
    if (series_of(i) == "mig" && mig_uuid_of(i) == uuid) {
      play(series_of(i));
      *device = &g_mig[i];
      return kSuccess;
    }
  }
  return kNotFound;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetUUID(void* device, char* uuid,
                                                                unsigned n) {
  const auto* g = static_cast<Gpu*>(device);
  const std::string u = is_mig_handle(device) ? mig_uuid_of(g->index) : uuid_of(g->index);
  if (n <= u.size()) return 7;  // NVML_ERROR_INSUFFICIENT_SIZE
  std::strcpy(uuid, u.c_str());
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    void* mig, void** device) {
  if (!is_mig_handle(mig)) return kInvalidArgument;
  *device = &g_gpus[static_cast<Gpu*>(mig)->index];
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetMigMode(void* device, unsigned* current,
                                                                   unsigned* pending) {
  if (is_mig_handle(device)) return kInvalidArgument;
  *current = *pending = series_of(static_cast<unsigned>(static_cast<Gpu*>(device)->index)) == "mig";
  return kSuccess;
}
struct Memory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
__attribute__((visibility("default"))) Return nvmlDeviceGetMemoryInfo(void* device, Memory* m) {
  // an H200's 141 GiB, 80 GiB of it used; a MIG device: its 1g.18gb slice, 10 GiB used
  m->total = is_mig_handle(device) ? 18ULL << 30 : 141ULL << 30;
  m->used = is_mig_handle(device) ? 10ULL << 30 : 80ULL << 30;
  m->free = m->total - m->used;
  return kSuccess;
}
__attribute__((visibility("default"))) long long fake_nvml_power_read_ns(long i) {
  return i >= 0 && i < kReadLog ? g_power_read_ns[i].load() : -1;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetName(void*, char* name, unsigned n) {
  std::strncpy(name, "Fake H100", n);
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetPowerUsage(void*, unsigned* mw) {
  next_reading();
  // Hopper: the mean over the last second; an A100: the power now
  *mw = g_ga100 ? instant_mw() : average_mw();
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetEnforcedPowerLimit(void*, unsigned* mw) {
  *mw = 700000;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetTotalEnergyConsumption(
    void*, unsigned long long* mj) {
  *mj = static_cast<unsigned long long>(g_energy_mj);
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetTemperature(void*, unsigned,
                                                                       unsigned* c) {
  *c = static_cast<unsigned>(temp_c(current()));
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetClockInfo(void*, unsigned type,
                                                                     unsigned* mhz) {
  const unsigned long long r = reasons(current());
  if (type == 1) {
    *mhz = (r & 0x40) != 0 ? 1400 : (r & 0x4) != 0 ? 1600 : 1980;
  } else if (type == 2) {  // NVML_CLOCK_MEM
    *mhz = 2619;
  } else {
    *mhz = 1755;
  }
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetCurrentClocksEventReasons(
    void*, unsigned long long* r) {
  *r = reasons(current());
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetUtilizationRates(void*, unsigned* util) {
  if (g_scenario == "mig") return kNotSupported;
  util[0] = 98;
  util[1] = 60;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetTotalEccErrors(
    void*, unsigned, unsigned, unsigned long long* count) {
  *count = g_scenario == "xid" && current() >= 30 ? 2 : 0;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetPcieThroughput(void*, unsigned counter,
                                                                          unsigned* kb_s) {
  if (counter > 1) return kInvalidArgument;  // TX_BYTES, RX_BYTES only
  if (g_pcie_sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(g_pcie_sleep_ms));
  *kb_s = counter == 0 ? 2'000'000 : 1'000'000;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetFieldValues(void*, int count,
                                                                       FieldValue* values) {
  auto power_field = [](const FieldValue& f) {
    return (f.field_id == 185 || f.field_id == 186) && f.scope_id == 0 && !g_ga100;
  };
  for (int i = 0; i < count; ++i) {
    if (power_field(values[i])) {  // a power reading: the next scripted time, once a request
      next_reading();
      break;
    }
  }
  for (int i = 0; i < count; ++i) {
    FieldValue& f = values[i];
    if (power_field(f)) {  // NVML_FI_DEV_POWER_AVERAGE / _INSTANT, GPU scope, mW
      f.value_type = 1;    // NVML_VALUE_TYPE_UNSIGNED_INT
      f.value.ui = f.field_id == 185 ? average_mw() : instant_mw();
      f.nvml_return = kSuccess;
    } else if (f.field_id == 82) {  // NVML_FI_DEV_MEMORY_TEMP
      f.value_type = 1;             // NVML_VALUE_TYPE_UNSIGNED_INT
      f.value.ui = 70;
      f.nvml_return = kSuccess;
    } else if ((f.field_id == 138 || f.field_id == 139) &&
               (f.scope_id < kActiveLinks || f.scope_id == kAllLinks)) {
      // NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX: KiB since driver load, summed over the
      // links (1,000,000 / 500,000 KiB per link per reading), whatever the link asked for
      f.value_type = 3;  // NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
      const unsigned long long per_reading =
          kActiveLinks * (f.field_id == 138 ? 1'000'000 : 500'000);
      f.value.ull = 7'000'000'000ULL + per_reading * static_cast<unsigned long long>(current());
      f.nvml_return = kSuccess;
    } else {
      f.nvml_return = kNotSupported;
    }
  }
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetNvLinkState(void*, unsigned link,
                                                                       unsigned* active) {
  if (link >= 18) return kInvalidArgument;  // an 18-link part (H100/H200) past its last link
  *active = link < kActiveLinks ? 1 : 0;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetNvLinkErrorCounter(
    void*, unsigned link, unsigned counter, unsigned long long* value) {
  if (link >= kActiveLinks || counter > 4) return kInvalidArgument;
  if (g_scenario == "nolinkerrors") return kNotSupported;
  *value = counter == 2 ? crc_flits(link, current()) : counter == 0 ? 7 : 0;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetRemappedRows(void*, unsigned* corrected,
                                                                        unsigned* uncorrected,
                                                                        unsigned* pending,
                                                                        unsigned* failure) {
  const bool remapped = g_scenario == "remap" && current() >= 40;
  *corrected = 3;
  *uncorrected = remapped ? 1 : 0;
  *pending = remapped ? 1 : 0;
  *failure = 0;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlEventSetCreate(void** set) {
  *set = &g_device;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceRegisterEvents(void*, unsigned long long,
                                                                       void*) {
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlEventSetWait_v2(void*, EventData* data,
                                                                  unsigned) {
  if (g_scenario == "xid" && current() >= 25 && !g_xid_delivered) {
    g_xid_delivered = true;
    *data = EventData{&g_device, 0x8, 79, 0, 0};
    return kSuccess;
  }
  return kTimeout;
}

}  // extern "C"
