// low_tensor_core, memory_bound and comm_bound: diagnoses from the device's kernel
// activity and hardware counters in the step records. Pure and deterministic.
#pragma once

#include <string>
#include <vector>

#include "../alert.hpp"
#include "../step_record.hpp"
#include "episode.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

/// Diagnoses from kernel activity and hardware counters, on the steps that have them
/// (after warmup): low_tensor_core (tensor-core activity below tensor_core_min_pct where
/// matmul kernels take at least matmul_dominated_pct of the compute time), memory_bound
/// (occupancy below occupancy_min_pct with DRAM throughput above dram_bound_pct) and
/// comm_bound (NCCL kernels over comm_bound_pct of the step). Each fires once
/// regression_min_steps observed steps in a row meet it, once per episode, and resolves
/// after as many observed steps in a row without it.
class DeviceDiagnosisDetector {
 public:
  explicit DeviceDiagnosisDetector(const Config& config)
      : config_(config),
        tensor_(config.regression_min_steps, config.regression_min_steps),
        memory_(config.regression_min_steps, config.regression_min_steps),
        comm_(config.regression_min_steps, config.regression_min_steps) {}
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);

 private:
  // The text of an alert, built only when it fires.
  struct Diagnosis {
    std::string message;
    nlohmann::ordered_json details;
  };
  template <typename Explain>
  void update(Episode& e, const char* type, bool condition, const StepRecord& r, double value,
              double threshold, Explain explain, std::vector<AlertEvent>& out);

  const Config& config_;
  Episode tensor_;
  Episode memory_;
  Episode comm_;
};

}  // namespace steptrace::detail
