// The seam between steptrace._core and modules that bring their own backends (the test
// build's steptrace._testing): a PyCapsule that owns a steptrace::Backends. The producer
// makes it with make_backends_capsule; _core.Profiler(..., backends=capsule) takes the
// Backends out (once) and hands them to steptrace::Profiler like any other caller of the
// public constructor. The core sees only the extension-point interfaces.
//
// Both modules must come from the same build: the capsule holds C++ objects, so its name
// carries the library version and _core refuses a capsule of another name.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "steptrace/profiler.hpp"

namespace steptrace::python {

inline constexpr const char* kBackendsCapsule = "steptrace.Backends/" STEPTRACE_VERSION;

/// A capsule that owns `backends` until a Profiler takes them.
inline pybind11::capsule make_backends_capsule(std::unique_ptr<Backends> backends) {
  PyObject* cap = PyCapsule_New(backends.get(), kBackendsCapsule, [](PyObject* self) {
    delete static_cast<Backends*>(PyCapsule_GetPointer(self, kBackendsCapsule));
  });
  if (cap == nullptr) throw pybind11::error_already_set();
  static_cast<void>(backends.release());  // the capsule owns them now
  return pybind11::reinterpret_steal<pybind11::capsule>(cap);
}

/// Moves the Backends out of a capsule from make_backends_capsule. TypeError for anything
/// else (a capsule of another build included), ValueError when a Profiler took them already.
inline Backends take_backends_capsule(pybind11::handle obj) {
  if (!PyCapsule_IsValid(obj.ptr(), kBackendsCapsule)) {
    throw pybind11::type_error(std::string("backends must be a capsule named \"") +
                               kBackendsCapsule + "\" (from a module of the same build), got " +
                               Py_TYPE(obj.ptr())->tp_name);
  }
  // The context marks a capsule whose backends were taken (the pointer cannot be null).
  if (PyCapsule_GetContext(obj.ptr()) != nullptr) {
    throw pybind11::value_error("these backends were already given to a Profiler");
  }
  auto* given = static_cast<Backends*>(PyCapsule_GetPointer(obj.ptr(), kBackendsCapsule));
  if (given == nullptr || PyCapsule_SetContext(obj.ptr(), obj.ptr()) != 0) {
    throw pybind11::error_already_set();
  }
  return std::move(*given);
}

}  // namespace steptrace::python
