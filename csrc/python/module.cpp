// pybind11 module steptrace._core: each part of it is bound by its own file (see
// bindings.hpp for the map).
#include <pybind11/pybind11.h>

#include "steptrace/config.hpp"

#include "bindings.hpp"
#include "metrics_bindings.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  using namespace steptrace::python;
  m.doc() = "steptrace's C++ core (use the steptrace package, not this module)";
  m.attr("MAX_PHASES") = steptrace::kMaxPhases;  // the phase table's size, for Python's bounds

  bind_errors();
  ProfilerClass profiler = bind_profiler(m);
  bind_scope_types(m);
  bind_data_iterator();
  bind_records(m, profiler);
  bind_replay(m);
  bind_metrics(m);
}
