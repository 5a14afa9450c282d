// The plain C-API types' common parts: the classes of steptrace.errors that their
// methods raise, and readying a type.
#include <cstring>

#include "steptrace/error.hpp"

#include "bindings.hpp"

namespace steptrace::python {

namespace {
PyObject* g_config_error = nullptr;
PyObject* g_usage_error = nullptr;
PyObject* g_base_error = nullptr;
}  // namespace

PyObject* g_usage_warning = nullptr;

void bind_errors() {
  // steptrace.errors defines the exception classes (each also a ValueError/RuntimeError).
  py::module_ errors = py::module_::import("steptrace.errors");
  g_config_error = py::object(errors.attr("ConfigError")).release().ptr();
  g_usage_error = py::object(errors.attr("UsageError")).release().ptr();
  g_base_error = py::object(errors.attr("SteptraceError")).release().ptr();
  g_usage_warning = py::object(errors.attr("UsageWarning")).release().ptr();
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
}

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

}  // namespace steptrace::python
