// The JSONL log file: the run's log, the record pipeline's first sink.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "../core/record_sink.hpp"

namespace steptrace::detail {

/// The log file: appends each batch to the file descriptor it owns. A failed write loses
/// that batch, is counted, and the writer keeps going (reported in run_end).
class JsonlFileSink final : public RecordSink {
 public:
  explicit JsonlFileSink(int fd) : fd_(fd) {}
  std::string_view name() const noexcept override { return "jsonl"; }
  void write(std::string_view lines) override;
  /// fsyncs and closes the file.
  void on_close() override;
  /// Closes the descriptor without syncing (a forked child's copy).
  void abandon() noexcept override;

  std::int64_t write_errors() const noexcept override {
    return write_errors_.load(std::memory_order_relaxed);
  }
  int first_errno() const noexcept override { return first_errno_.load(std::memory_order_relaxed); }
  int last_errno() const noexcept override { return last_errno_.load(std::memory_order_relaxed); }
  std::string first_error() const override;

 private:
  int fd_;
  std::atomic<std::int64_t> write_errors_{0};
  std::atomic<int> first_errno_{0};
  std::atomic<int> last_errno_{0};
};

}  // namespace steptrace::detail
