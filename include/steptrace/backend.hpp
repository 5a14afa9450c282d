// Interfaces through which the profiler reaches clocks and memory statistics. The core
// depends only on these; real backends (host clock, process RSS, the LibTorch allocator)
// and their fakes (tests) implement them and come in through Profiler's constructor.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "steptrace/export.hpp"

namespace steptrace {

/// A monotonic clock in nanoseconds. Called on the training thread at every phase
/// boundary: must be cheap and noexcept.
class STEPTRACE_API Clock {
 public:
  virtual ~Clock() = default;
  virtual std::int64_t now_ns() noexcept = 0;
};

/// Memory figures of one step in bytes; a negative value means "not measured".
struct MemorySample {
  std::int64_t allocated_bytes = -1;     // torch allocator: live tensors
  std::int64_t reserved_bytes = -1;      // torch allocator: held from the device
  std::int64_t peak_bytes = -1;          // torch allocator: peak since the last step
  std::int64_t rss_bytes = -1;           // process resident set size
  std::int64_t heap_bytes = -1;          // C heap in use (glibc mallinfo2), on steps it was read
  std::int64_t device_used_bytes = -1;   // device-wide used memory (all processes)
  std::int64_t device_total_bytes = -1;  // device memory size
};

/// A source of memory statistics, sampled once at the end of every step on the training
/// thread. Fills the fields it knows and leaves the others alone. Must be noexcept.
class STEPTRACE_API MemorySource {
 public:
  virtual ~MemorySource() = default;
  /// Short name recorded in run_start ("rss", "torch_cuda_allocator", ...).
  virtual const char* name() const noexcept = 0;
  virtual void sample(MemorySample& out) noexcept = 0;
  /// Sample at most this often (steps in between repeat the last figures); 0: every step.
  virtual std::int64_t min_interval_ns() const noexcept { return 0; }
  /// Allocated bytes now, without side effects (sample() may reset a per-step peak), for
  /// attributing memory growth to phases; -1 when this source has no such figure.
  virtual std::int64_t live_bytes() noexcept { return -1; }
};

/// A device stream as the framework names it: the handle (a CUstream / cudaStream_t as an
/// integer; 0 is the legacy default stream, 1 CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD) and
/// the CUDA device it belongs to (-1: unknown). The special handles mean "the default
/// stream of the calling thread's current context"; with a device, the default stream of
/// that device's primary context (what torch.cuda.current_stream(device) reports), so that
/// a step on a thread with no current context, or with another device's context current,
/// is timed on the device the framework named.
struct DeviceStream {
  std::uintptr_t handle = 0;
  int device = -1;
  bool operator==(const DeviceStream& o) const noexcept {
    return handle == o.handle && device == o.device;
  }
};

/// Times work on a device with events recorded on a stream and resolved later, so that
/// nothing waits for the device per step (CUDA events; a fake in tests). Used from the
/// training thread only. Handles are small integers from the backend's event pool.
/// Nothing throws: a failure returns kError / false and the profiler falls back to the
/// host clock for the rest of the run, recording why (last_error).
class STEPTRACE_API DeviceTimer {
 public:
  enum class Status { kReady, kPending, kError };
  virtual ~DeviceTimer() = default;
  /// "cuda", "fake", ...
  virtual const char* name() const noexcept = 0;
  /// Records an event on `stream`, in the stream's context whatever context the calling
  /// thread has current. Returns its handle, -1 on failure, or -2 when the stream is
  /// capturing a CUDA graph (no event may be recorded there: the step is host-timed).
  virtual int record(DeviceStream stream) noexcept = 0;
  /// kReady once the device has passed the event (never blocks).
  virtual Status query(int event) noexcept = 0;
  /// Device milliseconds between two completed events.
  virtual bool elapsed_ms(int start, int end, float* ms) noexcept = 0;
  /// Blocks until the event has completed (only when the in-flight bound is reached,
  /// and at close).
  virtual bool synchronize(int event) noexcept = 0;
  /// Returns the event to the pool.
  virtual void release(int event) noexcept = 0;
  /// Events handed out and not yet released (a leak check for tests).
  virtual int live_events() const noexcept = 0;
  /// One line on the last failure.
  virtual std::string last_error() const = 0;
  /// Name and total memory of the device events were last recorded on (before any, the
  /// calling thread's current device), when known.
  virtual std::string device_name() const { return {}; }
  virtual std::int64_t device_memory_bytes() const { return -1; }
};

/// The stream device events go on, asked at the start of every step (the framework's
/// current stream; the LibTorch adapter's is c10's). Training thread; noexcept.
class STEPTRACE_API StreamSource {
 public:
  virtual ~StreamSource() = default;
  /// False when there is no device stream now (the step uses the host clock).
  virtual bool current(DeviceStream* stream) noexcept = 0;
};

/// What a kernel's device time counts as in the step record (see `kernels` in the schema).
enum class KernelWork : std::uint8_t {
  kCompute,        // any kernel that is not communication
  kMatmul,         // compute on the tensor-core path: gemm, convolution, attention
  kCommunication,  // NCCL collectives and send/recv
};

/// One kernel execution, as a kernel-activity backend delivers it (some time after it ran).
struct KernelRecord {
  std::int64_t step = -1;     // the step it was launched in; -1: outside any step
  std::int64_t start_ns = 0;  // device start and end, on the backend's clock (now_ns)
  std::int64_t end_ns = 0;
  std::uint32_t name_id = 0;  // KernelActivitySource::kernel_name(name_id)
  KernelWork work = KernelWork::kCompute;
};

/// Whether the kernel records of work launched from some time on can reach a kernel
/// activity backend (KernelActivitySource::reach).
enum class ActivityReach : std::uint8_t {
  kReaching,  // they can (or the backend cannot tell otherwise)
  kUnheard,   // its buffer callbacks have not run since then: if work was launched, its
              // records went to another tool's callbacks (on-demand Kineto, proton)
  kStopped,   // collection had stopped by then; status() says why
};

/// Kernel activity of the device (CUPTI activity records; a fake in tests): which
/// kernels ran when, tagged with the step that launched them. Records arrive in batches,
/// well after the kernels ran; nothing waits for them per step.
class STEPTRACE_API KernelActivitySource {
 public:
  virtual ~KernelActivitySource() = default;
  /// "cupti", "fake", ...
  virtual const char* name() const noexcept = 0;
  /// Now on the clock of the records' timestamps. Training thread; cheap.
  virtual std::int64_t now_ns() noexcept = 0;
  /// Training thread: device work launched from now until end_step belongs to `step`,
  /// from whichever thread it is launched (autograd's backward thread, communication
  /// hooks). No allocation, no locks.
  virtual void begin_step(std::int64_t step) noexcept = 0;
  virtual void end_step(std::int64_t step) noexcept = 0;
  /// Writer thread: appends the records delivered since the last call, and adds the
  /// records the backend lost since then (full buffers) to *dropped.
  virtual void take(std::vector<KernelRecord>& out, std::int64_t* dropped) = 0;
  /// Deliveries completed so far. A delivery that starts after a kernel finished brings
  /// its record, provided delivered() says so too: work done before this returned g is
  /// delivered once it returns g + 2 and delivered(delivery_mark() as read then) is true.
  virtual std::uint64_t deliveries() noexcept = 0;
  /// Writer thread: a mark of what the backend holds undelivered now (CUPTI: the
  /// activity buffers handed out so far, the one being filled included). Backends that
  /// hand over whole batches at each delivery (the fakes) keep the default.
  virtual std::uint64_t delivery_mark() noexcept { return 0; }
  /// True once everything held at delivery_mark() == mark has been delivered (CUPTI:
  /// those buffers have all come back, which on a busy device happens once the last of
  /// them is full).
  virtual bool delivered(std::uint64_t /*mark*/) noexcept { return true; }
  /// The kernel's name (as the device reports it, possibly mangled). Writer thread.
  virtual std::string kernel_name(std::uint32_t name_id) = 0;
  /// Writer thread: whether the records of work launched from `t_ns` on (now_ns()'s
  /// clock) can have reached the backend, so that a step without kernels is told apart
  /// from a step whose kernels were not collected. Backends that always collect keep the
  /// default.
  virtual ActivityReach reach(std::int64_t /*t_ns*/) noexcept { return ActivityReach::kReaching; }
  /// Any thread: another tool (torch.profiler) takes over activity collection (true)
  /// or has stopped (false). While yielding, the backend tags and collects nothing and
  /// leaves the kinds alone, since the activity buffers and kinds are process-wide and
  /// then belong to the other tool (it only gets its own buffers back first, and hands
  /// out no new one); after, it registers and enables its own again.
  virtual void set_yielding(bool yielding) noexcept = 0;
  /// At close, after the device has synchronized: delivers everything and stops.
  virtual void finish() noexcept = 0;
  /// "" while collecting; else why it stopped or is paused (one line).
  virtual std::string status() const = 0;
};

/// The hardware counters of the step record, in the order of CounterSample::values.
inline constexpr std::size_t kCounterCount = 4;
inline constexpr const char* kCounterNames[kCounterCount] = {
    "tensor_active_pct", "dram_throughput_pct", "sm_occupancy_pct", "sm_throughput_pct"};

/// Counter values over an interval of device time; NaN where a counter was not measured.
struct CounterSample {
  std::int64_t step = -1;     // >= 0: measured over exactly this step (a range per step)
  std::int64_t start_ns = 0;  // else aligned to steps by time, on the sampler's clock
  std::int64_t end_ns = 0;
  double values[kCounterCount] = {};
};

/// Hardware-counter sampling (CUPTI PM sampling or range profiler; a fake in tests).
/// Samples are decoded on a background thread and handed over in batches.
class STEPTRACE_API CounterSampler {
 public:
  virtual ~CounterSampler() = default;
  /// "cupti_pm_sampling", "cupti_range_profiler", "fake", ...
  virtual const char* name() const noexcept = 0;
  /// Now on the clock of the samples' timestamps. Training thread; cheap.
  virtual std::int64_t now_ns() noexcept = 0;
  /// Training thread, at every step boundary: `sampled` says whether the profiler wants
  /// counters for this step (the sampler may keep sampling a little longer, since the
  /// device runs behind the host). No allocation, no locks.
  virtual void begin_step(std::int64_t step, bool sampled) noexcept = 0;
  virtual void end_step(std::int64_t step) noexcept = 0;
  /// Writer thread: appends the samples decoded since the last call; adds the samples
  /// lost since then to *dropped and sets *overflow when the hardware buffer overflowed.
  virtual void take(std::vector<CounterSample>& out, std::int64_t* dropped, bool* overflow) = 0;
  /// Deliveries completed so far (same contract as KernelActivitySource::deliveries).
  virtual std::uint64_t deliveries() noexcept = 0;
  /// The device metric behind each counter, "" where it is not measured (for run_start).
  virtual std::string metric(std::size_t counter) const = 0;
  /// The device sampled and how it was chosen ("device 3 (LOCAL_RANK=3)"), for run_start;
  /// "" when the backend has no such notion.
  virtual std::string device() const { return {}; }
  /// At close, after the device has synchronized: decodes everything and stops.
  virtual void finish() noexcept = 0;
  /// "" while sampling; else why it stopped (one line).
  virtual std::string status() const = 0;
};

/// One reading of the device's hardware state (NVML; a fake library in tests). NaN where
/// the device does not report a figure.
struct TelemetrySample {
  std::int64_t t_ns = 0;               // on TelemetrySource::now_ns()'s clock
  double power_w = 0;                  // board power draw
  double energy_j = 0;                 // cumulative energy counter since driver load
  double temp_c = 0;                   // GPU temperature
  double sm_clock_mhz = 0;             // SM clock
  double util_pct = 0;                 // GPU utilization (share of time a kernel ran)
  std::uint64_t throttle_reasons = 0;  // NVML clock event reason bits
  // Optional readings: NaN, or -1 for counters, where the device does not report them.
  double pcie_tx_mb_s = std::numeric_limits<double>::quiet_NaN();  // PCIe TX, MB/s
  double pcie_rx_mb_s = std::numeric_limits<double>::quiet_NaN();  // PCIe RX, MB/s
  // NVLink data TX / RX, MB/s, summed over the active links: the growth of their
  // throughput counters since the reading before (NaN on the first reading)
  double nvlink_tx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double nvlink_rx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double mem_clock_mhz = std::numeric_limits<double>::quiet_NaN();  // memory clock
  double mem_temp_c = std::numeric_limits<double>::quiet_NaN();     // HBM temperature
  std::int64_t nvlink_crc_errors = -1;     // CRC flit errors summed over active links
  std::int64_t nvlink_replay_errors = -1;  // replay errors summed over active links
  std::int64_t remap_corrected = -1;       // remapped rows: correctable
  std::int64_t remap_uncorrected = -1;     // remapped rows: uncorrectable
  std::int64_t remap_pending = -1;         // 1: a remap waits for a GPU reset
  std::int64_t remap_failure = -1;         // 1: a remap failed
};

/// A hardware fault the sampler found: a critical XID event, a rise of the volatile
/// uncorrected ECC count, NVLink CRC errors that keep growing, or a new uncorrectable
/// row remap or remap failure.
struct HardwareError {
  std::int64_t t_ns = 0;
  std::string kind;         // "xid", "ecc_uncorrected", "nvlink_crc" or "remapped_rows"
  std::uint64_t code = 0;   // the XID, or the new count
  std::uint64_t delta = 0;  // the counts: the rise that raised it
};

/// GPU hardware telemetry read on a background thread (never the training thread) every
/// interval. Samples are handed over in batches to the writer thread.
class STEPTRACE_API TelemetrySource {
 public:
  virtual ~TelemetrySource() = default;
  /// "nvml", "fake", ...
  virtual const char* name() const noexcept = 0;
  /// Now on the samples' clock. Training thread, at step boundaries: must be cheap.
  virtual std::int64_t now_ns() noexcept = 0;
  /// The device's enforced power limit in W; 0 when unknown.
  virtual double power_limit_w() const noexcept = 0;
  /// The device sampled and how it was chosen, for run_start.
  virtual std::string device() const { return {}; }
  /// Called for every hardware error as the sampler finds it (on the sampler thread).
  /// Set once, before start().
  virtual void set_error_handler(std::function<void(const HardwareError&)> handler) = 0;
  /// Starts sampling (no-op for sources sampled by hand).
  virtual void start() = 0;
  /// Writer thread: appends the samples read since the last call, oldest first.
  virtual void take(std::vector<TelemetrySample>& out) = 0;
  /// Stops the sampler thread (idempotent).
  virtual void finish() noexcept = 0;
  /// "" while sampling; else why it stopped.
  virtual std::string status() const = 0;
  /// The sample figures that are the whole board's rather than the device's the steps run
  /// on (a MIG slice: power, energy, temperature, clocks, PCIe, NVLink); empty otherwise.
  virtual std::vector<std::string> board_wide() const { return {}; }
  /// Device-wide used and total memory (every process's) at the latest reading: false when
  /// the source does not read it; -1 until its first reading. Training thread, at step
  /// ends: must be cheap (no driver call).
  virtual bool device_memory(std::int64_t* used, std::int64_t* total) const noexcept {
    (void)used;
    (void)total;
    return false;
  }
};

/// NVML telemetry of CUDA device `device_index` (-1: $LOCAL_RANK, else 0), found through
/// its PCI bus id where libcuda is there, else through CUDA_VISIBLE_DEVICES (a GPU UUID,
/// whole or a prefix; a MIG UUID: its board; an index), from libnvidia-ml.so.1 loaded at run
/// time ($STEPTRACE_NVML_LIBRARY overrides the path). `interval_ms` > 0: a sampler thread
/// reads every interval_ms once start() is called; 0: no thread, sample_nvml_now() reads
/// (deterministic tests). `clock`: the samples' clock (not owned; null: CLOCK_MONOTONIC).
/// nullptr when unavailable; `why_not` then says why in one line.
STEPTRACE_API std::unique_ptr<TelemetrySource> make_nvml_telemetry(int device_index,
                                                                   int interval_ms,
                                                                   std::string* why_not,
                                                                   Clock* clock = nullptr);
/// Reads one sample now on the calling thread (a source from make_nvml_telemetry with
/// interval_ms = 0); false when `source` is not one, or the read failed.
STEPTRACE_API bool sample_nvml_now(TelemetrySource& source);

/// Kernel activity through CUPTI, loaded at run time (the copy already in the process
/// when there is one). nullptr when unavailable; `why_not` then says why in one line.
/// `yielding`: another tool (torch.profiler) owns CUPTI's activity buffers now; nothing
/// is registered or enabled until set_yielding(false).
STEPTRACE_API std::unique_ptr<KernelActivitySource> make_cupti_activity(std::string* why_not,
                                                                        bool yielding = false);
/// Hardware counters through CUPTI PM sampling on CUDA device `device_index` (-1: the
/// rank's own: $LOCAL_RANK when it names a visible device, else the current context's,
/// else device 0), with the metric set chosen for its chip. nullptr when unavailable.
STEPTRACE_API std::unique_ptr<CounterSampler> make_cupti_counter_sampler(int device_index,
                                                                         std::string* why_not);

/// The CUDA event timer, through the driver API loaded at run time (libcuda.so.1, found
/// via dlopen; entry points from cuGetProcAddress), so that one build runs with CUDA 12
/// or 13 drivers and without any. nullptr when unavailable; `why_not` then says why.
STEPTRACE_API std::unique_ptr<DeviceTimer> make_cuda_timer(std::string* why_not);

/// The steady host clock (CLOCK_MONOTONIC).
STEPTRACE_API std::unique_ptr<Clock> make_host_clock();
/// Resident set size of this process, read from /proc/self/statm (at most every 10 ms:
/// the read is a system call); nullptr where that file cannot be read.
STEPTRACE_API std::unique_ptr<MemorySource> make_rss_source();

}  // namespace steptrace
