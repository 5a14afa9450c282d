// Records across the language boundary as values, never as JSON text for Python to parse:
//  - the record channel (Profiler.records): the records this profiler writes, followed in
//    this process through the core's record tap (nothing reads the log file back), each
//    decoded here into a dict, optionally only some kinds (the cross-rank exchange takes
//    steps only);
//  - alert events (Profiler.wait_event): the alert or resolved record as a dict;
//  - Profiler.write_record: Python's own records (cluster, alert, resolved) as dicts, and
//    Profiler.answer_collectives: the flight recorder's state as a dict. Each is converted
//    here into a JSON value that the core takes as it is (ProfilerAccess), never printed
//    to text and parsed again.
//
// The tap bounds what a channel may hold (RecordTap::kMaxLines, the oldest lost first),
// so a channel nobody takes from never holds the writer back or grows the process; it
// queues for a channel only the kinds the channel asked for. The decoding runs on the
// taking thread with the GIL released; the conversion to Python objects holds it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../runtime/profiler_access.hpp"
#include "steptrace/profiler.hpp"

#include "bindings.hpp"

namespace steptrace::python {

namespace {

using Json = nlohmann::ordered_json;

py::object to_python(const Json& j) {
  switch (j.type()) {
    case Json::value_t::object: {
      py::dict d;
      for (const auto& [key, value] : j.items()) d[py::str(key)] = to_python(value);
      return std::move(d);
    }
    case Json::value_t::array: {
      py::list l(j.size());
      std::size_t i = 0;
      for (const Json& value : j) l[i++] = to_python(value);
      return std::move(l);
    }
    case Json::value_t::string:
      return py::str(j.get_ref<const std::string&>());
    case Json::value_t::boolean:
      return py::bool_(j.get<bool>());
    case Json::value_t::number_integer:
      return py::int_(j.get<std::int64_t>());
    case Json::value_t::number_unsigned:
      return py::int_(j.get<std::uint64_t>());
    case Json::value_t::number_float:
      return py::float_(j.get<double>());
    default:  // null (and discarded, which parse without a callback never makes)
      return py::none();
  }
}

// A dict key as json.dumps writes it: a str as it is; None, a bool, an int or a float as
// its JSON text. Anything else is a TypeError. `api`: the entry named in errors.
std::string key_name(py::handle key, std::string_view api, const std::string& where) {
  if (PyUnicode_Check(key.ptr())) return key.cast<std::string>();
  if (key.is_none()) return "null";
  if (PyBool_Check(key.ptr())) return key.cast<bool>() ? "true" : "false";
  if (PyLong_Check(key.ptr()) || PyFloat_Check(key.ptr())) {
    return py::repr(key).cast<std::string>();
  }
  throw py::type_error(std::string(api) + ": " + where + " has a key of type " +
                       std::string(Py_TYPE(key.ptr())->tp_name) + ", not str");
}

// A Python record as JSON, as json.dumps would write it: dicts, lists and tuples, str, bool, int,
// float, None. Anything else is a TypeError; a NaN or infinity a ValueError (JSON has neither: the
// text path rejected them too).
Json from_python(py::handle v, std::string_view api, const std::string& where) {
  if (v.is_none()) return nullptr;
  if (PyBool_Check(v.ptr())) return v.cast<bool>();
  if (PyLong_Check(v.ptr())) {
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow == 0) return static_cast<std::int64_t>(n);
    if (overflow > 0) {
      const unsigned long long u = PyLong_AsUnsignedLongLong(v.ptr());
      if (!PyErr_Occurred()) return static_cast<std::uint64_t>(u);
      PyErr_Clear();
    }
    throw py::value_error(std::string(api) + ": " + where + " is an integer out of JSON's range");
  }
  if (PyFloat_Check(v.ptr())) {
    const double d = v.cast<double>();
    if (!std::isfinite(d)) {
      throw py::value_error(std::string(api) + ": " + where + " is not finite");
    }
    return d;
  }
  if (PyUnicode_Check(v.ptr())) return v.cast<std::string>();
  if (PyDict_Check(v.ptr())) {
    Json out = Json::object();
    for (const auto& [key, value] : v.cast<py::dict>()) {
      std::string name = key_name(key, api, where);
      out[name] = from_python(value, api, where + "." + name);
    }
    return out;
  }
  if (PyList_Check(v.ptr()) || PyTuple_Check(v.ptr())) {
    Json out = Json::array();
    std::size_t i = 0;
    for (const py::handle item : v) {
      std::string at = where;
      at.append("[").append(std::to_string(i++)).append("]");
      out.push_back(from_python(item, api, at));
    }
    return out;
  }
  throw py::type_error(std::string(api) + ": " + where + " is a " +
                       std::string(Py_TYPE(v.ptr())->tp_name) + ", not a JSON value");
}

// One subscriber: a reader of the core's record tap, opened for the kinds it takes (the
// tap queues no other kind for it).
class RecordChannel {
 public:
  RecordChannel(std::function<std::vector<std::string>()> next, std::vector<std::string> kinds)
      : next_(std::move(next)), kinds_(std::move(kinds)) {}

  // The records written since the previous call (the first: run_start and what followed
  // the channel's opening), of the channel's kinds, as dicts.
  py::list take() {
    std::vector<Json> records;
    {
      py::gil_scoped_release nogil;
      for (const std::string& line : next_()) {
        Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (!j.is_object()) {
          ++undecodable_;
          continue;
        }
        records.push_back(std::move(j));
      }
    }
    py::list out(records.size());
    for (std::size_t i = 0; i < records.size(); ++i) out[i] = to_python(records[i]);
    return out;
  }

  std::int64_t undecodable() const { return undecodable_; }
  const std::vector<std::string>& kinds() const { return kinds_; }

 private:
  std::function<std::vector<std::string>()> next_;
  std::vector<std::string> kinds_;  // empty: every kind
  std::int64_t undecodable_ = 0;    // lines that were not a JSON object (none expected)
};

}  // namespace

py::object record_to_python(std::string_view line) {
  const Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    throw py::value_error("not a JSON record: " + std::string(line.substr(0, 80)));
  return to_python(j);
}

void bind_records(py::module_& m, ProfilerClass& profiler) {
  py::class_<RecordChannel>(m, "RecordChannel",
                            "The records a profiler writes, as dicts, followed in this process")
      .def("take", &RecordChannel::take,
           "The records written since the previous call (run_start first, where its kind is "
           "taken), as dicts, in the log's order")
      .def_property_readonly("kinds", &RecordChannel::kinds,
                             "The kinds this channel takes (empty: all)")
      .def_property_readonly("undecodable", &RecordChannel::undecodable,
                             "Lines that were not a JSON object (none expected)");

  profiler
      .def(
          "records",
          [](PyProfiler& p, std::optional<std::vector<std::string>> kinds) {
            std::vector<std::string> wanted = kinds.value_or(std::vector<std::string>{});
            return RecordChannel(p.core().record_reader(wanted), wanted);
          },
          py::arg("kinds") = py::none(),
          "A channel of the records this profiler writes from now on (and its run_start), "
          "decoded into dicts; `kinds` (e.g. [\"step\"]): only those (no other kind is queued). "
          "A channel more than 65536 records behind loses the oldest; the writer never waits "
          "for it")
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
            if (e->stack_request) return py::make_tuple("stacks", py::none());
            if (e->collectives_request) return py::make_tuple("collectives", py::none());
            return py::make_tuple("alert", record_to_python(e->json));
          },
          py::arg("timeout_ms"),
          "Next alert event as (\"alert\", record dict), (\"stacks\", None) or "
          "(\"collectives\", None), or None on timeout")
      .def(
          "write_record",
          [](PyProfiler& p, py::handle record) {
            if (PyUnicode_Check(record.ptr())) {
              const std::string text = record.cast<std::string>();  // one JSON object
              py::gil_scoped_release release;
              p.core().write_record(text);
              return;
            }
            if (!PyDict_Check(record.ptr())) {
              throw py::type_error(
                  "write_record: a record is a dict (or one JSON object as a str)");
            }
            Json value = from_python(record, "write_record", "record");
            py::gil_scoped_release release;
            detail::ProfilerAccess::write_record(p.core(), std::move(value));
          },
          py::arg("record"), "Writes a cluster/alert/resolved record (a dict) now")
      .def(
          "answer_collectives",
          [](PyProfiler& p, py::handle answer) {
            if (PyUnicode_Check(answer.ptr())) {
              p.core().answer_collectives(answer.cast<std::string>());  // JSON text
              return;
            }
            Json value;  // None: nothing to say
            if (PyDict_Check(answer.ptr())) {
              value = from_python(answer, "answer_collectives", "answer");
            } else if (!answer.is_none()) {
              throw py::type_error("answer_collectives: the answer is a dict or None");
            }
            detail::ProfilerAccess::answer_collectives(p.core(), std::move(value));
          },
          py::arg("answer"),
          "Answers a (\"collectives\", None) event: the flight recorder's state (a dict; "
          "None: nothing) for the hang alert's details.flight_recorder");
}

}  // namespace steptrace::python
