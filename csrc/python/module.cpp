// pybind11 module steptrace._core. The step and phase scopes' __enter__/__exit__ run
// here in C++ so the Python hot path is one method call per boundary; scope objects are
// cached per phase so `prof.phase("forward")` allocates nothing after the first call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <tuple>

#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "steptrace/config.hpp"
#include "steptrace/error.hpp"
#include "steptrace/metrics.hpp"
#include "steptrace/profiler.hpp"
#include "steptrace/replay.hpp"

#include "backends_capsule.hpp"
#include "metrics_bindings.hpp"

namespace py = pybind11;
using steptrace::PhaseId;

namespace {

using ProfilerPtr = std::shared_ptr<steptrace::Profiler>;

// Python callables run around every step when set (the CUDA path): `begin` returns the
// stream to time as (stream handle, device index) (or None: host clock), `end` returns (allocated,
// reserved, peak, device_used, device_total) bytes or None.
struct StepHooks {
  py::object begin;
  py::object end;
};

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
}

[[gnu::hot]] void end_step_with_hooks(steptrace::Profiler& profiler, const StepHooks& hooks,
                                      bool failed) {
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

struct StepScope {
  ProfilerPtr profiler;
  std::shared_ptr<StepHooks> hooks;

  void enter() const { begin_step_with_hooks(*profiler, *hooks); }
  void exit(bool failed) const { end_step_with_hooks(*profiler, *hooks, failed); }
};

// The torch CUDA allocator's live bytes from Python (torch.cuda.memory_allocated), for
// attributing memory growth to phases: called at phase boundaries only during the few
// steps measured after a memory_growth alert, on the training thread (which holds the GIL
// there; acquiring it again is cheap and makes other callers safe).
class PyLiveBytesSource final : public steptrace::MemorySource {
 public:
  explicit PyLiveBytesSource(py::object live) : live_(std::move(live)) {}
  ~PyLiveBytesSource() override {
    try {
      py::gil_scoped_acquire gil;
      live_ = py::object();
    } catch (...) {
      // pybind11 may throw taking the GIL, and a destructor must not: leak the reference
      // rather than drop it without the GIL
      static_cast<void>(live_.release());
    }
  }
  const char* name() const noexcept override { return "torch_cuda_allocator"; }
  void sample(steptrace::MemorySample& /*out*/) noexcept override {}  // the step hook does it
  std::int64_t live_bytes() noexcept override {
    try {
      py::gil_scoped_acquire gil;
      const py::object v = live_();
      return v.is_none() ? -1 : v.cast<std::int64_t>();
    } catch (...) {
      return -1;
    }
  }

 private:
  py::object live_;
};

// The classes of steptrace.errors, set at import (each also a ValueError/RuntimeError).
PyObject* g_config_error = nullptr;
PyObject* g_usage_error = nullptr;
PyObject* g_base_error = nullptr;
PyObject* g_usage_warning = nullptr;

// Sets the Python exception for a C++ one and returns nullptr (for raw C-API methods).
PyObject* raise_python(const std::exception& e) {
  PyObject* type = PyExc_RuntimeError;
  if (dynamic_cast<const steptrace::ConfigError*>(&e) != nullptr) {
    type = g_config_error;
  } else if (dynamic_cast<const steptrace::UsageError*>(&e) != nullptr) {
    type = g_usage_error;
  } else if (dynamic_cast<const steptrace::Error*>(&e) != nullptr) {
    type = g_base_error;
  }
  PyErr_SetString(type, e.what());
  return nullptr;
}

// Readies one of the module's plain C-API types; `m` non-null also exports it by name.
void ready_type(PyTypeObject& t, const char* name, Py_ssize_t size, const char* doc,
                destructor dealloc, PyMethodDef* methods, PyGetSetDef* getset, py::module_* m) {
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_flags |= Py_TPFLAGS_DEFAULT;
  t.tp_doc = doc;
  t.tp_dealloc = dealloc;
  t.tp_methods = methods;
  t.tp_getset = getset;
  if (PyType_Ready(&t) < 0) throw py::error_already_set();
  if (m != nullptr) {
    Py_INCREF(&t);
    const char* short_name = std::strrchr(name, '.') + 1;
    m->attr(short_name) = py::handle(reinterpret_cast<PyObject*>(&t));
  }
}

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

py::object make_phase_scope(const ProfilerPtr& profiler, PhaseId id) {
  RawPhaseScope* s = PyObject_New(RawPhaseScope, &g_phase_scope_type);
  if (s == nullptr) throw py::error_already_set();
  s->owner = new ProfilerPtr(profiler);
  s->core = profiler.get();
  s->call = scope_call<phase_scope_enter, phase_scope_exit>;
  s->id = id;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(s));
}

// ---- the gates of automatic phases (steptrace.autophase), as a plain C-API type ----
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

py::object make_step_scope(const StepScope& scope);

// Wraps a Profiler with the Python-facing conveniences. Scopes share ownership of the
// profiler, so a scope kept past the profiler object stays safe to call.
class PyProfiler {
 public:
  PyProfiler(steptrace::Config config, const std::map<std::string, std::string>& versions,
             bool external_profiler, py::object live_bytes,
             std::pair<std::string, std::string> comm, py::object given_backends) {
    steptrace::RunInfo info;
    for (const auto& [k, v] : versions) info.versions.emplace_back(k, v);
    info.external_profiler_active = external_profiler;
    info.comm_method = std::move(comm.first);
    info.comm_untimed = std::move(comm.second);
    steptrace::Backends backends;
    // Backends from another module of this build (the test build's steptrace._testing
    // fakes), through the public extension points only (backends_capsule.hpp).
    if (!given_backends.is_none()) {
      backends = steptrace::python::take_backends_capsule(given_backends);
    }
    if (!live_bytes.is_none()) {  // first: attribution takes the first live figure
      auto& sources = backends.memory_sources;
      const bool had_sources = !sources.empty();
      sources.insert(sources.begin(), std::make_unique<PyLiveBytesSource>(std::move(live_bytes)));
      // a given list replaces the default RSS source: keep it
      if (!had_sources && config.sample_rss) {
        if (auto rss = steptrace::make_rss_source()) sources.push_back(std::move(rss));
      }
    }
    profiler_ = std::make_shared<steptrace::Profiler>(std::move(config), std::move(info),
                                                      std::move(backends));
    hooks_ = std::make_shared<StepHooks>();
    step_ = StepScope{profiler_, hooks_};
    step_scope_ = make_step_scope(step_);
  }

  py::object step() const { return step_scope_; }

  // The scope of a phase name (a str); prof.phase's table (RawPhaseTable) remembers the
  // name objects it has seen.
  py::object phase(py::handle name) {
    PyObject* key = name.ptr();
    if (!PyUnicode_Check(key)) {
      throw py::type_error("phase name must be a str, got " + std::string(Py_TYPE(key)->tp_name));
    }
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(key, &size);
    if (utf8 == nullptr) throw py::error_already_set();
    const PhaseId id = profiler_->phase_id(std::string_view(utf8, static_cast<std::size_t>(size)));
    if (id >= by_id_.size()) by_id_.resize(id + 1);
    if (!by_id_[id]) by_id_[id] = make_phase_scope(profiler_, id);
    return by_id_[id];
  }

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

py::object make_step_scope(const StepScope& scope) {
  RawStepScope* s = PyObject_New(RawStepScope, &g_step_scope_type);
  if (s == nullptr) throw py::error_already_set();
  s->scope = new StepScope(scope);
  s->core = s->scope->profiler.get();
  s->hooks = s->scope->hooks.get();
  s->call = scope_call<step_scope_enter, step_scope_exit>;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(s));
}

// `prof.step` for Python: a builtin bound to the step scope that returns it.
[[gnu::hot]] PyObject* return_self(PyObject* self, PyObject* /*unused*/) {
  Py_INCREF(self);
  return self;
}
PyMethodDef g_step_function_def = {"step", return_self, METH_NOARGS,
                                   "The (reusable) step scope: `with prof.step(): ...`"};

py::object make_step_function(const py::object& step_scope) {
  PyObject* fn = PyCFunction_NewEx(&g_step_function_def, step_scope.ptr(), nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

// ---- prof.data(loader): the loader's iterator, each next() timed as data wait ----
// The integer dtypes a (batch, sequence) tensor of token ids may have; torch has 8.
constexpr std::size_t kMaxIntDtypes = 12;
PyObject* g_str_shape = nullptr;  // interned attribute names, set at import
PyObject* g_str_dtype = nullptr;

struct RawDataIterator {
  PyObject_HEAD steptrace::Profiler* core;  // *profiler, read without its line (RawPhaseScope)
  ProfilerPtr* profiler;                    // owned
  PyObject* inner;                          // the loader's iterator
  PyObject* on_item;                        // called with each item (counts its work); or null
  bool started;                             // its first item was taken
  // torch.Tensor and torch's integer dtypes (null / none: every item goes to on_item):
  // the common batches (a tensor, or a tuple or list led by one) are counted here, as
  // steptrace.work.batch_counter would, without its Python frames (issue 30: ~6 us per
  // item once a training step has flushed the caches).
  PyTypeObject* tensor_type;
  std::array<PyObject*, kMaxIntDtypes> int_dtypes;
  std::size_t int_dtype_count;
  // The getters of tensor_type's `shape` and `dtype` (null: none found), valid while its
  // attributes keep this version tag: see tensor_attr.
  const PyGetSetDef* shape_getter;
  const PyGetSetDef* dtype_getter;
  unsigned int tensor_version;
};

// The C getter behind `type.<name>`, or null where it is not a plain getset descriptor.
const PyGetSetDef* getset_of(PyTypeObject* type, PyObject* name) {
  PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), name);
  if (d == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const PyGetSetDef* get = Py_IS_TYPE(d, &PyGetSetDescr_Type)
                               ? reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset
                               : nullptr;
  Py_DECREF(d);  // the type holds it (in its own or a base's dict)
  return get != nullptr && get->get != nullptr ? get : nullptr;
}

// item.<name> for an exact tensor_type: its getter, called straight. That is what the
// attribute lookup would find (a getset descriptor is a data descriptor: it wins over the
// instance dict), without the lookup, whose cold cost was ~0.5 us a read (issue 30); the
// version tag changes when the type's attributes do. Any other object: the lookup.
[[gnu::hot]] PyObject* tensor_attr(const RawDataIterator& it, PyObject* item,
                                   const PyGetSetDef* getter, PyObject* name) {
  PyTypeObject* t = it.tensor_type;
  if (getter != nullptr && Py_TYPE(item) == t &&
      PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG) &&
      t->tp_version_tag == it.tensor_version) {
    return getter->get(item, getter->closure);
  }
  return PyObject_GetAttr(item, name);
}

int data_iterator_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* it = reinterpret_cast<RawDataIterator*>(self);
  Py_VISIT(it->inner);
  Py_VISIT(it->on_item);
  Py_VISIT(reinterpret_cast<PyObject*>(it->tensor_type));
  for (std::size_t i = 0; i < it->int_dtype_count; ++i) Py_VISIT(it->int_dtypes[i]);
  return 0;
}

int data_iterator_clear(PyObject* self) {
  auto* it = reinterpret_cast<RawDataIterator*>(self);
  Py_CLEAR(it->inner);
  Py_CLEAR(it->on_item);
  Py_CLEAR(it->tensor_type);
  for (std::size_t i = 0; i < it->int_dtype_count; ++i) Py_CLEAR(it->int_dtypes[i]);
  it->int_dtype_count = 0;
  return 0;
}

// steptrace.work.batch_work for the batches it reads from a tensor: (samples, tokens), -1
// where unknown. False where this item is not one of those (a mapping, a custom batch, a
// tuple subclass) or reading it failed: then on_item decides (and raises what it raises).
[[gnu::hot]] bool tensor_batch_work(const RawDataIterator& it, PyObject* item, double* samples,
                                    double* tokens) {
  *samples = -1;
  *tokens = -1;
  PyObject* batch = item;
  // exact types only, as batch_work's `type(batch) is tuple or type(batch) is list`
  if (PyTuple_CheckExact(item)) {
    if (PyTuple_GET_SIZE(item) == 0) return true;  // nothing to count
    batch = PyTuple_GET_ITEM(item, 0);
  } else if (PyList_CheckExact(item)) {
    if (PyList_GET_SIZE(item) == 0) return true;
    batch = PyList_GET_ITEM(item, 0);
  }
  if (!PyObject_TypeCheck(batch, it.tensor_type)) return false;
  Py_INCREF(batch);  // a list's item: the attribute reads below may run Python code
  PyObject* shape = tensor_attr(it, batch, it.shape_getter, g_str_shape);
  bool ok = false;
  if (shape != nullptr && PyTuple_Check(shape)) {  // torch.Size is a tuple
    const Py_ssize_t dims = PyTuple_GET_SIZE(shape);
    if (dims == 0) {
      ok = true;  // a 0-d tensor: no batch dimension
    } else {
      const long long rows = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
      ok = !(rows == -1 && PyErr_Occurred());
      if (ok) *samples = static_cast<double>(rows);
      if (ok && dims == 2) {
        const long long cols = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 1));
        PyObject* dtype = cols == -1 && PyErr_Occurred()
                              ? nullptr
                              : tensor_attr(it, batch, it.dtype_getter, g_str_dtype);
        ok = dtype != nullptr;
        // dtypes are singletons: identity is batch_work's set membership
        for (std::size_t i = 0; ok && i < it.int_dtype_count; ++i) {
          if (dtype == it.int_dtypes[i]) {
            long long product = 0;  // Python's int product; an overflow goes to on_item
            ok = !__builtin_mul_overflow(rows, cols, &product);
            *tokens = static_cast<double>(product);
            break;
          }
        }
        Py_XDECREF(dtype);
      }
    }
  }
  Py_XDECREF(shape);
  Py_DECREF(batch);
  if (!ok) {
    PyErr_Clear();  // on_item reads it again and raises what batch_work would
    *samples = -1;
    *tokens = -1;
  }
  return ok;
}

void data_iterator_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  data_iterator_clear(self);
  delete reinterpret_cast<RawDataIterator*>(self)->profiler;
  PyObject_GC_Del(self);
}

[[gnu::hot]] PyObject* data_iterator_next(PyObject* self) {
  auto* it = reinterpret_cast<RawDataIterator*>(self);
  if (it->inner == nullptr) return nullptr;
  steptrace::Profiler& prof = *it->core;
  const std::int64_t inside_before = prof.data_inside_step();
  try {
    prof.begin_data();
  } catch (const std::exception& e) {
    return raise_python(e);
  }
  if (inside_before == 0 && prof.data_inside_step() > 0) {
    // Once per profiler: the core counts every time (run_end's data_inside_step). Only a
    // warnings filter set to "error" makes this raise, and then no item was taken.
    if (PyErr_WarnEx(g_usage_warning,
                     "the loader wrapped by prof.data() was advanced inside a step; that wait "
                     "is timed as part of the step, not as data_ms (advance it between steps; "
                     "run_end counts these in data_inside_step)",
                     1) < 0) {
      try {
        prof.end_data();
      } catch (const std::exception&) {
      }
      return nullptr;
    }
  }
  PyObject* item = PyIter_Next(it->inner);  // nullptr: exhausted, or the loader raised
  // The first item and the end (a DataLoader's workers start, or are joined, in these
  // waits) are the loader's start at an epoch boundary: data, but no slow step.
  const bool loader_start = !it->started || (item == nullptr && !PyErr_Occurred());
  it->started = true;
  try {
    prof.end_data(loader_start);  // the loader's exception, if any, stays set
  } catch (const std::exception&) {
  }
  if (item == nullptr) return nullptr;
  // after the wait: not part of data_ms
  double samples = -1;
  double tokens = -1;
  if (it->tensor_type != nullptr && tensor_batch_work(*it, item, &samples, &tokens)) {
    if (samples >= 0 || tokens >= 0) {
      prof.add_work(samples, tokens, -1.0, steptrace::WorkSource::kBatch);
    }
  } else if (it->on_item != nullptr) {
    PyObject* counted = PyObject_CallOneArg(it->on_item, item);
    if (counted == nullptr) {
      Py_DECREF(item);
      return nullptr;
    }
    Py_DECREF(counted);
  }
  return item;
}

PyTypeObject g_data_iterator_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

void init_data_iterator_type() {
  g_str_shape = PyUnicode_InternFromString("shape");
  g_str_dtype = PyUnicode_InternFromString("dtype");
  if (g_str_shape == nullptr || g_str_dtype == nullptr) throw py::error_already_set();
  PyTypeObject& t = g_data_iterator_type;
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  t.tp_traverse = data_iterator_traverse;
  t.tp_clear = data_iterator_clear;
  t.tp_iter = PyObject_SelfIter;
  t.tp_iternext = data_iterator_next;
  ready_type(t, "steptrace._core.DataIterator", sizeof(RawDataIterator),
             "Iterates a loader, timing each wait for the next item as the next step's data_ms.",
             data_iterator_dealloc, nullptr, nullptr, nullptr);
}

py::object make_data_iterator(const ProfilerPtr& profiler, py::handle iterable, py::handle on_item,
                              py::handle tensor_type, const py::tuple& int_dtypes) {
  if (!tensor_type.is_none() && !PyType_Check(tensor_type.ptr())) {
    throw py::type_error("data: tensor_type must be a type (torch.Tensor) or None");
  }
  if (int_dtypes.size() > kMaxIntDtypes) {
    throw py::value_error("data: at most " + std::to_string(kMaxIntDtypes) + " int_dtypes");
  }
  // Making the iterator starts the loader (a DataLoader starts its workers): between steps,
  // data and the loader's start.
  steptrace::Profiler& core = *profiler;
  bool timed = !core.in_step();
  if (timed) {
    try {
      core.begin_data();
    } catch (const std::exception&) {
      timed = false;
    }
  }
  PyObject* inner = PyObject_GetIter(iterable.ptr());
  if (timed) {
    try {
      core.end_data(/*loader_start=*/true);
    } catch (const std::exception&) {
    }
  }
  if (inner == nullptr) throw py::error_already_set();
  RawDataIterator* it = PyObject_GC_New(RawDataIterator, &g_data_iterator_type);
  if (it == nullptr) {
    Py_DECREF(inner);
    throw py::error_already_set();
  }
  it->profiler = new ProfilerPtr(profiler);
  it->core = profiler.get();
  it->inner = inner;
  it->on_item = nullptr;
  it->started = false;
  if (!on_item.is_none()) {
    it->on_item = on_item.ptr();
    Py_INCREF(it->on_item);
  }
  it->tensor_type = nullptr;
  it->int_dtype_count = 0;
  it->shape_getter = nullptr;
  it->dtype_getter = nullptr;
  it->tensor_version = 0;
  if (!tensor_type.is_none()) {
    it->tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.ptr());
    Py_INCREF(tensor_type.ptr());
    // the lookups assign the type its version tag, where it can have one
    if (it->tensor_type->tp_getattro == PyObject_GenericGetAttr) {
      it->shape_getter = getset_of(it->tensor_type, g_str_shape);
      it->dtype_getter = getset_of(it->tensor_type, g_str_dtype);
      if (PyType_HasFeature(it->tensor_type, Py_TPFLAGS_VALID_VERSION_TAG)) {
        it->tensor_version = it->tensor_type->tp_version_tag;
      } else {
        it->shape_getter = nullptr;
        it->dtype_getter = nullptr;
      }
    }
    for (const py::handle dtype : int_dtypes) {
      it->int_dtypes[it->int_dtype_count++] = dtype.inc_ref().ptr();
    }
  }
  PyObject_GC_Track(reinterpret_cast<PyObject*>(it));
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(it));
}

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

steptrace::EndReason parse_reason(const std::string& reason) {
  if (reason == "normal") return steptrace::EndReason::kNormal;
  if (reason == "exception") return steptrace::EndReason::kException;
  if (reason == "signal") return steptrace::EndReason::kSignal;
  if (reason == "exit") return steptrace::EndReason::kExit;
  throw steptrace::ConfigError("close reason \"" + reason +
                               "\" is unknown; allowed: normal, exception, signal, exit");
}

steptrace::IntervalKind parse_interval(const std::string& kind) {
  if (const auto k = steptrace::interval_kind(kind)) return *k;
  throw steptrace::ConfigError(
      "interval kind \"" + kind +
      "\" is unknown; allowed: eval, checkpoint, restore, other (the loader's "
      "wait is data: wrap the loader with prof.data())");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "steptrace's C++ core (use the steptrace package, not this module)";
  m.attr("MAX_PHASES") = steptrace::kMaxPhases;  // the phase table's size, for Python's bounds
  steptrace::python::bind_metrics(m);

  // steptrace.errors defines the exception classes (each also a ValueError/RuntimeError).
  {
    py::module_ errors = py::module_::import("steptrace.errors");
    g_config_error = py::object(errors.attr("ConfigError")).release().ptr();
    g_usage_error = py::object(errors.attr("UsageError")).release().ptr();
    g_base_error = py::object(errors.attr("SteptraceError")).release().ptr();
    g_usage_warning = py::object(errors.attr("UsageWarning")).release().ptr();
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const steptrace::ConfigError& e) {
      PyErr_SetString(g_config_error, e.what());
    } catch (const steptrace::UsageError& e) {
      PyErr_SetString(g_usage_error, e.what());
    } catch (const steptrace::Error& e) {
      PyErr_SetString(g_base_error, e.what());
    }
  });

  // One attribute per option of steptrace/config_options.def, with its one-line doc.
  py::class_<steptrace::Config> config_type(m, "Config");
  config_type.def(py::init<>());
#define STEPTRACE_CONFIG_OPTION(group, type, name, default_value, check, doc) \
  config_type.def_readwrite(#name, &steptrace::Config::name, doc);
#include "steptrace/config_options.def"
#include "steptrace/ext/device_activity.hpp"
  config_type.def("validate", &steptrace::Config::validate);

  init_step_scope_type(m);
  init_phase_scope_type(m);
  init_phase_gates_type(m);
  init_phase_table_type();
  init_data_iterator_type();

  // The records this profiler writes, read in this process (the cross-rank exchange and
  // the OTLP export follow them without reading the log file back).
  struct RecordReader {
    std::function<std::vector<std::string>()> next;
  };
  py::class_<RecordReader>(m, "RecordReader")
      .def(
          "new_lines",
          [](RecordReader& r) {
            std::vector<std::string> lines;
            {
              py::gil_scoped_release nogil;
              lines = r.next();
            }
            py::list out;
            for (const std::string& line : lines) out.append(py::bytes(line));
            return out;
          },
          "The whole lines (bytes, no newline) written since the previous call; run_start "
          "first.");

  py::class_<PyProfiler>(m, "Profiler")
      .def(py::init<steptrace::Config, const std::map<std::string, std::string>&, bool, py::object,
                    std::pair<std::string, std::string>, py::object>(),
           py::arg("config"), py::arg("versions") = std::map<std::string, std::string>{},
           py::arg("external_profiler") = false, py::arg("live_bytes") = py::none(),
           py::arg("comm") = std::pair<std::string, std::string>{},
           py::arg("backends") = py::none(),
           "comm: (method, why untimed) of the collectives' timing, for run_start's "
           "backends.comm (both empty: no entry); `backends`: a capsule of backends from a "
           "module of the same build (steptrace._testing's fakes in the test build), taken once")
      .def("set_external_profiler",
           [](PyProfiler& p, bool active) { p.core().set_external_profiler(active); })
      .def(
          "data",
          [](PyProfiler& p, py::handle iterable, py::handle on_item, py::handle tensor_type,
             const py::tuple& int_dtypes) {
            return make_data_iterator(p.profiler(), iterable, on_item, tensor_type, int_dtypes);
          },
          py::arg("iterable"), py::arg("on_item") = py::none(), py::arg("tensor_type") = py::none(),
          py::arg("int_dtypes") = py::tuple(),
          "Iterates `iterable`, timing each wait as the next step's data_ms; `on_item(item)` "
          "(when given) sees each item after its wait. With `tensor_type` (torch.Tensor) and "
          "`int_dtypes` (torch's integer dtypes) an item that is a tensor, or an exact tuple "
          "or list led by one, has its work counted here as steptrace.work.batch_work "
          "would (source batch), and on_item sees only the other items")
      .def(
          "step_function", [](PyProfiler& p) { return make_step_function(p.step()); },
          "prof.step as a builtin function (cheaper to call than the method)")
      .def(
          "phase_gates",
          [](PyProfiler& p, const std::vector<std::string>& names) {
            return make_phase_gates(p.profiler(), names);
          },
          py::arg("names"), "The gates of automatic phases, bound to the calling thread")
      .def("phase_function", &make_phase_function,
           "prof.phase as a builtin function (cheaper to call than the method)")
      .def("begin_step", [](PyProfiler& p) { p.step_scope().enter(); })
      .def_property_readonly(
          "clock_ns", [](PyProfiler& p) { return p.core().clock_ns(); },
          "The profiler's clock (monotonic ns) as steps and phases read it")
      .def(
          "begin_step_at",
          [](PyProfiler& p, std::int64_t start_ns) {
            if (p.hooks().begin) set_step_stream(p.core(), p.hooks());
            p.core().begin_step_at(start_ns);
          },
          py::arg("start_ns"), "Begins a step that began at a clock_ns reading")
      .def(
          "add_phase",
          [](PyProfiler& p, const std::string& name, std::int64_t begin_ns, std::int64_t end_ns) {
            p.core().add_phase(p.core().phase_id(name), begin_ns, end_ns);
          },
          py::arg("name"), py::arg("begin_ns"), py::arg("end_ns"),
          "Adds a phase that ran between two clock_ns readings to the step in progress")
      .def(
          "end_step", [](PyProfiler& p, bool failed) { p.step_scope().exit(failed); },
          py::arg("failed") = false)
      .def(
          "set_step_hooks",
          [](PyProfiler& p, py::object begin, py::object end) {
            p.hooks().begin = begin.is_none() ? py::object() : begin;
            p.hooks().end = end.is_none() ? py::object() : end;
          },
          py::arg("begin"), py::arg("end"))
      .def(
          "set_stream",
          [](PyProfiler& p, std::uintptr_t s, int device) { p.core().set_stream(s, device); },
          py::arg("stream"), py::arg("device") = -1)
      .def("clear_stream", [](PyProfiler& p) { p.core().clear_stream(); })
      .def_property_readonly("steps_in_flight",
                             [](PyProfiler& p) { return p.core().steps_in_flight(); })
      .def("begin_phase",
           [](PyProfiler& p, const std::string& name) {
             p.core().begin_phase(p.core().phase_id(name));
           })
      .def("end_phase",
           [](PyProfiler& p, const std::string& name) {
             p.core().end_phase(p.core().phase_id(name));
           })
      .def("begin_compile", [](PyProfiler& p) { p.core().begin_compile(); })
      .def("end_compile", [](PyProfiler& p) { p.core().end_compile(); })
      // gc.callbacks' start and stop (steptrace.profiler installs them): one call each
      .def("begin_gc", [](PyProfiler& p, int generation) { p.core().begin_gc(generation); })
      .def("end_gc", [](PyProfiler& p) { p.core().end_gc(); })
      .def("begin_data", [](PyProfiler& p) { p.core().begin_data(); })
      .def(
          "end_data", [](PyProfiler& p, bool loader_start) { p.core().end_data(loader_start); },
          py::arg("loader_start") = false)
      .def(
          "begin_interval",
          [](PyProfiler& p, const std::string& kind) {
            p.core().begin_interval(parse_interval(kind));
          },
          py::arg("kind"),
          "Begins an interval (eval, checkpoint, restore, other); ends the open one")
      .def(
          "end_interval",
          [](PyProfiler& p, const std::string& kind) {
            p.core().end_interval(parse_interval(kind));
          },
          py::arg("kind"), "Ends the open interval when it is of `kind`")
      .def_property_readonly("open_interval",
                             [](PyProfiler& p) -> py::object {
                               const auto k = p.core().open_interval();
                               if (!k) return py::none();
                               return py::str(std::string(steptrace::interval_name(*k)));
                             })
      .def(
          "set_step_value",  // string_view: the str's own UTF-8 buffer, no copy per call
          [](PyProfiler& p, std::string_view name, double value) {
            p.core().set_step_value(name, value);
          },
          py::arg("name"), py::arg("value"))
      .def(
          "set_progress",
          [](PyProfiler& p, std::int64_t progress) { p.core().set_progress(progress); },
          py::arg("progress"),
          "The training step the program is at (0-based), for the step record's progress")
      .def(
          "add_earlier_attempts",
          [](PyProfiler& p, std::string_view cause, double seconds) {
            p.core().add_earlier_attempts(cause, seconds);
          },
          py::arg("cause"), py::arg("seconds"))
      .def(
          "add_work",  // positional only: called per step or per micro-batch
          [](PyProfiler& p, double samples, double tokens, double flops, int source) {
            if (source < static_cast<int>(steptrace::WorkSource::kModel) ||
                source > static_cast<int>(steptrace::WorkSource::kUser)) {
              throw py::value_error("add_work: source must be 1..4 (model, batch, option, user)");
            }
            p.core().add_work(samples, tokens, flops, static_cast<steptrace::WorkSource>(source));
          },
          "Adds samples, tokens and FLOPs (each < 0: unknown) to the step in progress, from "
          "source 1 (model), 2 (batch), 3 (option) or 4 (user)")
      .def(
          "set_mfu_dtype",
          [](PyProfiler& p, std::string_view dtype) { return p.core().set_mfu_dtype(dtype); },
          py::arg("dtype"),
          "The math dtype MFU's peak is for (where mfu_dtype is auto and peak_tflops unset)")
      .def(
          "set_step_memory",
          [](PyProfiler& p, std::int64_t allocated, std::int64_t reserved, std::int64_t peak,
             std::int64_t device_used, std::int64_t device_total) {
            steptrace::MemorySample s;
            s.allocated_bytes = allocated;
            s.reserved_bytes = reserved;
            s.peak_bytes = peak;
            s.device_used_bytes = device_used;
            s.device_total_bytes = device_total;
            p.core().set_step_memory(s);
          },
          py::kw_only(), py::arg("allocated_bytes") = -1, py::arg("reserved_bytes") = -1,
          py::arg("peak_bytes") = -1, py::arg("device_used_bytes") = -1,
          py::arg("device_total_bytes") = -1)
      .def("flush",
           [](PyProfiler& p) {
             py::gil_scoped_release release;
             p.core().flush();
           })
      .def(
          "close",
          [](PyProfiler& p, const std::string& reason, const std::string& error) {
            const auto r = parse_reason(reason);
            py::gil_scoped_release release;
            p.core().close(r, error);
          },
          py::arg("reason") = "normal", py::arg("error") = "")
      .def("subscribe_events", [](PyProfiler& p) { p.core().subscribe_events(); })
      .def(
          "wait_event",
          [](PyProfiler& p, int timeout_ms) -> py::object {
            std::optional<steptrace::ProfilerEvent> e;
            {
              py::gil_scoped_release release;
              e = p.core().wait_event(timeout_ms);
            }
            if (!e) return py::none();
            return py::make_tuple(e->stack_request         ? "stacks"
                                  : e->collectives_request ? "collectives"
                                                           : "alert",
                                  e->json);
          },
          py::arg("timeout_ms"),
          "Next alert event as (\"alert\", json), (\"stacks\", \"\") or (\"collectives\", "
          "\"\"), or None on timeout")
      .def("answer_stacks",
           [](PyProfiler& p, std::string stacks) { p.core().answer_stacks(std::move(stacks)); })
      .def("answer_collectives",
           [](PyProfiler& p, std::string json) { p.core().answer_collectives(std::move(json)); })
      .def("collective_begin", [](PyProfiler& p) { return p.core().collective_begin(); })
      .def(
          "collective_end",
          [](PyProfiler& p, std::int64_t token, bool host_blocked, std::int64_t bytes,
             std::int64_t bus_bytes) {
            p.core().collective_end(token, host_blocked, bytes, bus_bytes);
          },
          py::arg("token"), py::arg("host_blocked") = true, py::arg("bytes") = 0,
          py::arg("bus_bytes") = 0)
      .def_property_readonly("collectives_in_flight",
                             [](PyProfiler& p) { return p.core().collectives_in_flight(); })
      .def_property_readonly("current_phase",
                             [](PyProfiler& p) { return p.core().current_phase(); })
      .def_property_readonly("current_interval",
                             [](PyProfiler& p) { return p.core().current_interval(); })
      .def(
          "set_peers_in_interval",
          [](PyProfiler& p, int peers, double notice_s) {
            p.core().set_peers_in_interval(peers, notice_s);
          },
          py::arg("peers"), py::arg("notice_s"),
          "For the cross-rank exchange: other ranks now in an evaluation or checkpoint, and how "
          "late this rank learns of one (the hang rule's grace for a step waiting in a "
          "collective)")
      .def(
          "write_record",
          [](PyProfiler& p, const std::string& json) {
            py::gil_scoped_release release;
            p.core().write_record(json);
          },
          py::arg("json"), "Writes a cluster/alert/resolved record (one JSON object) now")
      .def_property_readonly("closed", [](PyProfiler& p) { return p.core().closed(); })
      .def_property_readonly(
          "device_memory_sampled", [](PyProfiler& p) { return p.core().device_memory_sampled(); },
          "Whether device-wide memory comes from the telemetry sampler (NVML): no step calls "
          "mem_get_info then")
      .def_property_readonly("write_errors", [](PyProfiler& p) { return p.core().write_errors(); })
      .def("record_reader", [](PyProfiler& p) { return RecordReader{p.core().record_reader()}; })
      .def_property_readonly("write_error", [](PyProfiler& p) { return p.core().write_error(); })
      .def_property_readonly("data_inside_step",
                             [](PyProfiler& p) { return p.core().data_inside_step(); })
      .def_property_readonly("in_step", [](PyProfiler& p) { return p.core().in_step(); })
      .def_property_readonly("step_index", [](PyProfiler& p) { return p.core().step_index(); })
      .def_property_readonly("log_path", [](PyProfiler& p) { return p.core().log_path(); })
      .def_property_readonly("attempt", [](PyProfiler& p) { return p.core().attempt(); })
      .def_property_readonly("process_start_unix_ns",
                             [](PyProfiler& p) { return p.core().process_start_unix_ns(); })
      .def_property_readonly("metrics_port", [](PyProfiler& p) { return p.core().metrics_port(); })
      .def_property_readonly("config", [](PyProfiler& p) { return p.core().config(); });

  m.def("version", &steptrace::version);
  m.def("install_sigterm_handler", &steptrace::install_sigterm_handler, py::arg("terminate"),
        py::arg("grace_s"),
        "A C-level SIGTERM handler (chaining to the current one) and its watcher thread");
  m.def("remove_sigterm_handler", &steptrace::remove_sigterm_handler);
  m.def("spare_signal", &steptrace::spare_signal,
        "A real-time signal nobody handles (default disposition), or -1");
  m.def("set_stack_dump_signal", &steptrace::set_stack_dump_signal, py::arg("signum"),
        py::arg("fd"),
        "Hang stacks from the handler installed for signum (faulthandler.register), which "
        "writes them to fd; False when no handler is installed for it");
  m.def("stack_dump_signal_reset", &steptrace::stack_dump_signal_reset,
        "True when the armed signal is back at its default disposition (arm it again)");
  using ReplayTuple = std::tuple<std::int64_t, std::int64_t, double, double, bool,
                                 std::vector<std::pair<std::string, double>>,
                                 std::array<std::int64_t, 7>, bool, std::array<double, 14>>;
  m.def(
      "replay_detectors",
      [](const steptrace::Config& config, const std::vector<ReplayTuple>& steps) {
        std::vector<steptrace::ReplayStep> in;
        in.reserve(steps.size());
        for (const auto& t : steps) {
          steptrace::ReplayStep s;
          std::tie(s.step, s.start_unix_ns, s.data_ms, s.step_ms, s.failed, s.phases_ms,
                   std::ignore, s.rss_fresh, std::ignore) = t;
          const auto& between = std::get<8>(t);
          s.other_ms = between[0];
          s.interval_in_step_ms = between[1];
          s.runq_ms = between[2];
          s.runq_span_ms = between[3];
          s.steal_ms = between[4];
          s.data_start_ms = between[5];
          s.compile_ms = between[6];
          s.tokens = between[7];
          s.samples = between[8];
          s.gc_ms = between[9];
          s.gc_gen2_ms = between[10];
          s.gc_between_ms = between[11];
          s.gc_between_gen2_ms = between[12];
          s.gc_count = static_cast<int>(between[13]);
          const auto& m = std::get<6>(t);
          s.memory.allocated_bytes = m[0];
          s.memory.reserved_bytes = m[1];
          s.memory.peak_bytes = m[2];
          s.memory.rss_bytes = m[3];
          s.memory.heap_bytes = m[4];
          s.memory.device_used_bytes = m[5];
          s.memory.device_total_bytes = m[6];
          in.push_back(std::move(s));
        }
        py::gil_scoped_release release;
        return steptrace::replay_detectors(config, in);
      },
      py::arg("config"), py::arg("steps"),
      "The record detectors over steps (step, start_unix_ns, data_ms, step_ms, failed, "
      "[(phase, ms)], (allocated, reserved, peak, rss, heap, device_used, device_total) bytes "
      "or -1, rss_fresh, (other_ms, interval_in_step_ms, runq_ms or -1, runq_span_ms, steal_ms or "
      "-1, data_start_ms, compile_ms, tokens or -1, samples or -1, gc_ms, gc_gen2_ms, "
      "gc_between_ms, gc_between_gen2_ms, gc_count)): their records as JSON "
      "lines");
  m.def(
      "check_metric_set",
      [](const std::string& chip, const std::string& mode,
         const std::vector<std::string>& library_dirs) {
        const steptrace::MetricSetReport r = steptrace::check_metric_set(chip, mode, library_dirs);
        py::list metrics;
        for (const auto& c : r.metrics) {
          py::dict d;
          d["counter"] = c.counter;
          d["name"] = c.name;
          d["required"] = c.required;
          d["exists"] = c.exists;
          d["selected"] = c.selected;
          d["note"] = c.note;
          metrics.append(d);
        }
        py::dict out;
        out["chip"] = r.chip;
        out["family"] = r.family;
        out["mode"] = r.mode;
        out["trigger"] = r.trigger;
        out["passes"] = r.passes;
        out["metrics"] = metrics;
        out["cupti_library"] = r.cupti_library;
        out["cupti_version"] = r.cupti_version;
        out["error"] = r.error;
        out["supported_chips"] = steptrace::supported_chips();
        return out;
      },
      py::arg("chip"), py::arg("mode") = "auto",
      py::arg("library_dirs") = std::vector<std::string>{},
      "The CUPTI metric set for a chip, checked with CUPTI's host API (no GPU needed).");
}
