// The node-exporter textfile transport of the metrics: the exposition written to a *.prom
// file so that a scrape never sees half of it.
#pragma once

#include <string>
#include <string_view>

namespace steptrace::detail {

/// Writes `text` to `path` atomically: a new temporary file beside it (random name,
/// O_EXCL, no link followed), then renamed over `path`. Returns "" on success, else what
/// failed (the temporary is removed).
std::string write_textfile_atomically(const std::string& path, std::string_view text);

}  // namespace steptrace::detail
