// The run's default memory source: the process RSS (make_rss_source, steptrace/backend.hpp),
// where nothing else gave the run a memory source. One rule for the places that assemble a
// run's backends (the Profiler, the Python module, the LibTorch backends).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "steptrace/backend.hpp"

namespace steptrace::detail {

/// Appends the process RSS source to `sources` where they are empty and `sample_rss` is on
/// (and this platform reads RSS).
inline void add_default_rss_source(std::vector<std::unique_ptr<MemorySource>>& sources,
                                   bool sample_rss = true) {
  if (!sources.empty() || !sample_rss) return;
  if (auto rss = make_rss_source()) sources.push_back(std::move(rss));
}

}  // namespace steptrace::detail
