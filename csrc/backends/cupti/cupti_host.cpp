// check_metric_set(): the metric table checked with CUPTI's profiler host API, which
// needs no GPU and no driver. libcupti is dlopen'ed; the CUPTI headers only give the
// parameter structs. Without the headers at build time this is a stub that says so.
#include "cupti_host.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "cupti_errors.hpp"
#include "metric_sets.hpp"
#include "steptrace/error.hpp"
#include "steptrace/metrics.hpp"

#include "profiler_host.hpp"
#if STEPTRACE_HAVE_CUPTI_HEADERS
#include <cupti_version.h>
#endif

namespace steptrace {
namespace detail::cupti {
namespace {

#if STEPTRACE_HAVE_CUPTI_HEADERS
constexpr int kBuiltFor = CUPTI_API_VERSION;
#else
constexpr int kBuiltFor = 0;
#endif

// The soname of the headers' major release first: a build against CUDA 12's CUPTI tries
// libcupti.so.12 before .13.
constexpr bool kBuiltFor12 = kBuiltFor > 0 && kBuiltFor < 130000;
constexpr const char* kSonames[] = {kBuiltFor12 ? "libcupti.so.12" : "libcupti.so.13",
                                    kBuiltFor12 ? "libcupti.so.13" : "libcupti.so.12",
                                    "libcupti.so"};

int major_of(int api_version) {
  if (api_version >= 130000) return api_version / 10000;
  return api_version > 0 ? 12 : 0;
}

int find_mapped(dl_phdr_info* info, size_t, void* data) {
  const char* name = info->dlpi_name;
  if (name == nullptr || name[0] == '\0') return 0;
  const char* base = std::strrchr(name, '/');
  base = base == nullptr ? name : base + 1;
  if (std::strncmp(base, "libcupti.so", 11) != 0) return 0;
  *static_cast<std::string*>(data) = name;
  return 1;
}

std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return map->l_name;
  }
  return fallback;
}

std::mutex g_mutex;
Library g_library;
bool g_loaded = false;
std::string g_failure;  // why the library in the process cannot be used (said once, kept)

using GetVersion = int (*)(std::uint32_t*);

// Whether libcuda.so.1 is in the process or can be loaded into it.
bool driver_loadable() {
  void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (h == nullptr) return false;
  dlclose(h);
  return true;
}

// cuptiGetVersion in a child process. CUPTI 13.2's (torch 2.15's libcupti.so.13) dlopens
// libcuda.so.1 and, where there is none, recurses through its error reporting until the
// stack overflows: SIGSEGV in the caller (seen here under gdb: cuptiGetVersion ->
// cuptiGetResultString -> ... -> dlerror; CUPTI 13.0's returns normally). Where the driver
// cannot be loaded, the first call is made in a child, with no core file, so that a crash
// ends only the child; true with `*version` when it returned.
bool call_in_child(GetVersion get, std::uint32_t* version, std::string* why) {
  int fds[2];
  if (pipe(fds) != 0) {
    *why = "cannot probe libcupti: pipe() failed";
    return false;
  }
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    *why = "cannot probe libcupti: fork() failed";
    return false;
  }
  if (pid == 0) {
    close(fds[0]);
    const rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    // The process's own fault handlers (Python's faulthandler prints "Fatal Python error")
    // would speak for the child's crash on the shared stderr: the default action instead,
    // and the child's output goes nowhere.
    for (const int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) signal(sig, SIG_DFL);
    if (const int null = open("/dev/null", O_WRONLY); null >= 0) {
      dup2(null, STDOUT_FILENO);
      dup2(null, STDERR_FILENO);
    }
    std::uint32_t out[2] = {0, 0};
    out[0] = static_cast<std::uint32_t>(get(&out[1]));
    const ssize_t n = write(fds[1], out, sizeof out);
    _exit(n == static_cast<ssize_t>(sizeof out) ? 0 : 1);
  }
  close(fds[1]);
  std::uint32_t out[2] = {1, 0};
  pollfd p{fds[0], POLLIN, 0};
  const bool answered = poll(&p, 1, 10000) == 1 && read(fds[0], out, sizeof out) == sizeof out;
  close(fds[0]);
  int status = 0;
  if (!answered) kill(pid, SIGKILL);
  const bool reaped = waitpid(pid, &status, 0) == pid;
  if (answered && out[0] == 0) {
    *version = out[1];
    return true;
  }
  if (reaped && WIFSIGNALED(status)) {
    *why = fmt::format(
        "cuptiGetVersion died with signal {} (no CUDA driver: libcuda.so.1 not "
        "found; CUPTI 13.2 crashes without one)",
        WTERMSIG(status));
  } else if (!answered) {
    *why = "cuptiGetVersion did not return within 10 s (no CUDA driver: libcuda.so.1 not found)";
  } else {
    *why = fmt::format("cuptiGetVersion failed ({})", out[0]);
  }
  return false;
}

// The version of the libcupti at `handle`, asked in a child process where there is no
// driver (see call_in_child). false with `why` when it cannot be used.
bool probe_version(void* handle, const std::string& path, std::uint32_t* version,
                   std::string* why) {
  auto get = reinterpret_cast<GetVersion>(dlsym(handle, "cuptiGetVersion"));
  if (get == nullptr) {
    *why = "libcupti at " + path + " has no cuptiGetVersion";
    return false;
  }
  if (driver_loadable()) {
    if (get(version) != 0) *version = 0;
    return true;
  }
  std::string reason;
  if (call_in_child(get, version, &reason)) return true;
  *why = "libcupti at " + path + " cannot be used: " + reason + "; CUPTI is off";
  return false;
}

// Whether the libcupti at `handle` can be used by this build: it says its version (see
// probe_version) and is of the headers' major release. false with `why` (one line).
bool usable(void* handle, const std::string& path, std::uint32_t* version, std::string* why) {
  if (!probe_version(handle, path, version, why)) return false;
  const int v = static_cast<int>(*version);
  if (kBuiltFor > 0 && v > 0 && major_of(v) != major_of(kBuiltFor)) {
    *why = fmt::format(
        "libcupti at {} is CUPTI {}, and steptrace was built with the CUPTI {} headers "
        "(CUPTI_API_VERSION {}): another major release, whose calls and records this build "
        "cannot read. CUPTI is off; rebuild steptrace against this CUPTI's headers (pip "
        "install steptrace from source in the environment that holds it)",
        path, version_string(v), version_string(kBuiltFor), kBuiltFor);
    return false;
  }
  return true;
}

}  // namespace

std::vector<std::string> library_candidates(const std::vector<std::string>& extra_dirs) {
  std::vector<std::string> out(std::begin(kSonames), std::end(kSonames));
  std::vector<std::string> dirs = extra_dirs;
  if (const char* home = std::getenv("CUDA_HOME"); home != nullptr && home[0] != '\0') {
    for (const char* sub : {"/lib64", "/lib", "/extras/CUPTI/lib64"})
      dirs.push_back(home + std::string(sub));
  }
  for (const char* d :
       {"/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/local/cuda/extras/CUPTI/lib64"}) {
    dirs.emplace_back(d);
  }
  for (const auto& d : dirs) {
    for (const char* so : kSonames) out.push_back(d + "/" + so);
  }
  return out;
}

const Library* load_library(const std::vector<std::string>& extra_dirs, std::string* why) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_loaded) return &g_library;
  if (!g_failure.empty()) {
    *why = g_failure;
    return nullptr;
  }
  void* handle = nullptr;
  std::string path;
  // 1. a copy already in the process (torch loads its own): by soname, then any mapped
  //    file named libcupti.so* (a differently named copy from a wheel)
  for (const char* so : kSonames) {
    handle = dlopen(so, RTLD_NOW | RTLD_NOLOAD);
    if (handle != nullptr) {
      path = so;
      break;
    }
  }
  if (handle == nullptr) {
    std::string mapped;
    dl_iterate_phdr(find_mapped, &mapped);
    if (!mapped.empty()) {
      handle = dlopen(mapped.c_str(), RTLD_NOW | RTLD_NOLOAD);
      path = mapped;
    }
  }
  // 2. the loader's search path, then the toolkit folders and the caller's: the first that
  //    can be used (one that fails, e.g. a CUDA 13.2 wheel's on a machine without a driver,
  //    is closed and the next one tried)
  std::uint32_t version = 0;
  if (handle != nullptr) {
    path = loaded_path(handle, path);
    if (!usable(handle, path, &version, &g_failure)) {
      *why = g_failure;
      return nullptr;
    }
  } else {
    std::string first_failure;
    for (const auto& c : library_candidates(extra_dirs)) {
      void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) continue;
      const std::string p = loaded_path(h, c);
      std::string failure;
      if (usable(h, p, &version, &failure)) {
        handle = h;
        path = p;
        break;
      }
      if (first_failure.empty()) first_failure = failure;
      dlclose(h);
    }
    if (handle == nullptr && !first_failure.empty()) {
      g_failure = first_failure;
      *why = g_failure;
      return nullptr;
    }
  }
  if (handle == nullptr) {
    *why =
        "libcupti could not be loaded (tried libcupti.so.13/.12 on the loader path, "
        "$CUDA_HOME and /usr/local/cuda; install the CUDA toolkit's CUPTI or "
        "nvidia-cuda-cupti)";
    return nullptr;
  }
  g_library.handle = handle;
  g_library.path = path;
  g_library.built_for = kBuiltFor;
  g_library.version = static_cast<int>(version);
  g_loaded = true;
  return &g_library;
}

int cupti_release(int api_version) {
  if (api_version >= 130000) return api_version / 100;
  return api_version;
}

std::string activity_records_unreadable(const Library& lib) {
  if (lib.built_for <= 0 || cupti_release(lib.version) == cupti_release(lib.built_for)) return "";
  return fmt::format(
      "libcupti at {} is CUPTI {}, and steptrace was built with the CUPTI {} headers: the "
      "activity record structs differ between CUPTI releases (CUpti_ActivityKernel9 in 12.x, "
      "10 in 13.0, 11 in 13.2), so kernel records are not read. Rebuild steptrace against "
      "this CUPTI's headers (torch's: site-packages/nvidia/cu13/include)",
      lib.path, version_string(lib.version), version_string(lib.built_for));
}

std::string missing_symbol_reason(const Library& lib, const std::string& feature,
                                  const std::string& missing) {
  return too_old_reason(feature, lib.version, "12.6") + " (" + missing + " missing in " + lib.path +
         ")";
}

std::string Device::describe() const { return fmt::format("device {} ({})", index, how); }

namespace {

// $LOCAL_RANK (torchrun, and most launchers): the rank's index on its node; -1 when unset
// or not a number.
int local_rank() {
  const char* v = std::getenv("LOCAL_RANK");
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long r = std::strtol(v, &end, 10);
  if (*end != '\0' || r < 0 || r > 1 << 20) return -1;
  return static_cast<int>(r);
}

}  // namespace

Device choose_device(int requested) {
  if (requested >= 0) return {requested, "as configured"};
  // Only a driver the process already loaded (and initialized: the CUDA event timer
  // did) can tell the visible devices and the current context; loading one here would
  // tell neither.
  int visible = -1;
  int current = -1;
  if (void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD)) {
    using GetInt = int (*)(int*);
    int n = 0;
    if (auto count = reinterpret_cast<GetInt>(dlsym(lib, "cuDeviceGetCount"));
        count != nullptr && count(&n) == 0) {
      visible = n;
    }
    int dev = -1;
    if (auto get = reinterpret_cast<GetInt>(dlsym(lib, "cuCtxGetDevice"));
        get != nullptr && get(&dev) == 0 && dev >= 0) {
      current = dev;
    }
    dlclose(lib);  // drops only the reference RTLD_NOLOAD added
  }
  // Each torchrun rank is its LOCAL_RANK'th GPU, whether or not it has made that device
  // current yet (a context made before torch.cuda.set_device is on device 0 for every
  // rank) -- unless each rank sees only its own GPUs (CUDA_VISIBLE_DEVICES per rank).
  std::string note;
  if (const int rank = local_rank(); rank >= 0) {
    if (visible < 0 || rank < visible) return {rank, fmt::format("LOCAL_RANK={}", rank)};
    note = fmt::format("LOCAL_RANK={} is not among the {} visible devices; ", rank, visible);
  }
  if (current >= 0) return {current, note + "the current CUDA context's"};
  return {0, note + "no current CUDA context: the first device"};
}

#if STEPTRACE_HAVE_CUPTI_HEADERS

bool ProfilerApi::load(void* lib, std::string* missing) {
  SymbolResolver resolve(lib, missing);
  resolve(initialize, "cuptiProfilerInitialize");
  resolve(deinitialize, "cuptiProfilerDeInitialize");
  resolve(chip_name, "cuptiDeviceGetChipName");
  resolve(get_timestamp, "cuptiGetTimestamp");
  return resolve.ok();
}

std::string call_reason(const HostApi& api, const char* call, CUptiResult r) {
  return unavailable_reason(call, static_cast<int>(r), api.result_text(r));
}

bool initialize_profiler(const ProfilerApi& api, const HostApi& host_api, int device_index,
                         bool* initialized, std::string* chip, const ChipFamily** family,
                         CUptiResult* result, std::string* why) {
  *result = CUPTI_SUCCESS;
  CUpti_Profiler_Initialize_Params init{};
  init.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Initialize_Params, pPriv);
  if (CUptiResult r = api.initialize(&init); r != CUPTI_SUCCESS) {
    *result = r;
    *why = call_reason(host_api, "cuptiProfilerInitialize", r);
    return false;
  }
  *initialized = true;
  CUpti_Device_GetChipName_Params p{};
  p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Device_GetChipName_Params, pChipName);
  p.deviceIndex = static_cast<std::size_t>(device_index);
  if (CUptiResult r = api.chip_name(&p); r != CUPTI_SUCCESS || p.pChipName == nullptr) {
    *result = r;
    *why = call_reason(host_api, "cuptiDeviceGetChipName", r);
    return false;
  }
  *chip = p.pChipName;
  *family = find_family(*chip);
  if (*family == nullptr) {
    *why = unsupported_chip_reason(*chip);
    return false;
  }
  return true;
}

void deinitialize_profiler(const ProfilerApi& api) noexcept {
  CUpti_Profiler_DeInitialize_Params p{};
  p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_DeInitialize_Params, pPriv);
  api.deinitialize(&p);
}

bool profiler_torn_down(const ProfilerApi& api, int device_index, CUptiResult result) noexcept {
  if (torn_down_result(static_cast<int>(result))) return true;
  // Other results (INVALID_OPERATION, INVALID_PARAMETER, UNKNOWN) also come from live
  // objects (counters taken by DCGM, a bad state): ask the profiler whether it still knows
  // the device it was initialized for.
  CUpti_Device_GetChipName_Params p{};
  p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Device_GetChipName_Params, pChipName);
  p.deviceIndex = static_cast<std::size_t>(device_index);
  return api.chip_name(&p) != CUPTI_SUCCESS || p.pChipName == nullptr;
}

bool one_pass_config(const HostApi& api, const HostObject& host, const std::string& chip,
                     const ChipFamily& family, ProfilerMode mode,
                     const std::uint8_t* counter_availability, CounterMap* map,
                     std::vector<std::uint8_t>* config, std::string* why) {
  MetricSetReport report;
  report.chip = chip;
  report.family = family.name;
  report.mode = to_string(mode);
  select_metric_set(counters_for(family, mode),
                    host_oracle(api, host, chip, mode, counter_availability), &report);
  if (!report.error.empty()) {
    *why =
        fmt::format("no usable one-pass {} metric set on {}: {}", report.mode, chip, report.error);
    return false;
  }
  *map = map_counters(report);
  // `host` keeps these metrics: EvaluateToGpuValues later reads the same host object.
  if (!make_config_image(api, host.get(), map->metrics, config, why)) return false;
  const int passes = config_image_passes(api, *config, why);
  if (passes != 1) {
    if (passes > 1) {
      *why = fmt::format("the {} config needs {} passes on {}, not 1", report.mode, passes, chip);
    }
    return false;
  }
  return true;
}

bool evaluate_range(const HostApi& api, CUpti_Profiler_Host_Object* host,
                    const std::vector<std::uint8_t>& image, std::size_t index,
                    const std::vector<const char*>& metric_names, double* values) noexcept {
  CUpti_Profiler_Host_EvaluateToGpuValues_Params p{};
  p.structSize =
      STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_EvaluateToGpuValues_Params, pMetricValues);
  p.pHostObject = host;
  p.pCounterDataImage = image.data();
  p.counterDataImageSize = image.size();
  p.rangeIndex = index;
  p.ppMetricNames = const_cast<const char**>(metric_names.data());  // CUPTI only reads them
  p.numMetrics = metric_names.size();
  p.pMetricValues = values;
  return api.evaluate(&p) == CUPTI_SUCCESS;
}

bool HostApi::load(void* lib, std::string* missing) {
  SymbolResolver resolve(lib, missing);
  resolve(initialize, "cuptiProfilerHostInitialize");
  resolve(deinitialize, "cuptiProfilerHostDeinitialize");
  resolve(metric_properties, "cuptiProfilerHostGetMetricProperties");
  resolve(add_metrics, "cuptiProfilerHostConfigAddMetrics");
  resolve(config_image_size, "cuptiProfilerHostGetConfigImageSize");
  resolve(config_image, "cuptiProfilerHostGetConfigImage");
  resolve(num_passes, "cuptiProfilerHostGetNumOfPasses");
  resolve(evaluate, "cuptiProfilerHostEvaluateToGpuValues");
  result_string = reinterpret_cast<decltype(result_string)>(dlsym(lib, "cuptiGetResultString"));
  return resolve.ok();
}

std::string HostApi::result_text(CUptiResult r) const {
  const char* s = nullptr;
  if (result_string != nullptr && result_string(r, &s) == CUPTI_SUCCESS && s != nullptr) return s;
  return {};
}

std::string HostApi::error(CUptiResult r) const {
  const std::string text = result_text(r);
  if (!text.empty()) return fmt::format("{} ({})", text, static_cast<int>(r));
  return fmt::format("CUPTI error {}", static_cast<int>(r));
}

// Our spelling of CUPTI's struct-size macro gives its value (profiler_host.hpp).
static_assert(STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_Initialize_Params, pHostObject) ==
              CUPTI_PROFILER_STRUCT_SIZE(  // NOLINT(bugprone-sizeof-expression): CUPTI's own
                  CUpti_Profiler_Host_Initialize_Params, pHostObject));

HostObject::HostObject(const HostApi& api, const std::string& chip, ProfilerMode mode,
                       const std::uint8_t* counter_availability)
    : api_(api) {
  CUpti_Profiler_Host_Initialize_Params p{};
  p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_Initialize_Params, pHostObject);
  p.profilerType = mode == ProfilerMode::kPmSampling ? CUPTI_PROFILER_TYPE_PM_SAMPLING
                                                     : CUPTI_PROFILER_TYPE_RANGE_PROFILER;
  p.pChipName = chip.c_str();
  p.pCounterAvailabilityImage = counter_availability;
  status_ = api_.initialize(&p);
  if (status_ == CUPTI_SUCCESS) object_ = p.pHostObject;
}

HostObject::~HostObject() {
  if (object_ == nullptr) return;
  CUpti_Profiler_Host_Deinitialize_Params p{};
  p.structSize = STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_Deinitialize_Params, pHostObject);
  p.pHostObject = object_;
  api_.deinitialize(&p);
}

bool metric_exists(const HostApi& api, CUpti_Profiler_Host_Object* obj, const std::string& name) {
  CUpti_Profiler_Host_GetMetricProperties_Params p{};
  p.structSize =
      STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_GetMetricProperties_Params, metricType);
  p.pHostObject = obj;
  p.pMetricName = name.c_str();
  return api.metric_properties(&p) == CUPTI_SUCCESS;
}

bool make_config_image(const HostApi& api, CUpti_Profiler_Host_Object* obj,
                       const std::vector<std::string>& metrics, std::vector<std::uint8_t>* image,
                       std::string* why) {
  std::vector<const char*> names;
  names.reserve(metrics.size());
  for (const auto& m : metrics) names.push_back(m.c_str());
  CUpti_Profiler_Host_ConfigAddMetrics_Params add{};
  add.structSize =
      STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_ConfigAddMetrics_Params, numMetrics);
  add.pHostObject = obj;
  add.ppMetricNames = names.data();
  add.numMetrics = names.size();
  if (CUptiResult r = api.add_metrics(&add); r != CUPTI_SUCCESS) {
    *why = "cuptiProfilerHostConfigAddMetrics: " + api.error(r);
    return false;
  }
  CUpti_Profiler_Host_GetConfigImageSize_Params size{};
  size.structSize =
      STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_GetConfigImageSize_Params, configImageSize);
  size.pHostObject = obj;
  if (CUptiResult r = api.config_image_size(&size); r != CUPTI_SUCCESS) {
    *why = "cuptiProfilerHostGetConfigImageSize: " + api.error(r);
    return false;
  }
  image->assign(size.configImageSize, 0);
  CUpti_Profiler_Host_GetConfigImage_Params img{};
  img.structSize =
      STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_GetConfigImage_Params, pConfigImage);
  img.pHostObject = obj;
  img.configImageSize = image->size();
  img.pConfigImage = image->data();
  if (CUptiResult r = api.config_image(&img); r != CUPTI_SUCCESS) {
    *why = "cuptiProfilerHostGetConfigImage: " + api.error(r);
    return false;
  }
  return true;
}

int config_image_passes(const HostApi& api, const std::vector<std::uint8_t>& image,
                        std::string* why) {
  CUpti_Profiler_Host_GetNumOfPasses_Params np{};
  np.structSize =
      STEPTRACE_CUPTI_STRUCT_SIZE(CUpti_Profiler_Host_GetNumOfPasses_Params, numOfPasses);
  np.configImageSize = image.size();
  np.pConfigImage = const_cast<std::uint8_t*>(image.data());  // CUPTI only reads it
  if (CUptiResult r = api.num_passes(&np); r != CUPTI_SUCCESS) {
    *why = "cuptiProfilerHostGetNumOfPasses: " + api.error(r);
    return -1;
  }
  return static_cast<int>(np.numOfPasses);
}

int count_passes(const HostApi& api, const std::string& chip, ProfilerMode mode,
                 const std::vector<std::string>& metrics, std::string* why,
                 const std::uint8_t* counter_availability) {
  // a fresh host object per set: ConfigAddMetrics accumulates
  HostObject host(api, chip, mode, counter_availability);
  if (host.status() != CUPTI_SUCCESS) {
    *why = "cuptiProfilerHostInitialize: " + api.error(host.status());
    return -1;
  }
  std::vector<std::uint8_t> image;
  if (!make_config_image(api, host.get(), metrics, &image, why)) return -1;
  return config_image_passes(api, image, why);
}

MetricOracle host_oracle(const HostApi& api, const HostObject& host, const std::string& chip,
                         ProfilerMode mode, const std::uint8_t* counter_availability) {
  MetricOracle oracle;
  oracle.exists = [&api, &host](const std::string& name) {
    return metric_exists(api, host.get(), name);
  };
  oracle.passes = [&api, &chip, mode, counter_availability](const std::vector<std::string>& metrics,
                                                            std::string* why) {
    return count_passes(api, chip, mode, metrics, why, counter_availability);
  };
  return oracle;
}

namespace {

// Fills `report` for one mode; false (with report->error) when the mode is unusable.
bool check_mode(const HostApi& api, const ChipFamily& family, ProfilerMode mode,
                MetricSetReport* report) {
  report->mode = to_string(mode);
  report->error.clear();
  HostObject host(api, report->chip, mode);
  if (host.status() != CUPTI_SUCCESS) {
    report->error = fmt::format("CUPTI does not accept chip {} for {}: {}", report->chip,
                                report->mode, api.error(host.status()));
    report->metrics.clear();
    return false;
  }
  select_metric_set(counters_for(family, mode), host_oracle(api, host, report->chip, mode, nullptr),
                    report);
  return report->error.empty();
}

}  // namespace
#endif  // STEPTRACE_HAVE_CUPTI_HEADERS

}  // namespace detail::cupti

std::vector<std::string> supported_chips() {
  std::vector<std::string> out;
  for (const auto& f : detail::cupti::chip_families()) {
    out.insert(out.end(), f.chips.begin(), f.chips.end());
  }
  return out;
}

MetricSetReport check_metric_set(const std::string& chip, const std::string& mode,
                                 const std::vector<std::string>& library_dirs) {
  using namespace detail::cupti;
  const ChipFamily* family = find_family(chip);
  if (family == nullptr) throw ConfigError(unsupported_chip_reason(chip));
  if (mode != "auto" && mode != "pm_sampling" && mode != "range_profiler") {
    throw ConfigError(fmt::format(
        "unknown profiler mode \"{}\" (use auto, pm_sampling or range_profiler)", mode));
  }
  const bool pm_ok = family->pm_sampling;
  if (mode == "pm_sampling" && !pm_ok) {
    throw ConfigError(fmt::format("chip {} has no PM sampling; use range_profiler", chip));
  }
  MetricSetReport report;
  report.chip = chip;
  report.family = family->name;
  const ProfilerMode first = (mode == "range_profiler" || !pm_ok) ? ProfilerMode::kRangeProfiler
                                                                  : ProfilerMode::kPmSampling;
  report.mode = to_string(first);
  if (first == ProfilerMode::kPmSampling) {
    report.trigger = family->time_interval_trigger ? "gpu_time_interval" : "gpu_sysclk_interval";
  }
  // The table is listed even when CUPTI cannot check it.
  for (const auto& spec : counters_for(*family, first)) {
    for (const auto& name : spec.candidates) {
      MetricCheck m;
      m.counter = spec.counter;
      m.name = name;
      m.required = spec.required;
      m.note = "not checked";
      report.metrics.push_back(std::move(m));
    }
  }
#if !STEPTRACE_HAVE_CUPTI_HEADERS
  report.error = "built without CUPTI headers: metric sets cannot be checked";
  return report;
#else
  std::string why;
  const Library* lib = load_library(library_dirs, &why);
  if (lib == nullptr) {
    report.error = why;
    return report;
  }
  report.cupti_library = lib->path;
  report.cupti_version = lib->version;
  HostApi api;
  std::string missing;
  if (!api.load(lib->handle, &missing)) {
    report.error = fmt::format(
        "CUPTI {} ({}) has no profiler host API ({} missing): CUPTI 12.6 or newer is needed",
        lib->version, lib->path, missing);
    return report;
  }
  if (check_mode(api, *family, first, &report)) return report;
  if (mode == "auto" && first == ProfilerMode::kPmSampling) {
    const std::string pm_error = report.error;
    if (check_mode(api, *family, ProfilerMode::kRangeProfiler, &report)) {
      report.trigger.clear();
      return report;
    }
    report.error = pm_error + "; range profiler: " + report.error;
  }
  return report;
#endif
}

}  // namespace steptrace
