// The records as the log has them, for readers in the same process (the cross-rank
// exchange and the OTLP export): they follow what the pipeline wrote without reading the
// log file back. Keeps the first line (run_start) always, and the lines written while any
// reader is open, up to kMaxLines per reader; a reader that falls further behind loses
// the oldest lines (counted in its dropped()). A reader opened for some kinds is given
// only lines of those kinds: the others never take a place in its bounded queue (a reader
// of steps is not crowded out by alerts).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "../core/record_sink.hpp"

namespace steptrace::detail {

class RecordTap final : public RecordSink {
 public:
  static constexpr std::size_t kMaxLines = 1 << 16;

  /// One reader's cursor. Any thread; reading never blocks the pipeline for long.
  class Reader {
   public:
    /// The whole lines written since the last call (the first call: run_start and what
    /// followed the reader's opening), without their newlines.
    std::vector<std::string> new_lines();
    /// Lines lost because the reader fell more than kMaxLines behind.
    std::int64_t dropped() const;

   private:
    friend class RecordTap;
    Reader(std::shared_ptr<std::mutex> mu, std::vector<std::string> kinds)
        : mu_(std::move(mu)), kinds_(std::move(kinds)) {}
    // Whether a line of this kind is queued for this reader.
    bool takes(std::string_view kind) const;
    std::shared_ptr<std::mutex> mu_;        // the tap's (a reader may outlive it)
    const std::vector<std::string> kinds_;  // empty: every kind
    std::deque<std::string> pending_;       // guarded by mu_
    std::int64_t dropped_ = 0;              // guarded by mu_
  };

  RecordTap() = default;
  RecordTap(const RecordTap&) = delete;
  RecordTap& operator=(const RecordTap&) = delete;

  std::string_view name() const noexcept override { return "tap"; }
  bool listed() const noexcept override { return false; }
  void write(std::string_view lines) override;

  /// A new reader: its first new_lines() starts with run_start (where its kind is taken).
  /// `kinds` (e.g. {"step"}): only lines of those kinds are queued for it; empty: all.
  std::shared_ptr<Reader> open(std::vector<std::string> kinds = {});

  /// The kind of a record line: read from its start where it begins {"kind":"..." (every
  /// record the core writes does), else from the parsed object (then kept in `storage`);
  /// "" where it has none or is not a JSON object.
  static std::string_view kind_of(std::string_view line, std::string& storage);

 private:
  std::shared_ptr<std::mutex> mu_ = std::make_shared<std::mutex>();
  std::string first_line_;                      // run_start; guarded by mu_
  std::vector<std::weak_ptr<Reader>> readers_;  // guarded by mu_
};

}  // namespace steptrace::detail
