#include "device_diagnosis_detector.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace steptrace::detail {
namespace {

constexpr double kNsPerMs = 1e6;

}  // namespace

template <typename Explain>
void DeviceDiagnosisDetector::update(Episode& e, const char* type, bool condition,
                                     const StepRecord& r, double value, double threshold,
                                     Explain explain, std::vector<AlertEvent>& out) {
  const Episode::Change change = e.observe(condition, r.step);
  if (change == Episode::Change::kOpened) {
    Diagnosis d = explain();
    AlertEvent a;
    a.value = value;
    a.threshold = threshold;
    a.message = std::move(d.message);
    a.details = std::move(d.details);
    a.type = type;
    a.step = r.step;
    a.details["since_step"] = e.first_step();
    out.push_back(std::move(a));
  } else if (change == Episode::Change::kResolved) {
    out.push_back(
        e.resolved(type, r.step,
                   fmt::format("{} ended at step {} (from step {})", type, r.step, e.first_step()),
                   /*with_repeats=*/false));
  }
}

void DeviceDiagnosisDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  if (r.failed || r.profiled || r.step < config_.warmup_steps) return;
  const KernelStats& k = r.kernels;
  const double tensor = r.counters.present ? r.counters.values[0] : NAN;
  const double dram = r.counters.present ? r.counters.values[1] : NAN;
  const double occupancy = r.counters.present ? r.counters.values[2] : NAN;

  if (std::isfinite(tensor) && k.present && k.compute_ns > 0) {
    const double matmul_pct =
        100.0 * static_cast<double>(k.matmul_ns) / static_cast<double>(k.compute_ns);
    const bool dominated = matmul_pct >= config_.matmul_dominated_pct;
    update(
        tensor_, "low_tensor_core", dominated && tensor < config_.tensor_core_min_pct, r, tensor,
        config_.tensor_core_min_pct,
        [&]() -> Diagnosis {
          return {
              fmt::format(
                  "tensor cores active {:.0f}% of the time on step {} while matmul kernels take "
                  "{:.0f}% of the compute time (expected at least {:.0f}%): run matmuls in "
                  "bf16/fp16 (torch.autocast) or TF32 "
                  "(torch.set_float32_matmul_precision(\"high\")), and keep matmul dimensions "
                  "multiples of 8",
                  tensor, r.step, matmul_pct, config_.tensor_core_min_pct),
              {{"matmul_share_pct", matmul_pct}}};
        },
        out);
  }
  if (std::isfinite(dram) && std::isfinite(occupancy)) {
    update(
        memory_, "memory_bound",
        occupancy < config_.occupancy_min_pct && dram > config_.dram_bound_pct, r, dram,
        config_.dram_bound_pct,
        [&]() -> Diagnosis {
          return {fmt::format(
                      "step {} is memory-bound: DRAM throughput {:.0f}% of peak with SM occupancy "
                      "{:.0f}% (below {:.0f}%): fuse elementwise kernels (torch.compile), keep "
                      "activations in bf16, or raise the batch size",
                      r.step, dram, occupancy, config_.occupancy_min_pct),
                  {{"sm_occupancy_pct", occupancy}}};
        },
        out);
  }
  // The step on the kernels' clock: its device window, else the record's step time.
  const std::int64_t window_ns = k.window_end_ns - k.window_start_ns;
  const std::int64_t step_ns = window_ns > 0 ? window_ns : r.step_ns;
  if (k.present && step_ns > 0) {
    const double nccl_pct = 100.0 * static_cast<double>(k.nccl_ns) / static_cast<double>(step_ns);
    update(
        comm_, "comm_bound", nccl_pct > config_.comm_bound_pct, r, nccl_pct, config_.comm_bound_pct,
        [&]() -> Diagnosis {
          return {fmt::format(
                      "NCCL kernels take {:.0f}% of step {} ({:.2f} ms of {:.2f} ms, {:.2f} ms not "
                      "overlapped by compute; above {:.0f}%): accumulate gradients over more "
                      "micro-batches per all-reduce, overlap communication with compute, or use a "
                      "faster interconnect",
                      nccl_pct, r.step, static_cast<double>(k.nccl_ns) / kNsPerMs,
                      static_cast<double>(step_ns) / kNsPerMs,
                      static_cast<double>(k.exposed_nccl_ns) / kNsPerMs, config_.comm_bound_pct),
                  {{"nccl_ms", static_cast<double>(k.nccl_ns) / kNsPerMs},
                   {"exposed_nccl_ms", static_cast<double>(k.exposed_nccl_ns) / kNsPerMs}}};
        },
        out);
  }
}

}  // namespace steptrace::detail
