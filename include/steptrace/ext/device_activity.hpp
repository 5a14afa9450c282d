// Device activity backends: kernel activity (which kernels ran when; CUPTI activity
// records) and hardware counters (CUPTI PM sampling or the range profiler), with their
// factories. Extending steptrace, not adapting a framework: most users never include this.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/export.hpp"

namespace steptrace {

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

}  // namespace steptrace
