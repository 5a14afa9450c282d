// prof.data(loader): the loader's iterator as a plain C-API type, each next() timed as the
// next step's data wait, with the work of the common batches counted without Python frames.
#include <pybind11/pybind11.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "steptrace/metrics.hpp"
#include "steptrace/profiler.hpp"

#include "bindings.hpp"

namespace steptrace::python {

namespace {

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
  // steptrace.live.work.batch_counter would, without its Python frames (issue 30: ~6 us per
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

// steptrace.live.work.batch_work for the batches it reads from a tensor: (samples, tokens), -1
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

}  // namespace

void bind_data_iterator() {
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

}  // namespace steptrace::python
