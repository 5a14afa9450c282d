// The records as the log has them, for readers in the same process (the cross-rank
// exchange and the OTLP export): they follow what the pipeline wrote without reading the
// log file back. Keeps the first line (run_start) always, and the lines written while any
// reader is open, up to kMaxLines per reader; a reader that falls further behind loses
// the oldest lines (counted in its dropped()).
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
    explicit Reader(std::shared_ptr<std::mutex> mu) : mu_(std::move(mu)) {}
    std::shared_ptr<std::mutex> mu_;   // the tap's (a reader may outlive it)
    std::deque<std::string> pending_;  // guarded by mu_
    std::int64_t dropped_ = 0;         // guarded by mu_
  };

  RecordTap() = default;
  RecordTap(const RecordTap&) = delete;
  RecordTap& operator=(const RecordTap&) = delete;

  std::string_view name() const noexcept override { return "tap"; }
  bool listed() const noexcept override { return false; }
  void write(std::string_view lines) override;

  /// A new reader: its first new_lines() starts with run_start.
  std::shared_ptr<Reader> open();

 private:
  std::shared_ptr<std::mutex> mu_ = std::make_shared<std::mutex>();
  std::string first_line_;                      // run_start; guarded by mu_
  std::vector<std::weak_ptr<Reader>> readers_;  // guarded by mu_
};

}  // namespace steptrace::detail
