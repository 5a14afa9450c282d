// A stage of the writer thread that completes step records with data arriving after
// them (device activity and counters), before the detectors and the file see them.
#pragma once

#include <string>

#include "../core/step_record.hpp"

namespace steptrace::detail {

class StepCompleter {
 public:
  virtual ~StepCompleter() = default;
  /// r reached the writer (called for every record, in order, before complete).
  virtual void arrived(StepRecord& r) = 0;
  /// False while r's data may still come: r waits, and the records after it too.
  /// `force`: complete r with what is known now.
  virtual bool complete(StepRecord& r, bool force) = 0;
  /// At close, before the last records are completed (with force).
  virtual void finish() noexcept = 0;
  /// Members for the run_end object (`"key":value`, no braces); "" for none.
  virtual std::string run_end_fields() = 0;
};

}  // namespace steptrace::detail
