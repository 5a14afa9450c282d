// The record detectors over steps given by Python (steptrace.analysis.replay): each step is a
// ReplayStep with named fields, and the detectors' records come back as Python values.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "steptrace/config.hpp"
#include "steptrace/replay.hpp"

#include "bindings.hpp"

namespace steptrace::python {

namespace {

// A memory figure of ReplayStep as a flat attribute (`step.rss_bytes`), -1 where unknown.
template <std::int64_t MemorySample::*Field>
void memory_field(py::class_<ReplayStep>& cls, const char* name) {
  cls.def_property(
      name, [](const ReplayStep& s) { return s.memory.*Field; },
      [](ReplayStep& s, std::int64_t v) { s.memory.*Field = v; });
}

}  // namespace

void bind_replay(py::module_& m) {
  py::class_<ReplayStep> step(m, "ReplayStep",
                              "One step as the detectors see it (steptrace/replay.hpp); every "
                              "field defaults to the step record's absent value");
  step.def(py::init<>())
      .def_readwrite("step", &ReplayStep::step)
      .def_readwrite("start_unix_ns", &ReplayStep::start_unix_ns)
      .def_readwrite("data_ms", &ReplayStep::data_ms)
      .def_readwrite("data_start_ms", &ReplayStep::data_start_ms)
      .def_readwrite("compile_ms", &ReplayStep::compile_ms)
      .def_readwrite("tokens", &ReplayStep::tokens)
      .def_readwrite("samples", &ReplayStep::samples)
      .def_readwrite("other_ms", &ReplayStep::other_ms)
      .def_readwrite("interval_in_step_ms", &ReplayStep::interval_in_step_ms)
      .def_readwrite("runq_ms", &ReplayStep::runq_ms)
      .def_readwrite("runq_span_ms", &ReplayStep::runq_span_ms)
      .def_readwrite("steal_ms", &ReplayStep::steal_ms)
      .def_readwrite("step_ms", &ReplayStep::step_ms)
      .def_readwrite("gc_ms", &ReplayStep::gc_ms)
      .def_readwrite("gc_gen2_ms", &ReplayStep::gc_gen2_ms)
      .def_readwrite("gc_between_ms", &ReplayStep::gc_between_ms)
      .def_readwrite("gc_between_gen2_ms", &ReplayStep::gc_between_gen2_ms)
      .def_readwrite("gc_count", &ReplayStep::gc_count)
      .def_readwrite("failed", &ReplayStep::failed)
      .def_readwrite("profiled", &ReplayStep::profiled)
      .def_readwrite("phases_ms", &ReplayStep::phases_ms)
      .def_readwrite("rss_fresh", &ReplayStep::rss_fresh);
  memory_field<&MemorySample::allocated_bytes>(step, "allocated_bytes");
  memory_field<&MemorySample::reserved_bytes>(step, "reserved_bytes");
  memory_field<&MemorySample::peak_bytes>(step, "peak_bytes");
  memory_field<&MemorySample::rss_bytes>(step, "rss_bytes");
  memory_field<&MemorySample::heap_bytes>(step, "heap_bytes");
  memory_field<&MemorySample::device_used_bytes>(step, "device_used_bytes");
  memory_field<&MemorySample::device_total_bytes>(step, "device_total_bytes");

  m.def(
      "replay_detectors",
      [](const Config& config, const std::vector<ReplayStep>& steps) {
        std::vector<std::string> lines;
        {
          py::gil_scoped_release release;
          lines = replay_detectors(config, steps);
        }
        py::list out;
        for (const std::string& line : lines) out.append(record_to_python(line));
        return out;
      },
      py::arg("config"), py::arg("steps"),
      "The record detectors over `steps` (ReplayStep, in order): their records (alert, "
      "alert_update, resolved) as dicts");
}

}  // namespace steptrace::python
