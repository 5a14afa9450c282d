// pybind11 module steptrace._testing: the fake device backends for the Python tests, and
// the clock-only scopes bench_overhead.py measures as the floor of the `with` API.
// Built only with -DSTEPTRACE_TEST_HOOKS=ON (scripts/setup.sh turns it on); a plain
// `pip install .` or a release wheel has no such module, and steptrace._core no fakes.
//
//   dev = steptrace._testing.FakeDevice()
//   with steptrace.Profiler(log_dir, _backends=dev.backends()) as prof:
//       with prof.step():
//           dev.work([(name, "matmul", 2.0)], [80, 30, 70, 55])
//
// The Profiler gets the fakes through the public extension points (KernelActivitySource,
// CounterSampler) in a capsule (backends_capsule.hpp). The FakeDevice and the profiler
// share the fakes, so feeding one after its profiler is gone (or never took it, as with
// kernel_activity="off") is safe.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <time.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../backends/fake/fake_device_activity.hpp"
#include "backends_capsule.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/profiler.hpp"

namespace py = pybind11;

namespace {

using steptrace::fake::FakeCounterSampler;
using steptrace::fake::FakeKernelActivity;

// The profiler's handle on a fake it shares with the FakeDevice: every call of the
// interface goes to the fake.
class SharedKernelActivity final : public steptrace::KernelActivitySource {
 public:
  explicit SharedKernelActivity(std::shared_ptr<FakeKernelActivity> f) : f_(std::move(f)) {}
  const char* name() const noexcept override { return f_->name(); }
  std::int64_t now_ns() noexcept override { return f_->now_ns(); }
  void begin_step(std::int64_t step) noexcept override { f_->begin_step(step); }
  void end_step(std::int64_t step) noexcept override { f_->end_step(step); }
  void take(std::vector<steptrace::KernelRecord>& out, std::int64_t* dropped) override {
    f_->take(out, dropped);
  }
  std::uint64_t deliveries() noexcept override { return f_->deliveries(); }
  std::uint64_t delivery_mark() noexcept override { return f_->delivery_mark(); }
  bool delivered(std::uint64_t mark) noexcept override { return f_->delivered(mark); }
  std::string kernel_name(std::uint32_t id) override { return f_->kernel_name(id); }
  steptrace::ActivityReach reach(std::int64_t t_ns) noexcept override { return f_->reach(t_ns); }
  void set_yielding(bool yielding) noexcept override { f_->set_yielding(yielding); }
  void finish() noexcept override { f_->finish(); }
  std::string status() const override { return f_->status(); }

 private:
  std::shared_ptr<FakeKernelActivity> f_;
};

class SharedCounterSampler final : public steptrace::CounterSampler {
 public:
  explicit SharedCounterSampler(std::shared_ptr<FakeCounterSampler> f) : f_(std::move(f)) {}
  const char* name() const noexcept override { return f_->name(); }
  std::int64_t now_ns() noexcept override { return f_->now_ns(); }
  void begin_step(std::int64_t step, bool sampled) noexcept override {
    f_->begin_step(step, sampled);
  }
  void end_step(std::int64_t step) noexcept override { f_->end_step(step); }
  void take(std::vector<steptrace::CounterSample>& out, std::int64_t* dropped,
            bool* overflow) override {
    f_->take(out, dropped, overflow);
  }
  std::uint64_t deliveries() noexcept override { return f_->deliveries(); }
  std::string metric(std::size_t counter) const override { return f_->metric(counter); }
  std::string device() const override { return f_->device(); }
  void finish() noexcept override { f_->finish(); }
  std::string status() const override { return f_->status(); }

 private:
  std::shared_ptr<FakeCounterSampler> f_;
};

// Fake kernel activity and counters on the host's steady clock (so that fake device work
// lines up with real steps), delivered at every poll of the writer thread.
class FakeDevice {
 public:
  FakeDevice()
      : activity_(std::make_shared<FakeKernelActivity>()),
        sampler_(std::make_shared<FakeCounterSampler>()) {
    activity_->clock_ns = -1;
    sampler_->clock_ns = -1;
    activity_->delivery.auto_deliver = true;
    sampler_->delivery.auto_deliver = true;
  }

  py::capsule backends() {
    if (taken_) throw py::value_error("FakeDevice.backends() was called already");
    taken_ = true;
    auto b = std::make_unique<steptrace::Backends>();
    b->kernel_activity = std::make_unique<SharedKernelActivity>(activity_);
    b->counter_sampler = std::make_unique<SharedCounterSampler>(sampler_);
    return steptrace::python::make_backends_capsule(std::move(b));
  }

  // Device work of the step in progress: kernels back to back from now, and one counter
  // sample over them.
  void work(const std::vector<std::tuple<std::string, std::string, double>>& kernels,
            const std::vector<double>& counters) {
    const std::int64_t start = activity_->now_ns();
    std::int64_t t = start;
    for (const auto& [name, work, ms] : kernels) {
      steptrace::KernelWork w = steptrace::KernelWork::kCompute;
      if (work == "matmul") {
        w = steptrace::KernelWork::kMatmul;
      } else if (work == "nccl") {
        w = steptrace::KernelWork::kCommunication;
      } else if (work != "compute") {
        throw py::value_error("kernel work \"" + work +
                              "\" is unknown; use \"compute\", \"matmul\" or \"nccl\"");
      }
      const auto ns = static_cast<std::int64_t>(ms * 1e6);
      activity_->add_kernel(name, w, t, t + ns);
      t += ns;
    }
    if (!counters.empty()) sampler_->add_sample(start, std::max(t, start + 1), counters);
  }

 private:
  std::shared_ptr<FakeKernelActivity> activity_;
  std::shared_ptr<FakeCounterSampler> sampler_;
  bool taken_ = false;
};

// The floor of the `with` API for bench_overhead.py: scopes of a plain C-API type whose
// __enter__ and __exit__ only read the clock into a per-scope sum, the least any
// implementation of `with prof.step():` / `with prof.phase(name):` can do. What steptrace
// costs above it is its own bookkeeping.
struct RawClockScope {
  PyObject_HEAD std::int64_t sum_ns;
};

std::int64_t clock_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

PyObject* clock_scope_enter(PyObject* self, PyObject* /*unused*/) {
  reinterpret_cast<RawClockScope*>(self)->sum_ns -= clock_ns();
  Py_INCREF(self);
  return self;
}

PyObject* clock_scope_exit(PyObject* self, PyObject* const* /*args*/, Py_ssize_t /*nargs*/) {
  reinterpret_cast<RawClockScope*>(self)->sum_ns += clock_ns();
  Py_RETURN_FALSE;
}

PyMethodDef g_clock_scope_methods[] = {
    {"__enter__", clock_scope_enter, METH_NOARGS, "Reads the clock."},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(clock_scope_exit)),
     METH_FASTCALL, "Reads the clock."},
    {nullptr, nullptr, 0, nullptr}};
PyTypeObject g_clock_scope_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

py::object new_clock_scope() {
  auto* s = PyObject_New(RawClockScope, &g_clock_scope_type);
  if (s == nullptr) throw py::error_already_set();
  s->sum_ns = 0;
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(s));
}

// (step, phase) as builtins, like prof.step and prof.phase: step() returns its scope,
// phase(name) the scope of a name seen before (by identity) or a new one.
struct ClockScopes {
  py::object step = new_clock_scope();
  std::vector<std::pair<py::object, py::object>> phases;  // (name, scope)
};

PyObject* clock_step(PyObject* self, PyObject* /*unused*/) {
  PyObject* scope = static_cast<ClockScopes*>(PyCapsule_GetPointer(self, nullptr))->step.ptr();
  Py_INCREF(scope);
  return scope;
}

PyObject* clock_phase(PyObject* self, PyObject* name) {
  auto* scopes = static_cast<ClockScopes*>(PyCapsule_GetPointer(self, nullptr));
  for (const auto& [n, scope] : scopes->phases) {
    if (n.ptr() == name) return scope.inc_ref().ptr();
  }
  try {
    scopes->phases.emplace_back(py::reinterpret_borrow<py::object>(name), new_clock_scope());
    return scopes->phases.back().second.inc_ref().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

PyMethodDef g_clock_step_def = {"step", clock_step, METH_NOARGS, "The step's clock scope."};
PyMethodDef g_clock_phase_def = {"phase", clock_phase, METH_O, "A phase's clock scope."};

py::tuple clock_scopes() {
  py::capsule owner(new ClockScopes(), [](void* p) { delete static_cast<ClockScopes*>(p); });
  PyObject* step = PyCFunction_NewEx(&g_clock_step_def, owner.ptr(), nullptr);
  if (step == nullptr) throw py::error_already_set();
  py::object step_fn = py::reinterpret_steal<py::object>(step);
  PyObject* phase = PyCFunction_NewEx(&g_clock_phase_def, owner.ptr(), nullptr);
  if (phase == nullptr) throw py::error_already_set();
  return py::make_tuple(step_fn, py::reinterpret_steal<py::object>(phase));
}

}  // namespace

PYBIND11_MODULE(_testing, m) {
  m.doc() = "Test hooks of steptrace (built with -DSTEPTRACE_TEST_HOOKS=ON only)";
  m.attr("BACKENDS_CAPSULE") = steptrace::python::kBackendsCapsule;
  py::class_<FakeDevice>(m, "FakeDevice",
                         "Fake kernel activity and counters for one Profiler (the CPU twin of "
                         "CUPTI): give backends() to steptrace.Profiler(..., _backends=...)")
      .def(py::init<>())
      .def("backends", &FakeDevice::backends,
           "A capsule of the fake kernel activity and counter sampler, for one Profiler")
      .def("work", &FakeDevice::work, py::arg("kernels"),
           py::arg("counters") = std::vector<double>{},
           "Kernels (name, work, ms) run back to back from now, tagged with the step in "
           "progress, and one sample of counter values over them");
  g_clock_scope_type.tp_name = "steptrace._testing.ClockScope";
  g_clock_scope_type.tp_basicsize = sizeof(RawClockScope);
  g_clock_scope_type.tp_flags = Py_TPFLAGS_DEFAULT;
  g_clock_scope_type.tp_methods = g_clock_scope_methods;
  if (PyType_Ready(&g_clock_scope_type) < 0) throw py::error_already_set();
  m.def("clock_scopes", &clock_scopes,
        "(step, phase) like prof.step and prof.phase, whose scopes only read the clock: the "
        "floor of the `with` API (bench_overhead.py)");
}
