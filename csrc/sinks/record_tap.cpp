#include "record_tap.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

namespace steptrace::detail {

std::string_view RecordTap::kind_of(std::string_view line, std::string& storage) {
  constexpr std::string_view kPrefix = R"({"kind":")";
  if (line.substr(0, kPrefix.size()) == kPrefix) {
    const std::size_t end = line.find('"', kPrefix.size());
    if (end != std::string_view::npos) return line.substr(kPrefix.size(), end - kPrefix.size());
  }
  // A record written from outside the core whose first member is not its kind (rare).
  const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return {};
  const auto it = j.find("kind");
  if (it == j.end() || !it->is_string()) return {};
  storage = it->get<std::string>();
  return storage;
}

bool RecordTap::Reader::takes(std::string_view kind) const {
  return kinds_.empty() || std::find(kinds_.begin(), kinds_.end(), kind) != kinds_.end();
}

void RecordTap::write(std::string_view lines) {
  std::lock_guard<std::mutex> lock(*mu_);
  if (readers_.empty() && !first_line_.empty()) return;  // nobody follows: nothing to keep
  std::string storage;
  for_each_line(lines, [&](std::string_view line) {
    if (first_line_.empty()) {
      first_line_ = std::string(line);
      return;
    }
    std::optional<std::string_view> kind;  // read once, where a reader filters
    bool expired = false;
    for (const auto& weak : readers_) {
      const std::shared_ptr<Reader> reader = weak.lock();
      if (!reader) {
        expired = true;
        continue;
      }
      if (!reader->kinds_.empty()) {
        if (!kind) kind = kind_of(line, storage);
        if (!reader->takes(*kind)) continue;  // never queued: its queue is for its kinds
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

std::shared_ptr<RecordTap::Reader> RecordTap::open(std::vector<std::string> kinds) {
  std::lock_guard<std::mutex> lock(*mu_);
  std::shared_ptr<Reader> reader(new Reader(mu_, std::move(kinds)));
  std::string storage;
  if (!first_line_.empty() && reader->takes(kind_of(first_line_, storage))) {
    reader->pending_.push_back(first_line_);
  }
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
