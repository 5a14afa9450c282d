#include "record_tap.hpp"

#include <algorithm>

namespace steptrace::detail {

void RecordTap::write(std::string_view lines) {
  std::lock_guard<std::mutex> lock(*mu_);
  if (readers_.empty() && !first_line_.empty()) return;  // nobody follows: nothing to keep
  for_each_line(lines, [&](std::string_view line) {
    if (first_line_.empty()) {
      first_line_ = std::string(line);
      return;
    }
    bool expired = false;
    for (const auto& weak : readers_) {
      const std::shared_ptr<Reader> reader = weak.lock();
      if (!reader) {
        expired = true;
        continue;
      }
      if (reader->pending_.size() == kMaxLines) {
        reader->pending_.pop_front();
        ++reader->dropped_;
      }
      reader->pending_.emplace_back(line);
    }
    if (expired) {
      readers_.erase(std::remove_if(readers_.begin(), readers_.end(),
                                    [](const std::weak_ptr<Reader>& w) { return w.expired(); }),
                     readers_.end());
    }
  });
}

std::shared_ptr<RecordTap::Reader> RecordTap::open() {
  std::lock_guard<std::mutex> lock(*mu_);
  std::shared_ptr<Reader> reader(new Reader(mu_));
  if (!first_line_.empty()) reader->pending_.push_back(first_line_);
  readers_.push_back(reader);
  return reader;
}

std::vector<std::string> RecordTap::Reader::new_lines() {
  std::lock_guard<std::mutex> lock(*mu_);
  std::vector<std::string> out(std::make_move_iterator(pending_.begin()),
                               std::make_move_iterator(pending_.end()));
  pending_.clear();
  return out;
}

std::int64_t RecordTap::Reader::dropped() const {
  std::lock_guard<std::mutex> lock(*mu_);
  return dropped_;
}

}  // namespace steptrace::detail
