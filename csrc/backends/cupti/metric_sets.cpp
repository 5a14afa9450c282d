#include "metric_sets.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace steptrace::detail::cupti {
namespace {

// Metric names and pass counts: ../shared/CUPTI-NOTES.md and the host API on CUPTI 13.0.
// The tensor-pipe metric has a different name per generation and mode; the TriageCompute
// variants are the realtime counters of Hopper/Blackwell PM sampling.
const std::vector<std::string> kTensorPm = {
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "TPC.TriageCompute.sm__pipe_tensor_op_hmma_cycles_active_realtime.avg.pct_of_peak_sustained_"
    "elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_subpipe_hmma_cycles_active.avg.pct_of_peak_sustained_active"};
const std::vector<std::string> kTensorRange = {
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",       // HMMA+HGMMA
    "sm__pipe_tensor_subpipe_hmma_cycles_active.avg.pct_of_peak_sustained_active",  // GB100
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"};
const std::vector<std::string> kDram = {"dram__throughput.avg.pct_of_peak_sustained_elapsed"};
const std::vector<std::string> kOccupancy = {"sm__warps_active.avg.pct_of_peak_sustained_active"};
// sm__throughput alone is 8 passes (range) / 19 (PM) on GH100: the TriageCompute variant
// first, and only when it still fits one pass with the rest.
const std::vector<std::string> kSmThroughput = {
    "TPC.TriageCompute.sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed"};

}  // namespace

const char* to_string(ProfilerMode m) {
  return m == ProfilerMode::kPmSampling ? "pm_sampling" : "range_profiler";
}

const std::vector<ChipFamily>& chip_families() {
  static const std::vector<ChipFamily> families = {
      {"GA100", {"GA100"}, true, false, true},
      {"GA10x", {"GA102", "GA103", "GA104", "GA106", "GA107"}, true, true, false},
      {"GH100", {"GH100"}, true, true, true},
      {"AD10x", {"AD102", "AD103", "AD104", "AD106", "AD107"}, true, true, false},
      {"GB10x", {"GB100", "GB102", "GB110"}, true, true, true},
      {"GB20x", {"GB202", "GB203", "GB205", "GB206", "GB207"}, true, true, false},
  };
  return families;
}

const ChipFamily* find_family(std::string_view chip) {
  for (const auto& f : chip_families()) {
    for (const auto& c : f.chips) {
      if (c == chip) return &f;
    }
  }
  return nullptr;
}

std::string unsupported_chip_reason(std::string_view chip) {
  if (chip.rfind("TU1", 0) == 0 || chip == "GV100" || chip == "GP100") {
    // Turing: the three required counters need 2 passes in either mode (CUPTI 13.0)
    return fmt::format(
        "chip \"{}\" is older than steptrace's counter support (Ampere and later: the tensor, "
        "DRAM and occupancy counters do not fit one pass on it); supported: {}",
        chip, fmt::join(supported_chips(), ", "));
  }
  return fmt::format(
      "unknown chip \"{}\" (chip names are silicon names as cuptiDeviceGetChipName reports "
      "them, e.g. GH100 for H100/H200); supported: {}",
      chip, fmt::join(supported_chips(), ", "));
}

std::vector<CounterSpec> counters_for(const ChipFamily& family, ProfilerMode mode) {
  const bool pm = mode == ProfilerMode::kPmSampling;
  std::vector<CounterSpec> specs = {
      {"tensor_active_pct", true, pm ? kTensorPm : kTensorRange},
      {"dram_throughput_pct", true, kDram},
      {"sm_occupancy_pct", true, kOccupancy},
      // normalisers: active vs elapsed cycles (and the step's GPU time in range mode)
      {"sm_cycles_active", false, {"sm__cycles_active.avg"}},
      {"gpc_cycles_elapsed", false, {"gpc__cycles_elapsed.max"}},
  };
  if (pm) {
    specs.push_back({"gr_cycles_active", false, {"gr__cycles_active.sum"}});
  } else {
    specs.push_back({"gpu_time_ns", false, {"gpu__time_duration.sum"}});
  }
  specs.push_back({"sm_throughput_pct", false, kSmThroughput});
  // The range profiler refuses PCIe/NVLink metrics in a config with SM/DRAM metrics.
  if (pm) {
    specs.push_back({"pcie_read_bytes",
                     false,
                     {"PCI.TriageCompute.pcie__read_bytes.sum", "pcie__read_bytes.sum"}});
    specs.push_back({"pcie_write_bytes",
                     false,
                     {"PCI.TriageCompute.pcie__write_bytes.sum", "pcie__write_bytes.sum"}});
    if (family.nvlink) {
      specs.push_back(
          {"nvlink_rx_bytes", false, {"NVLRX.TriageCompute.nvlrx__bytes.sum", "nvlrx__bytes.sum"}});
      specs.push_back(
          {"nvlink_tx_bytes", false, {"NVLTX.TriageCompute.nvltx__bytes.sum", "nvltx__bytes.sum"}});
    }
  }
  return specs;
}

void select_metric_set(const std::vector<CounterSpec>& specs, const MetricOracle& oracle,
                       MetricSetReport* report) {
  report->metrics.clear();
  report->passes = -1;
  // per counter: the index in report->metrics of the candidate chosen (or none)
  struct Choice {
    const CounterSpec* spec;
    std::ptrdiff_t index;
  };
  std::vector<Choice> choices;
  for (const auto& spec : specs) {
    Choice choice{&spec, -1};
    for (const auto& name : spec.candidates) {
      MetricCheck m;
      m.counter = spec.counter;
      m.name = name;
      m.required = spec.required;
      m.exists = oracle.exists(name);
      if (choice.index >= 0) {
        m.note = "not needed: a better candidate exists";
      } else if (m.exists) {
        choice.index = static_cast<std::ptrdiff_t>(report->metrics.size());
      } else {
        m.note = "does not exist on this chip in this mode";
      }
      report->metrics.push_back(std::move(m));
    }
    choices.push_back(choice);
  }
  std::vector<std::string> set;
  for (const auto& c : choices) {
    if (!c.spec->required) continue;
    if (c.index < 0) {
      report->error = fmt::format("no metric for {} exists on {} in {} mode", c.spec->counter,
                                  report->chip, report->mode);
      return;
    }
    set.push_back(report->metrics[c.index].name);
  }
  std::string why;
  int passes = oracle.passes(set, &why);
  if (passes != 1) {
    report->error = passes < 0 ? fmt::format("CUPTI refused the required metric set: {}", why)
                               : fmt::format(
                                     "the required metric set needs {} passes, not 1 "
                                     "(PM sampling and a per-step range need one)",
                                     passes);
    report->passes = passes;
    return;
  }
  for (const auto& c : choices) {
    if (c.spec->required && c.index >= 0) report->metrics[c.index].selected = true;
  }
  for (const auto& c : choices) {
    if (c.spec->required || c.index < 0) continue;
    MetricCheck& m = report->metrics[c.index];
    std::vector<std::string> trial = set;
    trial.push_back(m.name);
    why.clear();
    const int p = oracle.passes(trial, &why);
    if (p == 1) {
      set = std::move(trial);
      m.selected = true;
    } else if (p < 0) {
      m.note = fmt::format("left out: CUPTI refuses it with the others ({})", why);
    } else {
      m.note = fmt::format("left out: the set would need {} passes", p);
    }
  }
  report->passes = oracle.passes(set, &why);
}

}  // namespace steptrace::detail::cupti
