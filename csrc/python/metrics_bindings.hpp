// steptrace._core.metric_table() and the metrics' bounds: the metrics table
// (csrc/sinks/metrics.def) as Python values, for the OTLP export and the checks.
#pragma once

#include <pybind11/pybind11.h>

namespace steptrace::python {

void bind_metrics(pybind11::module_& m);

}  // namespace steptrace::python
