// What the files of the pybind11 module steptrace._core share: the Python-facing profiler
// (PyProfiler), the makers of the fast scope types, and one bind_* function per file that
// module.cpp's PYBIND11_MODULE calls in order.
//
//   c_api.cpp              the error classes and the plain C-API types' common setup
//   scope_types.cpp        the step and phase scopes, prof.step/prof.phase, phase gates
//   data_iterator.cpp      prof.data(loader)
//   profiler_bindings.cpp  Config, Profiler and the module's free functions
//   record_bindings.cpp    records to and from Python as values (the record channel,
//                          alert events, write_record)
//   replay_bindings.cpp    the detectors over steps given by Python (ReplayStep)
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "steptrace/config.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace::python {

namespace py = pybind11;
using ProfilerPtr = std::shared_ptr<steptrace::Profiler>;

// ---- c_api.cpp ----
/// The classes of steptrace.errors, set by bind_errors (each also a ValueError/RuntimeError).
extern PyObject* g_usage_warning;
/// Imports steptrace.errors and maps the core's exceptions onto its classes.
void bind_errors();
/// Sets the Python exception for a C++ one and returns nullptr (for raw C-API methods).
PyObject* raise_python(const std::exception& e);
/// Readies one of the module's plain C-API types; `m` non-null also exports it by name.
void ready_type(PyTypeObject& t, const char* name, Py_ssize_t size, const char* doc,
                destructor dealloc, PyMethodDef* methods, PyGetSetDef* getset, py::module_* m);

// ---- scope_types.cpp ----
// Python callables run around every step when set (the CUDA path): `begin` returns the
// stream to time as (stream handle, device index) (or None: host clock), `end` returns
// (allocated, reserved, peak, device_used, device_total) bytes or None.
// `capture` (steptrace.live.evidence_capture) is called with True after a step begins
// and with False before it ends, only while `capture_armed`: one relaxed load per boundary
// between captures; armed and disarmed from any thread.
struct StepHooks {
  py::object begin;
  py::object end;
  py::object capture;
  std::atomic<bool> capture_armed{false};
};

/// The stream of the step about to begin, from the CUDA path's begin hook.
void set_step_stream(steptrace::Profiler& profiler, const StepHooks& hooks);
void begin_step_with_hooks(steptrace::Profiler& profiler, const StepHooks& hooks);
void end_step_with_hooks(steptrace::Profiler& profiler, const StepHooks& hooks, bool failed);

struct StepScope {
  ProfilerPtr profiler;
  std::shared_ptr<StepHooks> hooks;

  void enter() const { begin_step_with_hooks(*profiler, *hooks); }
  void exit(bool failed) const { end_step_with_hooks(*profiler, *hooks, failed); }
};

/// Readies StepScope, PhaseScope, PhaseGates and the phase table's types.
void bind_scope_types(py::module_& m);
py::object make_phase_scope(const ProfilerPtr& profiler, PhaseId id);
py::object make_step_scope(const StepScope& scope);
/// `prof.step` for Python: a builtin bound to the step scope that returns it.
py::object make_step_function(const py::object& step_scope);
/// `prof.phase` for Python: a builtin whose calls skip pybind11's dispatcher. `owner` is
/// the Python Profiler object (a PyProfiler).
py::object make_phase_function(py::object owner);
py::object make_phase_gates(const ProfilerPtr& profiler, const std::vector<std::string>& names);

// ---- data_iterator.cpp ----
void bind_data_iterator();
py::object make_data_iterator(const ProfilerPtr& profiler, py::handle iterable, py::handle on_item,
                              py::handle tensor_type, const py::tuple& int_dtypes);

// ---- profiler_bindings.cpp ----
// Wraps a Profiler with the Python-facing conveniences. Scopes share ownership of the
// profiler, so a scope kept past the profiler object stays safe to call.
class PyProfiler {
 public:
  PyProfiler(steptrace::Config config, const std::map<std::string, std::string>& versions,
             bool external_profiler, py::object live_bytes,
             std::pair<std::string, std::string> comm, py::object given_backends);

  py::object step() const { return step_scope_; }
  /// The scope of a phase name (a str); prof.phase's table remembers the name objects it
  /// has seen.
  py::object phase(py::handle name);

  steptrace::Profiler& core() { return *profiler_; }
  const ProfilerPtr& profiler() const { return profiler_; }
  StepHooks& hooks() { return *hooks_; }
  const StepScope& step_scope() const { return step_; }

 private:
  ProfilerPtr profiler_;
  std::shared_ptr<StepHooks> hooks_;
  StepScope step_;
  py::object step_scope_;
  std::vector<py::object> by_id_;
};

using ProfilerClass = py::class_<PyProfiler>;
/// Config, Profiler (all but its record methods) and the module's free functions.
ProfilerClass bind_profiler(py::module_& m);

// ---- record_bindings.cpp ----
/// The record channel, alert events and write_record on `profiler`.
void bind_records(py::module_& m, ProfilerClass& profiler);
/// A record line as Python values (dict, list, str, int, float, bool, None), decoded here:
/// no JSON text reaches Python. Throws py::value_error for a line that is not JSON.
py::object record_to_python(std::string_view line);

// ---- replay_bindings.cpp ----
void bind_replay(py::module_& m);

}  // namespace steptrace::python
