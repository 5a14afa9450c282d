// A stand-in libnvidia-ml.so.1 for tests (loaded through STEPTRACE_NVML_LIBRARY). It
// plays a scripted series chosen by $STEPTRACE_FAKE_NVML_SCENARIO, read at nvmlInit_v2
// (a comma-separated list is one GPU per entry, the handle opened picks its series, so that
// each of torchrun's ranks plays its own: "steady,hot"):
// reading i (each nvmlDeviceGetPowerUsage call after init starts the next; the others
// report reading i) is scripted second i, so tests drive it without waiting on time.
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
// What a real device may lack is answered NVML_ERROR_NOT_SUPPORTED, as NVML does.
#include <cstdlib>
#include <cstring>
#include <string>

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

std::string g_list = "steady";      // $STEPTRACE_FAKE_NVML_SCENARIO
std::string g_scenario = "steady";  // the series played: the opened GPU's entry
long g_reading = -1;                // the current reading; -1: none yet
double g_energy_mj = 0;
bool g_xid_delivered = false;
int g_device = 0;        // the handle's target
unsigned g_devices = 1;  // entries in the scenario list

std::string series_of(unsigned index) {
  std::size_t begin = 0;
  for (unsigned i = 0; i < index; ++i) begin = g_list.find(',', begin) + 1;
  return g_list.substr(begin, g_list.find(',', begin) - begin);
}

double power_w(long i) {
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
long current() { return g_reading < 0 ? 0 : g_reading; }
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
  g_scenario = series_of(0);
  g_reading = -1;
  g_energy_mj = 1e9;  // the counter runs since driver load, not since the run started
  g_xid_delivered = false;
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
  if (index >= g_devices) return kInvalidArgument;
  g_scenario = series_of(index);  // this process plays the series of the GPU it opened
  *device = &g_device;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetName(void*, char* name, unsigned n) {
  std::strncpy(name, "Fake H100", n);
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetPowerUsage(void*, unsigned* mw) {
  ++g_reading;
  *mw = static_cast<unsigned>(power_w(g_reading) * 1000);
  g_energy_mj += power_w(g_reading) * 1000;  // one scripted second at this power
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
  *kb_s = counter == 0 ? 2'000'000 : 1'000'000;
  return kSuccess;
}
__attribute__((visibility("default"))) Return nvmlDeviceGetFieldValues(void*, int count,
                                                                       FieldValue* values) {
  for (int i = 0; i < count; ++i) {
    FieldValue& f = values[i];
    if (f.field_id == 82) {  // NVML_FI_DEV_MEMORY_TEMP
      f.value_type = 1;      // NVML_VALUE_TYPE_UNSIGNED_INT
      f.value.ui = 70;
      f.nvml_return = kSuccess;
    } else if ((f.field_id == 138 || f.field_id == 139) && f.scope_id < kActiveLinks) {
      // NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX of link scope_id: KiB since driver load
      f.value_type = 3;  // NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
      const unsigned long long per_reading = f.field_id == 138 ? 1'000'000 : 500'000;
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
