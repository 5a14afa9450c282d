// Config, Profiler and the module's free functions. The Profiler's record methods (the
// record channel, alert events, write_record) are in record_bindings.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "steptrace/config.hpp"
#include "steptrace/error.hpp"
#include "steptrace/metrics.hpp"
#include "steptrace/profiler.hpp"

#include "backends_capsule.hpp"
#include "bindings.hpp"

namespace steptrace::python {

namespace {

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

PyProfiler::PyProfiler(steptrace::Config config, const std::map<std::string, std::string>& versions,
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

py::object PyProfiler::phase(py::handle name) {
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

ProfilerClass bind_profiler(py::module_& m) {
  // One attribute per option of steptrace/config_options.def, with its one-line doc.
  py::class_<steptrace::Config> config_type(m, "Config");
  config_type.def(py::init<>());
#define STEPTRACE_CONFIG_OPTION(group, type, name, default_value, check, doc) \
  config_type.def_readwrite(#name, &steptrace::Config::name, doc);
#include "steptrace/config_options.def"
#include "steptrace/ext/device_activity.hpp"
  config_type.def("validate", &steptrace::Config::validate);

  ProfilerClass profiler(m, "Profiler");
  profiler
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
          "or list led by one, has its work counted here as steptrace.live.work.batch_work "
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
          "set_capture_hook",
          [](PyProfiler& p, py::object hook) {
            p.hooks().capture_armed.store(false);
            p.hooks().capture = hook.is_none() ? py::object() : hook;
          },
          py::arg("hook"),
          "hook(begun: bool), called after a step begins (True) and before it ends (False) "
          "while armed (steptrace.live.evidence_capture); None removes it and disarms")
      .def(
          "arm_capture",
          [](PyProfiler& p, bool on) {
            p.hooks().capture_armed.store(on && p.hooks().capture, std::memory_order_relaxed);
          },
          py::arg("on"), "Calls the capture hook at step boundaries (True) or not (False)")
      .def(
          "mark_step_profiled", [](PyProfiler& p) { p.core().mark_step_profiled(); },
          "The step in progress runs under an evidence capture: the detectors skip it")
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
      // gc.callbacks' start and stop (steptrace.live.profiler installs them): one call each
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
      .def("answer_stacks",
           [](PyProfiler& p, std::string stacks) { p.core().answer_stacks(std::move(stacks)); })
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
      .def_property_readonly("closed", [](PyProfiler& p) { return p.core().closed(); })
      .def_property_readonly(
          "device_memory_sampled", [](PyProfiler& p) { return p.core().device_memory_sampled(); },
          "Whether device-wide memory comes from the telemetry sampler (NVML): no step calls "
          "mem_get_info then")
      .def_property_readonly("write_errors", [](PyProfiler& p) { return p.core().write_errors(); })
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
  m.def(
      "check_metric_set",
      [](const std::string& chip, const std::string& mode,
         const std::vector<std::string>& library_dirs) {
        const steptrace::MetricSetReport r = steptrace::check_metric_set(chip, mode, library_dirs);
        using namespace pybind11::literals;  // "key"_a = value: a dict's items in their order
        py::list metrics;
        for (const auto& c : r.metrics) {
          metrics.append(py::dict("counter"_a = c.counter, "name"_a = c.name,
                                  "required"_a = c.required, "exists"_a = c.exists,
                                  "selected"_a = c.selected, "note"_a = c.note));
        }
        return py::dict("chip"_a = r.chip, "family"_a = r.family, "mode"_a = r.mode,
                        "trigger"_a = r.trigger, "passes"_a = r.passes, "metrics"_a = metrics,
                        "cupti_library"_a = r.cupti_library, "cupti_version"_a = r.cupti_version,
                        "error"_a = r.error, "supported_chips"_a = steptrace::supported_chips());
      },
      py::arg("chip"), py::arg("mode") = "auto",
      py::arg("library_dirs") = std::vector<std::string>{},
      "The CUPTI metric set for a chip, checked with CUPTI's host API (no GPU needed).");
  return profiler;
}

}  // namespace steptrace::python
