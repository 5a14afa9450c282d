// The CUPTI Activity API entry points the kernel activity backend (cupti_activity.cpp)
// calls, resolved with dlsym from the loaded libcupti. Built only with the CUPTI headers
// (the entry points' types are theirs).
#pragma once

#include <cupti_activity.h>
#include <cupti_result.h>
#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "cupti_errors.hpp"

namespace steptrace::detail::cupti::activity {

// The entry points used, resolved from the loaded library.
struct Api {
  decltype(&::cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&::cuptiActivityEnable) enable = nullptr;
  decltype(&::cuptiActivityDisable) disable = nullptr;
  decltype(&::cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&::cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&::cuptiActivityGetNumDroppedRecords) dropped_records = nullptr;
  decltype(&::cuptiGetTimestamp) timestamp = nullptr;
  decltype(&::cuptiGetResultString) result_string = nullptr;  // optional
  // optional (CUPTI 12.3+): records of chosen calls only; else the whole API kinds
  decltype(&::cuptiActivityEnableRuntimeApi) enable_runtime_api = nullptr;
  decltype(&::cuptiActivityEnableDriverApi) enable_driver_api = nullptr;

  bool load(void* lib, std::string* missing) {
    bool ok = true;
    auto resolve = [&](auto& fn, const char* name) {
      using Fn = std::remove_reference_t<decltype(fn)>;
      fn = reinterpret_cast<Fn>(dlsym(lib, name));
      if (fn == nullptr && ok) {
        *missing = name;
        ok = false;
      }
    };
    auto optional = [&](auto& fn, const char* name) {
      using Fn = std::remove_reference_t<decltype(fn)>;
      fn = reinterpret_cast<Fn>(dlsym(lib, name));
    };
    resolve(register_callbacks, "cuptiActivityRegisterCallbacks");
    resolve(enable, "cuptiActivityEnable");
    resolve(disable, "cuptiActivityDisable");
    resolve(flush_all, "cuptiActivityFlushAll");
    resolve(next_record, "cuptiActivityGetNextRecord");
    resolve(dropped_records, "cuptiActivityGetNumDroppedRecords");
    resolve(timestamp, "cuptiGetTimestamp");
    optional(result_string, "cuptiGetResultString");
    optional(enable_runtime_api, "cuptiActivityEnableRuntimeApi");
    optional(enable_driver_api, "cuptiActivityEnableDriverApi");
    return ok;
  }

  std::string reason(const char* call, CUptiResult r) const {
    const char* text = nullptr;
    if (result_string == nullptr || result_string(r, &text) != CUPTI_SUCCESS) text = nullptr;
    return unavailable_reason(call, static_cast<int>(r), text != nullptr ? text : "");
  }
};

}  // namespace steptrace::detail::cupti::activity
