// The step and phase scopes as plain C-API types: their __enter__/__exit__ run here in C++
// so the Python hot path is one call per boundary, and scope objects are cached per phase
// so `prof.phase("forward")` allocates nothing after the first call. Also prof.step and
// prof.phase as builtin functions, and the gates of automatic phases (steptrace.live.autophase).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "steptrace/error.hpp"
#include "steptrace/metrics.hpp"
#include "steptrace/profiler.hpp"

#include "bindings.hpp"

namespace steptrace::python {

// A step's begin and end, with the CUDA path's hooks when set (the step scope and the
// explicit begin_step/end_step both come here). [[gnu::hot]] here and below: the step's
// path is laid out together with the core's (see profiler.cpp).
// The stream of the step about to begin, from the CUDA path's begin hook.
[[gnu::hot]] void set_step_stream(steptrace::Profiler& profiler, const StepHooks& hooks) {
  const py::object stream = hooks.begin();
  if (stream.is_none()) {
    profiler.clear_stream();
  } else {
    const auto [handle, device] = stream.cast<std::pair<std::uintptr_t, int>>();
    profiler.set_stream(handle, device);
  }
}

[[gnu::hot]] void begin_step_with_hooks(steptrace::Profiler& profiler, const StepHooks& hooks) {
  if (hooks.begin) set_step_stream(profiler, hooks);
  profiler.begin_step();
  if (hooks.capture_armed.load(std::memory_order_relaxed)) hooks.capture(true);
}

[[gnu::hot]] void end_step_with_hooks(steptrace::Profiler& profiler, const StepHooks& hooks,
                                      bool failed) {
  // before the step ends: a capture's stop is part of its last (captured) step
  if (hooks.capture_armed.load(std::memory_order_relaxed)) hooks.capture(false);
  if (hooks.end) {
    const py::object m = hooks.end();
    if (!m.is_none()) {
      using Bytes =
          std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
      const auto t = m.cast<Bytes>();
      steptrace::MemorySample s;
      s.allocated_bytes = std::get<0>(t);
      s.reserved_bytes = std::get<1>(t);
      s.peak_bytes = std::get<2>(t);
      s.device_used_bytes = std::get<3>(t);
      s.device_total_bytes = std::get<4>(t);
      profiler.set_step_memory(s);
    }
  }
  profiler.end_step(failed);
}

namespace {

// ---- `with` on a scope without a bound method per boundary ----
// CPython's `with` looks __enter__ and __exit__ up on the manager's type and binds each
// through the descriptor's tp_descr_get: for a C method that makes a new builtin object,
// tracked by the GC, and frees it after the call. That is two allocations, two frees and
// four GC-list links a `with`, on lines a training step has flushed (issue 30). So a
// scope's __enter__ and __exit__ are a ScopeBoundary instead, whose binding is the scope
// itself (nothing is made), and the scope is callable: with no argument it enters, with
// the three of the exception (or three None) it exits, the only calls `with` makes.
// Unbound (type(scope).__enter__(scope), as contextlib.ExitStack calls it, and
// `scope.__enter__()` through LOAD_METHOD) the boundary is called with the scope first.
using ScopeEnter = PyObject* (*)(PyObject* scope);
using ScopeExit = PyObject* (*)(PyObject* scope, PyObject* const* args, Py_ssize_t nargs);

struct RawScopeBoundary {
  PyObject_HEAD vectorcallfunc call;  // the unbound call: boundary_call
  PyTypeObject* scope_type;
  ScopeEnter enter;  // null: this is the type's __exit__
  ScopeExit exit;
  const char* name;
  const char* doc;
};

// A scope's call: enter with no argument, exit with three.
template <ScopeEnter Enter, ScopeExit Exit>
[[gnu::hot]] PyObject* scope_call(PyObject* self, PyObject* const* args, std::size_t nargsf,
                                  PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames == nullptr && nargs == 0) return Enter(self);
  if (kwnames == nullptr && nargs == 3) return Exit(self, args, nargs);
  PyErr_Format(PyExc_TypeError,
               "%s objects are called only by `with` (no argument: __enter__; exc_type, exc, "
               "traceback: __exit__), got %zd positional and %zd keyword arguments",
               Py_TYPE(self)->tp_name, nargs, kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames));
  return nullptr;
}

PyObject* boundary_call(PyObject* self, PyObject* const* args, std::size_t nargsf,
                        PyObject* kwnames) {
  const auto* b = reinterpret_cast<RawScopeBoundary*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs < 1 || !Py_IS_TYPE(args[0], b->scope_type)) {
    PyErr_Format(PyExc_TypeError,
                 "descriptor '%s' for '%s' objects needs one as its first argument", b->name,
                 b->scope_type->tp_name);
    return nullptr;
  }
  const Py_ssize_t wanted = b->enter != nullptr ? 1 : 4;
  if (kwnames != nullptr || nargs != wanted) {
    PyErr_Format(PyExc_TypeError, "%s.%s takes %zd positional arguments with the scope, got %zd",
                 b->scope_type->tp_name, b->name, wanted, nargs);
    return nullptr;
  }
  return b->enter != nullptr ? b->enter(args[0]) : b->exit(args[0], args + 1, nargs - 1);
}

// scope.__enter__ / scope.__exit__: the scope itself; on the type, the boundary.
PyObject* boundary_get(PyObject* self, PyObject* obj, PyObject* /*type*/) {
  const auto* b = reinterpret_cast<RawScopeBoundary*>(self);
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  if (!Py_IS_TYPE(obj, b->scope_type)) {
    PyErr_Format(PyExc_TypeError, "descriptor '%s' for '%s' objects doesn't apply to a '%s' object",
                 b->name, b->scope_type->tp_name, Py_TYPE(obj)->tp_name);
    return nullptr;
  }
  Py_INCREF(obj);
  return obj;
}

PyObject* boundary_doc(PyObject* self, void* /*unused*/) {
  return PyUnicode_FromString(reinterpret_cast<RawScopeBoundary*>(self)->doc);
}

PyGetSetDef g_boundary_getset[] = {{"__doc__", boundary_doc, nullptr, nullptr, nullptr},
                                   {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyTypeObject g_scope_boundary_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Sets __enter__ and __exit__ of a readied scope type, whose instances call through
// `call_offset` (their scope_call).
void add_scope_boundaries(PyTypeObject& scope_type, ScopeEnter enter, ScopeExit exit,
                          const char* enter_doc, const char* exit_doc) {
  if (g_scope_boundary_type.tp_name == nullptr) {
    g_scope_boundary_type.tp_name = "steptrace._core.ScopeBoundary";
    g_scope_boundary_type.tp_basicsize = sizeof(RawScopeBoundary);
    g_scope_boundary_type.tp_flags =
        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR;
    g_scope_boundary_type.tp_doc = "__enter__ or __exit__ of a steptrace scope.";
    g_scope_boundary_type.tp_vectorcall_offset = offsetof(RawScopeBoundary, call);
    g_scope_boundary_type.tp_call = PyVectorcall_Call;
    g_scope_boundary_type.tp_descr_get = boundary_get;
    g_scope_boundary_type.tp_getset = g_boundary_getset;
    if (PyType_Ready(&g_scope_boundary_type) < 0) throw py::error_already_set();
  }
  struct Boundary {
    const char* name;
    const char* doc;
    ScopeEnter enter;  // null for __exit__
  };
  const std::array<Boundary, 2> named = {Boundary{"__enter__", enter_doc, enter},
                                         Boundary{"__exit__", exit_doc, nullptr}};
  for (const Boundary& n : named) {
    RawScopeBoundary* b = PyObject_New(RawScopeBoundary, &g_scope_boundary_type);
    if (b == nullptr) throw py::error_already_set();
    b->call = boundary_call;
    b->scope_type = &scope_type;
    b->enter = n.enter;
    b->exit = exit;
    b->name = n.name;
    b->doc = n.doc;
    const int failed =
        PyDict_SetItemString(scope_type.tp_dict, n.name, reinterpret_cast<PyObject*>(b));
    Py_DECREF(b);  // the type's dict holds it
    if (failed != 0) throw py::error_already_set();
  }
  PyType_Modified(&scope_type);
}

// Readies a scope type: ready_type, then the call and the boundaries above.
template <ScopeEnter Enter, ScopeExit Exit>
void ready_scope_type(PyTypeObject& t, const char* name, Py_ssize_t size, Py_ssize_t call_offset,
                      const char* doc, destructor dealloc, PyGetSetDef* getset, py::module_& m,
                      const char* enter_doc, const char* exit_doc) {
  t.tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_vectorcall_offset = call_offset;
  t.tp_call = PyVectorcall_Call;
  ready_type(t, name, size, doc, dealloc, nullptr, getset, &m);
  add_scope_boundaries(t, Enter, Exit, enter_doc, exit_doc);
}

// ---- the phase scope, as a plain C-API type ----
// `with prof.phase("x"):` is the hottest Python path: two calls per phase. Methods of a
// C type (METH_NOARGS / METH_FASTCALL) skip pybind11's dispatcher, whose cost grows a lot
// when a training step has flushed the caches.
struct RawPhaseScope {
  // A boundary reads this object's line and goes straight to the profiler: `core` is
  // what `*owner` points to, kept here so that the shared pointer's own allocation is not
  // one more cold line per boundary (issue 30).
  PyObject_HEAD steptrace::Profiler* core;
  vectorcallfunc call;  // scope_call: `with` calls the scope (ScopeBoundary)
  PhaseId id;
  ProfilerPtr* owner;  // owned; keeps the profiler alive as long as the scope
};

void phase_scope_dealloc(PyObject* self) {
  delete reinterpret_cast<RawPhaseScope*>(self)->owner;
  Py_TYPE(self)->tp_free(self);
}

[[gnu::hot]] PyObject* phase_scope_enter(PyObject* self) {
  auto* s = reinterpret_cast<RawPhaseScope*>(self);
  try {
    s->core->begin_phase(s->id);
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  Py_INCREF(self);
  return self;
}

[[gnu::hot]] PyObject* phase_scope_exit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* s = reinterpret_cast<RawPhaseScope*>(self);
  const bool unwinding = nargs > 0 && args[0] != Py_None;
  try {
    s->core->end_phase(s->id);
  } catch (const std::exception& e) {
    // The user's exception propagates unchanged; a misuse error must not replace it.
    if (!unwinding) return raise_python(e);
  }
  Py_RETURN_FALSE;
}

PyObject* phase_name_str(const steptrace::Profiler& profiler, PhaseId id) {
  const std::string& name = profiler.phase_name(id);
  return PyUnicode_FromStringAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
}

PyObject* phase_scope_name(PyObject* self, void* /*unused*/) {
  auto* s = reinterpret_cast<RawPhaseScope*>(self);
  return phase_name_str(*s->core, s->id);
}

PyGetSetDef g_phase_scope_getset[] = {
    {"name", phase_scope_name, nullptr, "The phase's name.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyTypeObject g_phase_scope_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

void init_phase_scope_type(py::module_& m) {
  ready_scope_type<phase_scope_enter, phase_scope_exit>(
      g_phase_scope_type, "steptrace._core.PhaseScope", sizeof(RawPhaseScope),
      offsetof(RawPhaseScope, call),
      "The reusable scope of one phase: `with prof.phase(\"forward\"): ...`", phase_scope_dealloc,
      g_phase_scope_getset, m, "Starts the phase.", "Ends the phase; never swallows an exception.");
}

}  // namespace

py::object make_phase_scope(const ProfilerPtr& profiler, PhaseId id) {
  RawPhaseScope* s = PyObject_New(RawPhaseScope, &g_phase_scope_type);
  if (s == nullptr) throw py::error_already_set();
  s->owner = new ProfilerPtr(profiler);
  s->core = profiler.get();
  s->call = scope_call<phase_scope_enter, phase_scope_exit>;
  s->id = id;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(s));
}

namespace {

// ---- the gates of automatic phases (steptrace.live.autophase), as a plain C-API type ----
// A hook (module forward hook, optimizer step hook, the wrapped backward) opens its phase
// only on the training thread, inside a step, while no phase is open; it closes only the
// phase it opened. Each test is a call into the core, so the whole gate is one C call per
// boundary: attribute reads through pybind11 cost microseconds each after a training
// step has flushed the caches.
constexpr std::size_t kMaxGatedPhases = 8;

struct RawPhaseGates {
  PyObject_HEAD ProfilerPtr* profiler;  // owned
  unsigned long thread;                 // PyThread_get_thread_ident() of the training thread
  std::array<PhaseId, kMaxGatedPhases> ids;
  Py_ssize_t count;
  Py_ssize_t opened;  // index of the phase we opened and have not closed yet, or -1
  bool closed;
  // Outermost forward calls of one module in the step in progress (gradient accumulation).
  std::int64_t micro_step_of;
  std::int64_t micro_steps;
  const void* counted;  // identity only: never dereferenced, so no reference is held
  steptrace::StepValueId micro_steps_value;
};

void phase_gates_dealloc(PyObject* self) {
  delete reinterpret_cast<RawPhaseGates*>(self)->profiler;
  Py_TYPE(self)->tp_free(self);
}

// The gated phase index of a Python int, or -1 with an exception set.
Py_ssize_t gate_index(const RawPhaseGates& g, PyObject* arg) {
  const Py_ssize_t i = PyLong_AsSsize_t(arg);
  if (i == -1 && PyErr_Occurred()) return -1;
  if (i < 0 || i >= g.count) {
    PyErr_Format(PyExc_IndexError, "gated phase index %zd out of range [0, %zd)", i, g.count);
    return -1;
  }
  return i;
}

void count_forward(RawPhaseGates& g, const void* module) {
  steptrace::Profiler& core = **g.profiler;
  const std::int64_t step = core.step_index();
  if (step != g.micro_step_of) {
    g.micro_step_of = step;
    g.micro_steps = 0;
    g.counted = module;
  } else if (module != g.counted) {
    return;  // another module's outermost call (a second model under steptrace run)
  }
  if (++g.micro_steps > 1) {
    core.set_step_value(g.micro_steps_value, static_cast<double>(g.micro_steps));
  }
}

// begin(index[, module]) -> bool: opens the phase when allowed; with `module`, counts it
// as one more outermost forward of that module in this step (meta.micro_steps from 2 on).
PyObject* phase_gates_begin(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto& g = *reinterpret_cast<RawPhaseGates*>(self);
  if (nargs < 1 || nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "begin(index[, module]) takes 1 or 2 arguments");
    return nullptr;
  }
  const Py_ssize_t i = gate_index(g, args[0]);
  if (i < 0) return nullptr;
  steptrace::Profiler& core = **g.profiler;
  if (g.closed || PyThread_get_thread_ident() != g.thread || !core.in_step() || core.in_phase()) {
    Py_RETURN_FALSE;
  }
  try {
    core.begin_phase(g.ids[static_cast<std::size_t>(i)]);
  } catch (const steptrace::UsageError&) {
    Py_RETURN_FALSE;  // the step ended under us (a close from another thread): skip
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  g.opened = i;
  if (nargs == 2 && args[1] != Py_None) count_forward(g, args[1]);
  Py_RETURN_TRUE;
}

// end(index): closes the phase if we opened it (else nothing: not ours, or already closed
// by the end of its step).
PyObject* phase_gates_end(PyObject* self, PyObject* arg) {
  auto& g = *reinterpret_cast<RawPhaseGates*>(self);
  const Py_ssize_t i = gate_index(g, arg);
  if (i < 0) return nullptr;
  if (g.opened != i) Py_RETURN_NONE;
  g.opened = -1;
  try {
    (*g.profiler)->end_phase(g.ids[static_cast<std::size_t>(i)]);
  } catch (const steptrace::UsageError&) {
    // the step ended while the phase was open: the core closed it there
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  Py_RETURN_NONE;
}

// add(index, begin_ns, end_ns[, module]): the phase ran between two clock_ns readings in
// the step in progress (one begun late: Profiler::add_phase); `module` as in begin.
PyObject* phase_gates_add(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto& g = *reinterpret_cast<RawPhaseGates*>(self);
  if (nargs < 3 || nargs > 4) {
    PyErr_SetString(PyExc_TypeError,
                    "add(index, begin_ns, end_ns[, module]) takes 3 or 4 arguments");
    return nullptr;
  }
  const Py_ssize_t i = gate_index(g, args[0]);
  if (i < 0) return nullptr;
  const long long begin = PyLong_AsLongLong(args[1]);
  if (begin == -1 && PyErr_Occurred()) return nullptr;
  const long long end = PyLong_AsLongLong(args[2]);
  if (end == -1 && PyErr_Occurred()) return nullptr;
  try {
    (*g.profiler)->add_phase(g.ids[static_cast<std::size_t>(i)], begin, end);
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  if (nargs == 4 && args[3] != Py_None) count_forward(g, args[3]);
  Py_RETURN_NONE;
}

PyObject* phase_gates_close(PyObject* self, PyObject* /*unused*/) {
  reinterpret_cast<RawPhaseGates*>(self)->closed = true;
  Py_RETURN_NONE;
}

PyObject* phase_gates_closed(PyObject* self, void* /*unused*/) {
  return PyBool_FromLong(reinterpret_cast<RawPhaseGates*>(self)->closed ? 1 : 0);
}

PyObject* phase_gates_opened(PyObject* self, void* /*unused*/) {
  const auto& g = *reinterpret_cast<RawPhaseGates*>(self);
  if (g.opened < 0) Py_RETURN_NONE;
  return phase_name_str(**g.profiler, g.ids[static_cast<std::size_t>(g.opened)]);
}

PyObject* phase_gates_micro_steps(PyObject* self, void* /*unused*/) {
  return PyLong_FromLongLong(reinterpret_cast<RawPhaseGates*>(self)->micro_steps);
}

PyMethodDef g_phase_gates_methods[] = {
    {"begin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(phase_gates_begin)),
     METH_FASTCALL,
     "begin(index[, module]) -> bool: opens the phase when on the training thread, inside a "
     "step and outside any phase; `module` counts an outermost forward (micro-steps)."},
    {"end", phase_gates_end, METH_O, "end(index): closes the phase if begin opened it."},
    {"add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(phase_gates_add)),
     METH_FASTCALL,
     "add(index, begin_ns, end_ns[, module]): the phase ran between two clock_ns readings "
     "in the step in progress; `module` counts an outermost forward (micro-steps)."},
    {"close", phase_gates_close, METH_NOARGS, "From now on begin opens nothing."},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef g_phase_gates_getset[] = {
    {"closed", phase_gates_closed, nullptr, "Whether close() was called.", nullptr},
    {"opened", phase_gates_opened, nullptr, "The phase begin opened and end did not close.",
     nullptr},
    {"micro_steps", phase_gates_micro_steps, nullptr,
     "Outermost forward calls counted in the step in progress (or the last one).", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyTypeObject g_phase_gates_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

void init_phase_gates_type(py::module_& m) {
  ready_type(g_phase_gates_type, "steptrace._core.PhaseGates", sizeof(RawPhaseGates),
             "The gates of automatic phases, bound to the thread that made them.",
             phase_gates_dealloc, g_phase_gates_methods, g_phase_gates_getset, &m);
}

}  // namespace

py::object make_phase_gates(const ProfilerPtr& profiler, const std::vector<std::string>& names) {
  if (names.empty() || names.size() > kMaxGatedPhases) {
    throw steptrace::ConfigError("phase gates take 1 to " + std::to_string(kMaxGatedPhases) +
                                 " phase names, got " + std::to_string(names.size()));
  }
  std::array<PhaseId, kMaxGatedPhases> ids{};
  for (std::size_t i = 0; i < names.size(); ++i) ids[i] = profiler->phase_id(names[i]);
  const steptrace::StepValueId micro = profiler->step_value_id("micro_steps");
  RawPhaseGates* g = PyObject_New(RawPhaseGates, &g_phase_gates_type);
  if (g == nullptr) throw py::error_already_set();
  g->profiler = new ProfilerPtr(profiler);
  g->thread = PyThread_get_thread_ident();
  g->ids = ids;
  g->count = static_cast<Py_ssize_t>(names.size());
  g->opened = -1;
  g->closed = false;
  g->micro_step_of = -1;
  g->micro_steps = 0;
  g->counted = nullptr;
  g->micro_steps_value = micro;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(g));
}

namespace {

// ---- the step scope, the same way (one enter and one exit per step) ----
struct RawStepScope {
  // What enter and exit read, in this object's line (as RawPhaseScope's core).
  PyObject_HEAD steptrace::Profiler* core;
  vectorcallfunc call;  // scope_call, as RawPhaseScope's
  const StepHooks* hooks;
  StepScope* scope;  // owned; keeps both alive
};

void step_scope_dealloc(PyObject* self) {
  delete reinterpret_cast<RawStepScope*>(self)->scope;
  Py_TYPE(self)->tp_free(self);
}

[[gnu::hot]] PyObject* step_scope_enter(PyObject* self) {
  try {
    const auto* s = reinterpret_cast<RawStepScope*>(self);
    begin_step_with_hooks(*s->core, *s->hooks);
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  Py_INCREF(self);
  return self;
}

[[gnu::hot]] PyObject* step_scope_exit(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    const auto* s = reinterpret_cast<RawStepScope*>(self);
    end_step_with_hooks(*s->core, *s->hooks, /*failed=*/nargs > 0 && args[0] != Py_None);
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  Py_RETURN_FALSE;  // never swallow the exception
}

PyTypeObject g_step_scope_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

void init_step_scope_type(py::module_& m) {
  ready_scope_type<step_scope_enter, step_scope_exit>(
      g_step_scope_type, "steptrace._core.StepScope", sizeof(RawStepScope),
      offsetof(RawStepScope, call), "The reusable scope of a step: `with prof.step(): ...`",
      step_scope_dealloc, nullptr, m, "Begins the step.",
      "Ends the step (status error when an exception is passing).");
}

}  // namespace

py::object make_step_scope(const StepScope& scope) {
  RawStepScope* s = PyObject_New(RawStepScope, &g_step_scope_type);
  if (s == nullptr) throw py::error_already_set();
  s->scope = new StepScope(scope);
  s->core = s->scope->profiler.get();
  s->hooks = s->scope->hooks.get();
  s->call = scope_call<step_scope_enter, step_scope_exit>;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(s));
}

namespace {

// `prof.step` for Python: a builtin bound to the step scope that returns it.
[[gnu::hot]] PyObject* return_self(PyObject* self, PyObject* /*unused*/) {
  Py_INCREF(self);
  return self;
}
PyMethodDef g_step_function_def = {"step", return_self, METH_NOARGS,
                                   "The (reusable) step scope: `with prof.step(): ...`"};

}  // namespace

py::object make_step_function(const py::object& step_scope) {
  PyObject* fn = PyCFunction_NewEx(&g_step_function_def, step_scope.ptr(), nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

namespace {

// ---- prof.phase, as a builtin function bound to its profiler (METH_O) ----
// Literals are interned, so a few entries serve a loop; names built per call (an f-string)
// would grow the table without bound, so it is capped.
constexpr std::size_t kTableNames = 4 * steptrace::kMaxPhases;

struct RawPhaseTable {
  // The name objects looked up so far, by identity, and their scopes, with references
  // held: a lookup of one of them reads this object's lines and the scope's, nothing of
  // the profiler (issue 30). Other names, and those past the cap, go to PyProfiler::phase.
  PyObject_HEAD Py_ssize_t count;
  std::array<PyObject*, kTableNames> names;
  std::array<PyObject*, kTableNames> scopes;
  PyProfiler* profiler;
  PyObject* owner;  // the Python Profiler object that owns *profiler
};

void phase_table_dealloc(PyObject* self) {
  auto* t = reinterpret_cast<RawPhaseTable*>(self);
  for (Py_ssize_t i = 0; i < t->count; ++i) {
    Py_DECREF(t->names[static_cast<std::size_t>(i)]);
    Py_DECREF(t->scopes[static_cast<std::size_t>(i)]);
  }
  Py_XDECREF(t->owner);
  Py_TYPE(self)->tp_free(self);
}

[[gnu::hot]] PyObject* phase_lookup(PyObject* self, PyObject* name) {
  auto* t = reinterpret_cast<RawPhaseTable*>(self);
  for (Py_ssize_t i = 0; i < t->count; ++i) {
    if (t->names[static_cast<std::size_t>(i)] == name) {
      PyObject* scope = t->scopes[static_cast<std::size_t>(i)];
      Py_INCREF(scope);
      return scope;
    }
  }
  try {
    py::object scope = t->profiler->phase(name);
    if (static_cast<std::size_t>(t->count) < kTableNames) {
      const auto i = static_cast<std::size_t>(t->count++);
      Py_INCREF(name);
      t->names[i] = name;
      t->scopes[i] = scope.inc_ref().ptr();
    }
    return scope.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    raise_python(e);
  }
  return nullptr;
}

PyMethodDef g_phase_lookup_def = {
    "phase", phase_lookup, METH_O,
    "The (reusable) scope of a phase: `with prof.phase(\"forward\"): ...`"};
PyTypeObject g_phase_table_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

void init_phase_table_type() {
  ready_type(g_phase_table_type, "steptrace._core.PhaseTable", sizeof(RawPhaseTable),
             "The profiler behind a prof.phase function.", phase_table_dealloc, nullptr, nullptr,
             nullptr);
}

}  // namespace

// `prof.phase` for Python: a builtin whose calls skip pybind11's dispatcher.
py::object make_phase_function(py::object owner) {
  RawPhaseTable* table = PyObject_New(RawPhaseTable, &g_phase_table_type);
  if (table == nullptr) throw py::error_already_set();
  table->count = 0;
  table->profiler = &owner.cast<PyProfiler&>();
  table->owner = owner.release().ptr();
  PyObject* fn =
      PyCFunction_NewEx(&g_phase_lookup_def, reinterpret_cast<PyObject*>(table), nullptr);
  Py_DECREF(reinterpret_cast<PyObject*>(table));  // the function holds it now
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

void bind_scope_types(py::module_& m) {
  init_step_scope_type(m);
  init_phase_scope_type(m);
  init_phase_gates_type(m);
  init_phase_table_type();
}

}  // namespace steptrace::python
