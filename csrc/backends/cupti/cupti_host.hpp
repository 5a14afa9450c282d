// Run-time loading of libcupti (never linked): reuses the copy already mapped in the
// process (torch's nvidia/cuda_cupti wheel, or the toolkit's), else searches the usual
// places. No CUPTI types here; the backend .cpp files include the CUPTI headers.
#pragma once

#include <dlfcn.h>

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail::cupti {

struct Library {
  void* handle = nullptr;  // from dlopen; never closed
  std::string path;        // the file it was loaded from
  int version = 0;         // cuptiGetVersion (12.x: 18..28, 13.x: 13xxyy)
  int built_for = 0;       // CUPTI_API_VERSION of the headers steptrace was built with
};

/// Loads libcupti once per process (later calls return the same copy; `extra_dirs` only
/// matter on the first successful call). nullptr with `why` set when none can be loaded, or
/// when the one in the process cannot be used: another major release than the headers
/// steptrace was built with, or one that dies when asked its version (CUPTI 13.2 on a
/// machine without libcuda.so.1: see probe_version in cupti_host.cpp).
const Library* load_library(const std::vector<std::string>& extra_dirs, std::string* why);

/// CUPTI's release of an API version: major * 100 + minor for 13.x and later (13xxyy), the
/// API version itself for 12.x (which numbers its releases 18..28); 0 when unknown.
int cupti_release(int api_version);

/// Why activity records of `lib` cannot be read, "" when they can. The record structs
/// (CUpti_ActivityKernel9 in 12.x, 10 in 13.0, 11 in 13.2, ...) are those of the library's
/// release, so only a library of the release the headers describe is read.
std::string activity_records_unreadable(const Library& lib);

/// The places tried, in order, after the copies already in the process: for logs.
std::vector<std::string> library_candidates(const std::vector<std::string>& extra_dirs);

/// Resolves entry points from a dlopen'ed library, remembering the first missing one.
class SymbolResolver {
 public:
  SymbolResolver(void* lib, std::string* missing) : lib_(lib), missing_(missing) {}

  template <class Fn>
  void operator()(Fn& fn, const char* name) {
    fn = reinterpret_cast<Fn>(dlsym(lib_, name));
    if (fn == nullptr && ok_) {
      *missing_ = name;
      ok_ = false;
    }
  }
  /// Every name so far was found.
  bool ok() const { return ok_; }

 private:
  void* lib_;
  std::string* missing_;
  bool ok_ = true;
};

/// Why `lib` cannot do `feature`: too old, with the first `missing` entry point.
std::string missing_symbol_reason(const Library& lib, const std::string& feature,
                                  const std::string& missing);

/// The CUDA device a counter backend samples and how it was chosen (for reasons, status).
struct Device {
  int index = 0;
  std::string how;

  std::string describe() const;
};

/// The device a counter backend samples: `requested` when >= 0, else $LOCAL_RANK when it
/// names a visible device (so that every rank on a node samples its own GPU), else the
/// device of the current CUDA context (both through a driver the process already loaded),
/// else device 0.
Device choose_device(int requested);

/// The range-profiler counter sampler (cupti_range_profiler.cpp) on `device`, through
/// `lib`; nullptr with `why` (one line) when it cannot be set up.
std::unique_ptr<CounterSampler> make_range_profiler_sampler(const Library& lib,
                                                            const Device& device, std::string* why);

}  // namespace steptrace::detail::cupti
