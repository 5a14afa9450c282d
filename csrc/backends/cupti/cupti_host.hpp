// Run-time loading of libcupti (never linked): reuses the copy already mapped in the
// process (torch's nvidia/cuda_cupti wheel, or the toolkit's), else searches the usual
// places. No CUPTI types here; the backend .cpp files include the CUPTI headers.
#pragma once

#include <string>
#include <vector>

namespace steptrace::detail::cupti {

struct Library {
  void* handle = nullptr;  // from dlopen; never closed
  std::string path;        // the file it was loaded from
  int version = 0;         // cuptiGetVersion (12.x: 18..28, 13.x: 13xxyy)
};

/// Loads libcupti once per process (later calls return the same copy; `extra_dirs` only
/// matter on the first successful call). nullptr with `why` set when none can be loaded.
const Library* load_library(const std::vector<std::string>& extra_dirs, std::string* why);

/// The places tried, in order, after the copies already in the process: for logs.
std::vector<std::string> library_candidates(const std::vector<std::string>& extra_dirs);

}  // namespace steptrace::detail::cupti
