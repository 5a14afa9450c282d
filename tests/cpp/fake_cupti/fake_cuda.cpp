// A stand-in libcuda.so.1: a fake device that follows the CUDA driver API's documented
// behaviour for the entry points steptrace uses (cuda::Driver resolves them through
// cuGetProcAddress_v2), so that CudaTimer's success path and its CUDA graph capture rules
// run on machines without a GPU. The test drives the device (fake_cuda.hpp): it queues
// work of a given duration on a stream and advances the device clock; events complete
// when their stream reaches them. Also the libcuda half of the range-profiler fake
// (fake_profiler.hpp).
//
// Sources, quoted where each behaviour is modelled: the CUDA Driver API reference
// (docs.nvidia.com/cuda/cuda-driver-api, group__CUDA__EVENT, group__CUDA__STREAM), whose
// text is the doxygen of cuda.h (CUDA 13.0: cuda.h lines cited as "cuda.h:N").
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fake_cuda.hpp"
#include "fake_profiler.hpp"

namespace {

using CUresult = int;

// Values from cuda.h (CUDA 13.0), enum cudaError_enum / CUstreamCaptureStatus /
// CUstreamCaptureMode.
constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidValue = 1;
constexpr CUresult kInvalidDevice = 101;
constexpr CUresult kInvalidContext = 201;
constexpr CUresult kInvalidHandle = 400;
constexpr CUresult kNotFound = 500;
constexpr CUresult kNotReady = 600;
constexpr CUresult kCaptureUnsupported = 900;  // "not permitted when the stream is capturing"
constexpr CUresult kCaptureInvalidated = 901;  // "capture sequence ... has been invalidated"
constexpr CUresult kCaptureUnmatched = 903;    // "capture was not initiated in this stream"
constexpr CUresult kCaptureImplicit = 906;     // "implicit dependency ... from cudaStreamLegacy"
constexpr CUresult kCapturedEvent = 907;  // "event which was last recorded in a capturing stream"
constexpr CUresult kCaptureWrongThread = 908;
constexpr int kStatusNone = 0, kStatusActive = 1, kStatusInvalidated = 2;
constexpr int kModeGlobal = 0, kModeThreadLocal = 1, kModeRelaxed = 2;

struct Event {
  void* ctx = nullptr;
  bool recorded = false;  // cuEventRecord was called on it
  bool captured = false;  // last recorded in a capturing stream
  std::int64_t complete_at_ns = 0;
};

struct Capture {
  int mode = kModeGlobal;
  std::thread::id owner;  // the thread that began it
  bool invalidated = false;
};

struct Stream {
  void* ctx = nullptr;             // the context it belongs to
  std::int64_t busy_until_ns = 0;  // when the device reaches the end of its queue
  bool capturing = false;          // a capture sequence is open on it
  // Created with CU_STREAM_NON_BLOCKING (cuStreamCreate): no implicit synchronization with
  // the legacy stream. Streams first seen by use are blocking ones (CU_STREAM_DEFAULT).
  bool non_blocking = false;
  Capture capture;
};

struct Device {
  std::mutex mu;
  std::int64_t now_ns = 0;
  std::unordered_map<std::uintptr_t, Stream> streams;  // by handle, created on first use
  std::unordered_map<void*, Stream> legacy;            // each context's default stream
  std::unordered_map<void*, Event*> events;            // live events
  std::map<void*, int> context_device;                 // fake_cuda_set_current's devices
  std::map<int, int> primary_retains;                  // by device
  int invalidations = 0;
  int unsafe_calls_during_capture = 0;
  int event_records = 0, event_queries = 0, event_syncs = 0;
};

Device& dev() {
  static Device* d = new Device;  // never destroyed: callers may run during exit
  return *d;
}

std::atomic<void*> g_default_ctx{nullptr};  // fake_cuda_set_current: threads without their own
std::atomic<int> g_device_count{8};
// Each thread's stack of current contexts ("the CPU thread's stack of current contexts",
// cuCtxPushCurrent); a thread that never set one sees fake_cuda_set_current's (a test
// convenience standing for the context the framework made current on its threads).
thread_local std::vector<void*> t_stack;
thread_local bool t_own_stack = false;
thread_local int t_mode = kModeGlobal;  // "This is the default mode" (cuda.h:15454)
constexpr int kMaxDevices = 16;
int g_primary[kMaxDevices];  // the primary contexts' handles: &g_primary[device]

void* current_ctx() {
  if (!t_own_stack) return g_default_ctx.load();
  return t_stack.empty() ? nullptr : t_stack.back();
}
void own_stack() {
  if (t_own_stack) return;
  t_own_stack = true;
  if (void* ctx = g_default_ctx.load(); ctx != nullptr) t_stack.push_back(ctx);
}

// The default handles (NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) name the default
// stream "of the context current to the calling thread" (cuStreamGetCtx); the fake has one
// default stream per context. A created stream belongs to "the context that was active in
// the calling thread when the stream was created" (cuStreamGetCtx): here, its first use
// (or fake_cuda_set_stream_context). nullptr: a default handle with no context current.
bool default_handle(std::uintptr_t h) { return h <= 2; }
Stream* stream_of(Device& d, std::uintptr_t h) {
  if (default_handle(h)) {
    void* ctx = current_ctx();
    if (ctx == nullptr) return nullptr;
    Stream& s = d.legacy[ctx];
    s.ctx = ctx;
    return &s;
  }
  auto [it, created] = d.streams.try_emplace(h);
  if (created) it->second.ctx = current_ctx();
  return &it->second;
}

bool any_capture_live(Device& d) {
  for (auto& [h, s] : d.streams) {
    if (s.capturing) return true;
  }
  return false;
}

// The legacy default stream (NULL or CU_STREAM_LEGACY, not CU_STREAM_PER_THREAD) "while a
// blocking stream in the same context is capturing" (cuStreamIsCapturing). A non-blocking
// stream's capture leaves it alone: the legacy stream "synchronizes with all other streams
// in the same CUcontext except for non-blocking streams" (Driver API, 3. Stream
// synchronization behavior), so using it creates no dependency on that capture; "when any
// stream in the same context is being captured, and it was not created with
// cudaStreamNonBlocking, any attempted use of the legacy stream is invalid" (CUDA C++
// Programming Guide, CUDA Graphs, Prohibited and Unhandled Operations).
bool blocks_legacy(const Stream& s, void* ctx) {
  return s.capturing && !s.non_blocking && s.ctx == ctx;
}
bool legacy_blocked(Device& d, std::uintptr_t h) {
  if (h > 1) return false;
  void* ctx = current_ctx();
  for (auto& [sh, s] : d.streams) {
    if (blocks_legacy(s, ctx)) return true;
  }
  return false;
}

// A potentially unsafe call (an event query or wait: PyTorch's NCCL watchdog's
// cudaEventQuery broke captures on other threads until it ran in thread-local mode,
// pytorch/pytorch#104555, #148594) from this thread. cuThreadExchangeStreamCaptureMode's
// documentation (cuda.h:15453-15465): in GLOBAL mode a thread "is prohibited from
// potentially unsafe API calls" if "the local thread has an ongoing capture sequence that
// was not initiated with CU_STREAM_CAPTURE_MODE_RELAXED" or "any other thread has a
// concurrent capture sequence initiated with CU_STREAM_CAPTURE_MODE_GLOBAL"; in
// THREAD_LOCAL only the first applies; in RELAXED neither. The prohibited call fails with
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the captures it conflicts with
// (their cuStreamEndCapture then fails). Returns kSuccess when the call may go on.
CUresult unsafe_call(Device& d) {
  const auto self = std::this_thread::get_id();
  CUresult r = kSuccess;
  for (auto& [h, s] : d.streams) {
    if (!s.capturing || s.capture.invalidated) continue;
    const bool own =
        s.capture.owner == self && s.capture.mode != kModeRelaxed && t_mode != kModeRelaxed;
    const bool other =
        s.capture.owner != self && s.capture.mode == kModeGlobal && t_mode == kModeGlobal;
    if (own || other) {
      s.capture.invalidated = true;
      ++d.invalidations;
      r = kCaptureUnsupported;
    }
  }
  if (r == kSuccess && any_capture_live(d)) ++d.unsafe_calls_during_capture;
  return r;
}

Event* find_event(Device& d, void* h) {
  auto it = d.events.find(h);
  return it == d.events.end() ? nullptr : it->second;
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned int) { return kSuccess; }
CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return kSuccess;
}

// ---- contexts ----

void fake_cuda_set_current(void* ctx, int device) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  g_default_ctx.store(ctx);
  if (ctx != nullptr) d.context_device[ctx] = device;
}
void* fake_cuda_current() { return current_ctx(); }
void fake_cuda_set_device_count(int n) { g_device_count.store(n); }

CUresult cuDeviceGetCount(int* n) {
  *n = g_device_count.load();
  return kSuccess;
}

// "Binds the specified CUDA context to the calling CPU thread. If ctx is NULL then this
// will be equivalent to popping the top of the calling CPU thread's CUDA context stack
// (or a no-op if the calling CPU thread's stack is empty). If there exists a CUDA context
// stack on the calling CPU thread, this will replace the top of that stack with ctx"
// (cuCtxSetCurrent).
CUresult cuCtxSetCurrent(void* ctx) {
  own_stack();
  if (ctx == nullptr) {
    if (!t_stack.empty()) t_stack.pop_back();
  } else if (t_stack.empty()) {
    t_stack.push_back(ctx);
  } else {
    t_stack.back() = ctx;
  }
  return kSuccess;
}
// "Pushes the given context ctx onto the CPU thread's stack of current contexts. The
// specified context becomes the CPU thread's current context" (cuCtxPushCurrent).
CUresult cuCtxPushCurrent(void* ctx) {
  if (ctx == nullptr) return kInvalidValue;
  own_stack();
  t_stack.push_back(ctx);
  return kSuccess;
}
// "Pops the current CUDA context from the CPU thread and passes back the old context
// handle ... If a context was current to the CPU thread before cuCtxCreate() or
// cuCtxPushCurrent() was called, this function makes that context current to the CPU
// thread again" (cuCtxPopCurrent); CUDA_ERROR_INVALID_CONTEXT without one.
CUresult cuCtxPopCurrent(void** ctx) {
  own_stack();
  if (t_stack.empty()) return kInvalidContext;
  if (ctx != nullptr) *ctx = t_stack.back();
  t_stack.pop_back();
  return kSuccess;
}
// "Retains the primary context on the device, creating it if necessary" (cuDevicePrimary-
// CtxRetain); one primary context per device, whoever retains it; released as many times.
CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  if (device < 0 || device >= std::min(g_device_count.load(), kMaxDevices)) return kInvalidDevice;
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  *ctx = &g_primary[device];
  d.context_device[*ctx] = device;
  ++d.primary_retains[device];
  return kSuccess;
}
CUresult cuDevicePrimaryCtxRelease(int device) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.primary_retains[device] <= 0) return kInvalidContext;  // not retained
  --d.primary_retains[device];
  return kSuccess;
}
void* fake_cuda_primary_context(int device) { return &g_primary[device]; }
int fake_cuda_primary_retains(int device) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.primary_retains[device];
}
// "Returns the CUDA context that the stream is associated with"; for the special handles
// "the context current to the calling thread. If no context is current to the calling
// thread, CUDA_ERROR_INVALID_CONTEXT is returned" (cuStreamGetCtx).
CUresult cuStreamGetCtx(void* stream, void** ctx) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  Stream* s = stream_of(d, reinterpret_cast<std::uintptr_t>(stream));
  if (s == nullptr || s->ctx == nullptr) return kInvalidContext;
  *ctx = s->ctx;
  return kSuccess;
}
void fake_cuda_set_stream_context(std::uintptr_t stream, void* ctx) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  d.streams[stream].ctx = ctx;
}
CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = current_ctx();
  return kSuccess;
}
CUresult cuCtxGetDevice(int* device) {
  void* ctx = current_ctx();
  if (ctx == nullptr) return kInvalidContext;
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.context_device.find(ctx);
  *device = it == d.context_device.end() ? 0 : it->second;
  return kSuccess;
}
CUresult cuDeviceGetName(char* name, int len, int) {
  std::strncpy(name, "Fake H200", static_cast<std::size_t>(len));
  return kSuccess;
}
CUresult cuDeviceTotalMem(std::size_t* bytes, int) {
  *bytes = 141ULL << 30;
  return kSuccess;
}

// ---- device identity (the NVML backend maps CUDA devices to NVML through the PCI bus id) ----

// "Returns a handle to a compute device": ordinals 0 .. count-1, else
// CUDA_ERROR_INVALID_DEVICE (101).
CUresult cuDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= g_device_count.load()) return 101;
  *device = ordinal;
  return kSuccess;
}
// "Returns an ASCII string identifying the device ... in the following format
// [domain]:[bus]:[device].[function] where domain, bus, device, and function are all
// hexadecimal values" (13 characters with the NUL). Device i: 0000:<1B+16i>:00.0 unless the
// test set another (fake_cuda_set_pci_bus_id), as CUDA's order may differ from the bus order.
std::mutex g_pci_mu;
std::map<int, std::string> g_pci_bus_ids;
void fake_cuda_set_pci_bus_id(int device, const char* bus_id) {
  std::lock_guard<std::mutex> lock(g_pci_mu);
  if (bus_id == nullptr) {
    g_pci_bus_ids.erase(device);
  } else {
    g_pci_bus_ids[device] = bus_id;
  }
}
CUresult cuDeviceGetPCIBusId(char* pci_bus_id, int len, int device) {
  if (device < 0 || device >= g_device_count.load()) return 101;
  if (pci_bus_id == nullptr || len <= 0) return kInvalidValue;
  char id[16];
  std::snprintf(id, sizeof id, "0000:%02X:00.0", 0x1B + 16 * device);
  std::lock_guard<std::mutex> lock(g_pci_mu);
  const auto it = g_pci_bus_ids.find(device);
  std::snprintf(pci_bus_id, static_cast<std::size_t>(len), "%s",
                it != g_pci_bus_ids.end() ? it->second.c_str() : id);
  return kSuccess;
}

// ---- the test's device controls (fake_cuda.hpp) ----

void fake_cuda_reset() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  d.now_ns = 0;
  d.streams.clear();
  d.legacy.clear();
  d.invalidations = 0;
  d.unsafe_calls_during_capture = 0;
  d.event_records = d.event_queries = d.event_syncs = 0;
}
void fake_cuda_enqueue(std::uintptr_t stream, double ms) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  Stream* s = stream_of(d, stream);
  if (s == nullptr || s->capturing) return;  // no context; or captured, not executed
  const auto ns = static_cast<std::int64_t>(ms * 1e6);
  s->busy_until_ns = std::max(s->busy_until_ns, d.now_ns) + ns;
}
void fake_cuda_advance(double ms) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  d.now_ns += static_cast<std::int64_t>(ms * 1e6);
}
double fake_cuda_now_ms() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return static_cast<double>(d.now_ns) / 1e6;
}
int fake_cuda_invalidated_captures() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.invalidations;
}
int fake_cuda_unsafe_calls_during_capture() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.unsafe_calls_during_capture;
}
int fake_cuda_live_events() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return static_cast<int>(d.events.size());
}
int fake_cuda_event_records() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.event_records;
}
int fake_cuda_event_queries() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.event_queries;
}
int fake_cuda_event_syncs() {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.event_syncs;
}

// ---- events (group__CUDA__EVENT) ----

// "Creates an event *phEvent for the current context" (cuEventCreate); without one,
// CUDA_ERROR_INVALID_CONTEXT (its documented returns).
CUresult cuEventCreate(void** event, unsigned int) {
  void* ctx = current_ctx();
  if (ctx == nullptr) return kInvalidContext;
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  auto* e = new Event;
  e->ctx = ctx;
  d.events[e] = e;
  *event = e;
  return kSuccess;
}

CUresult cuEventDestroy(void* event) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  Event* e = find_event(d, event);
  if (e == nullptr) return kInvalidHandle;
  d.events.erase(event);
  delete e;
  return kSuccess;
}

// "Captures in hEvent the contents of hStream at the time of this call ... Uses of hStream
// after this call do not modify hEvent" and "can be called multiple times on the same
// event and will overwrite the previously captured state" (cuEventRecord, cuda.h:15950+):
// the event completes when the device reaches the end of what the stream has queued now.
// On a capturing stream the record is captured into the graph: the event is then "last
// recorded in a capturing stream" (CUDA_ERROR_CAPTURED_EVENT). The legacy stream (0)
// while a blocking stream is capturing: "the legacy stream is in an unusable state until
// the blocking stream capture is terminated ... attempted use would have an implicit
// dependency on the capturing stream(s)" (cuStreamIsCapturing), which breaks the capture.
// Only blocking streams block it (legacy_blocked).
CUresult cuEventRecord(void* event, void* stream) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  ++d.event_records;
  Event* e = find_event(d, event);
  if (e == nullptr) return kInvalidHandle;
  const auto h = reinterpret_cast<std::uintptr_t>(stream);
  if (legacy_blocked(d, h)) {
    for (auto& [sh, s] : d.streams) {
      if (blocks_legacy(s, current_ctx()) && !s.capture.invalidated) {
        s.capture.invalidated = true;
        ++d.invalidations;
      }
    }
    return kCaptureImplicit;
  }
  Stream* sp = stream_of(d, h);
  if (sp == nullptr) return kInvalidContext;
  Stream& s = *sp;
  // "hEvent and hStream must be from the same context otherwise CUDA_ERROR_INVALID_HANDLE
  // is returned" (cuEventRecord, cuda.h).
  if (e->ctx != s.ctx) return kInvalidHandle;
  e->recorded = true;
  if (s.capturing) {
    e->captured = true;
    return kSuccess;
  }
  e->captured = false;
  std::int64_t at = std::max(s.busy_until_ns, d.now_ns);
  if (h <= 1) {  // the legacy stream "first waits on all blocking streams" (Stream sync behavior)
    for (auto& [sh, other] : d.streams) {
      if (other.ctx == s.ctx && !other.non_blocking) at = std::max(at, other.busy_until_ns);
    }
  }
  e->complete_at_ns = at;
  return kSuccess;
}

// "Returns CUDA_SUCCESS if all captured work has been completed, or CUDA_ERROR_NOT_READY
// if any captured work is incomplete"; "Before the first call to cuEventRecord(), an event
// represents an empty set of work, so for example cuEventQuery() would return
// CUDA_SUCCESS" (cuEventQuery, cuEventRecord). Even a relaxed thread may not query an
// event "last recorded inside a capture sequence" (cuda.h:15463-15465).
CUresult cuEventQuery(void* event) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  ++d.event_queries;
  Event* e = find_event(d, event);
  if (e == nullptr) return kInvalidHandle;
  if (e->captured) return kCapturedEvent;
  if (const CUresult r = unsafe_call(d); r != kSuccess) return r;
  if (!e->recorded) return kSuccess;
  return d.now_ns >= e->complete_at_ns ? kSuccess : kNotReady;
}

// "Waits until the completion of all work currently captured in hEvent" (cuEventSynchronize):
// the host waits, so the fake device clock moves on to the event's completion.
CUresult cuEventSynchronize(void* event) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  ++d.event_syncs;
  Event* e = find_event(d, event);
  if (e == nullptr) return kInvalidHandle;
  if (e->captured) return kCapturedEvent;
  if (const CUresult r = unsafe_call(d); r != kSuccess) return r;
  if (e->recorded) d.now_ns = std::max(d.now_ns, e->complete_at_ns);
  return kSuccess;
}

// "If cuEventRecord() has not been called on either event then CUDA_ERROR_INVALID_HANDLE
// is returned. If cuEventRecord() has been called on both events but one or both of them
// has not yet been completed ..., CUDA_ERROR_NOT_READY is returned" (cuEventElapsedTime,
// cuda.h:16152-16156). Not permitted on a captured event (CUDA_ERROR_CAPTURED_EVENT).
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  Event* a = find_event(d, start);
  Event* b = find_event(d, end);
  if (a == nullptr || b == nullptr || !a->recorded || !b->recorded) return kInvalidHandle;
  if (a->captured || b->captured) return kCapturedEvent;
  // "cudaEventElapsedTime() will fail if the two input events are associated to different
  // devices" (CUDA C++ Programming Guide, Stream and Event Behavior): here, contexts.
  if (a->ctx != b->ctx) return kInvalidHandle;
  if (d.now_ns < a->complete_at_ns || d.now_ns < b->complete_at_ns) return kNotReady;
  *ms = static_cast<float>(static_cast<double>(b->complete_at_ns - a->complete_at_ns) / 1e6);
  return kSuccess;
}

// ---- streams and stream capture (group__CUDA__STREAM) ----

// "Creates a stream and returns a handle in phStream"; flags CU_STREAM_DEFAULT (0) or
// CU_STREAM_NON_BLOCKING (1): "work running in the created stream may run concurrently
// with work in stream 0 (the NULL stream), and ... the created stream should perform no
// implicit synchronization with stream 0" (cuStreamCreate). It belongs to the context
// current on the calling thread; without one, CUDA_ERROR_INVALID_CONTEXT. PyTorch's pool
// streams (torch.cuda.Stream(), the capture stream of torch.cuda.graph) are created
// non-blocking (c10/cuda/CUDAStream.cpp: kDefaultFlags = cudaStreamNonBlocking).
CUresult cuStreamCreate(void** stream, unsigned int flags) {
  if (stream == nullptr || flags > 1) return kInvalidValue;
  void* ctx = current_ctx();
  if (ctx == nullptr) return kInvalidContext;
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  static std::uintptr_t next = 0x9000;
  while (d.streams.count(next) != 0) next += 0x100;
  Stream& s = d.streams[next];
  s.ctx = ctx;
  s.non_blocking = flags == 1;
  *stream = reinterpret_cast<void*>(next);
  next += 0x100;
  return kSuccess;
}

// "Capture may not be initiated if stream is CU_STREAM_LEGACY ... it may only be initiated
// if the stream is not already in capture mode" (cuStreamBeginCapture).
CUresult cuStreamBeginCapture_v2(void* stream, int mode) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  const auto h = reinterpret_cast<std::uintptr_t>(stream);
  if (default_handle(h)) return kCaptureUnsupported;
  Stream& s = *stream_of(d, h);
  if (s.capturing) return kInvalidValue;
  s.capturing = true;
  s.capture = Capture{mode, std::this_thread::get_id(), false};
  return kSuccess;
}

// "If capture was invalidated, due to a violation of the rules of stream capture, then a
// NULL graph will be returned"; "If the mode argument to cuStreamBeginCapture was not
// CU_STREAM_CAPTURE_MODE_RELAXED, this call must be from the same thread"
// (cuStreamEndCapture, cuda.h:15485-15492). The runtime's cudaStreamEndCapture reports an
// invalidated capture as cudaErrorStreamCaptureInvalidated, which is what the fake returns.
CUresult cuStreamEndCapture(void* stream, void** graph) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  *graph = nullptr;
  auto it = d.streams.find(reinterpret_cast<std::uintptr_t>(stream));
  if (it == d.streams.end() || !it->second.capturing) return kCaptureUnmatched;
  Stream& s = it->second;
  if (s.capture.mode != kModeRelaxed && s.capture.owner != std::this_thread::get_id()) {
    return kCaptureWrongThread;
  }
  s.capturing = false;
  if (s.capture.invalidated) return kCaptureInvalidated;
  static int graph_token = 0;
  *graph = &graph_token;
  return kSuccess;
}

// NONE / ACTIVE / INVALIDATED; "if this is called on CU_STREAM_LEGACY (the 'null stream')
// while a blocking stream in the same context is capturing, it will return
// CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and *captureStatus is unspecified" (cuStreamIsCapturing).
CUresult cuStreamIsCapturing(void* stream, int* status) {
  Device& d = dev();
  std::lock_guard<std::mutex> lock(d.mu);
  const auto h = reinterpret_cast<std::uintptr_t>(stream);
  if (default_handle(h)) {
    if (current_ctx() == nullptr) return kInvalidContext;
    if (legacy_blocked(d, h)) return kCaptureImplicit;
    *status = kStatusNone;
    return kSuccess;
  }
  auto it = d.streams.find(h);
  if (it == d.streams.end() || !it->second.capturing) {
    *status = kStatusNone;
  } else {
    *status = it->second.capture.invalidated ? kStatusInvalidated : kStatusActive;
  }
  return kSuccess;
}

// "Sets the calling thread's stream capture interaction mode to the value contained in
// *mode, and overwrites *mode with the previous mode for the thread" (cuda.h:15432-15433).
CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  if (mode == nullptr || *mode < kModeGlobal || *mode > kModeRelaxed) return kInvalidValue;
  std::swap(t_mode, *mode);
  return kSuccess;
}

CUresult cuGetErrorName(CUresult r, const char** name) {
  switch (r) {
    case kNotReady:
      *name = "CUDA_ERROR_NOT_READY";
      break;
    case kInvalidHandle:
      *name = "CUDA_ERROR_INVALID_HANDLE";
      break;
    case kInvalidContext:
      *name = "CUDA_ERROR_INVALID_CONTEXT";
      break;
    case kInvalidDevice:
      *name = "CUDA_ERROR_INVALID_DEVICE";
      break;
    case kCaptureUnsupported:
      *name = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
      break;
    case kCaptureImplicit:
      *name = "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
      break;
    case kCapturedEvent:
      *name = "CUDA_ERROR_CAPTURED_EVENT";
      break;
    default:
      *name = "CUDA_ERROR_FAKE";
      break;
  }
  return kSuccess;
}

// Entry points by name: this library's own first (it may be loaded RTLD_LOCAL, as
// cuda::Driver loads libcuda, where RTLD_DEFAULT does not see it), then the process's.
CUresult cuGetProcAddress_v2(const char* symbol, void** fn, int, std::uint64_t, int* status) {
  static void* self = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&cuInit), &info) == 0 || info.dli_fname == nullptr) {
      return static_cast<void*>(nullptr);
    }
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }();
  *fn = self != nullptr ? dlsym(self, symbol) : nullptr;
  if (*fn == nullptr) *fn = dlsym(RTLD_DEFAULT, symbol);
  if (status != nullptr) *status = *fn != nullptr ? 0 : 1;
  return *fn != nullptr ? kSuccess : kNotFound;
}

}  // extern "C"
