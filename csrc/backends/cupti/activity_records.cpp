#include "activity_records.hpp"

#include <algorithm>
#include <utility>

#include "kernel_classes.hpp"

namespace steptrace::detail::cupti {
namespace {

constexpr const char* kUnnamed = "(unnamed kernel)";

}  // namespace

KernelWork ActivityRecords::work_for(const std::string& name) {
  const KernelKind kind = classify_kernel(name);
  if (kind.cls == KernelClass::kNccl) return KernelWork::kCommunication;
  switch (kind.category) {
    case KernelCategory::kGemm:
    case KernelCategory::kConvolution:
    case KernelCategory::kAttention:
      return KernelWork::kMatmul;
    default:
      return KernelWork::kCompute;
  }
}

ActivityRecords::ActivityRecords(Options options) : options_(options) {}

void ActivityRecords::add(const ParsedRecord& record) {
  switch (record.kind) {
    case ParsedRecord::Kind::kKernel:
      add_kernel(record);
      break;
    case ParsedRecord::Kind::kExternalCorrelation:
      add_correlation(record);
      break;
    case ParsedRecord::Kind::kOther:
      ++stats_.other;
      break;
  }
}

void ActivityRecords::add_kernel(const ParsedRecord& r) {
  // CUPTI reports (0, 0) when it had no device memory to time the kernel
  if ((r.start_ns == 0 && r.end_ns == 0) || r.end_ns < r.start_ns) {
    ++stats_.untimed;
    ++lost_;
    return;
  }
  ++stats_.kernels;
  KernelRecord rec;
  rec.start_ns = static_cast<std::int64_t>(r.start_ns);
  rec.end_ns = static_cast<std::int64_t>(r.end_ns);
  rec.name_id = intern(r.name);
  // past the name table's bound the name is lost but the work still counts right
  rec.work = rec.name_id == overflow_id_ ? work_for(r.name != nullptr ? r.name : kUnnamed)
                                         : works_[rec.name_id];
  if (find_step(r.correlation_id, &rec.step)) {
    deliver(rec);
    return;
  }
  if (waiting_.size() >= options_.max_waiting_kernels) release_waiting();
  waiting_.push_back({rec, r.correlation_id});
  ++waiting_ids_[r.correlation_id];
}

void ActivityRecords::add_correlation(const ParsedRecord& r) {
  if (r.external_kind != options_.step_external_kind) {
    ++stats_.foreign;
    return;
  }
  if (r.external_id == 0) return;  // never pushed by us
  ++stats_.correlations;
  const auto step = static_cast<std::int64_t>(r.external_id - 1);
  if (auto it = waiting_ids_.find(r.correlation_id); it != waiting_ids_.end()) {
    waiting_ids_.erase(it);
    auto keep = waiting_.begin();
    for (auto& w : waiting_) {
      if (w.correlation_id == r.correlation_id) {
        w.record.step = step;
        ++stats_.late;
        deliver(w.record);
      } else {
        *keep++ = w;
      }
    }
    waiting_.erase(keep, waiting_.end());
    remember(r.correlation_id, step);  // more kernels of the same graph launch may follow
    return;
  }
  current_[r.correlation_id] = step;
  if (current_.size() >= options_.generation_capacity) rotate();
}

bool ActivityRecords::find_step(std::uint32_t correlation_id, std::int64_t* step) {
  for (auto* map : {&current_, &previous_}) {
    if (auto it = map->find(correlation_id); it != map->end()) {
      *step = it->second;
      map->erase(it);
      remember(correlation_id, *step);
      return true;
    }
  }
  for (const Recent& r : recent_) {
    if (r.step >= 0 && r.correlation_id == correlation_id) {
      *step = r.step;
      return true;
    }
  }
  return false;
}

void ActivityRecords::remember(std::uint32_t correlation_id, std::int64_t step) {
  recent_[recent_next_] = {correlation_id, step};
  recent_next_ = (recent_next_ + 1) % kRecent;
}

void ActivityRecords::end_delivery() {
  ++delivery_;
  release_waiting();
  if (delivery_ - generation_start_ >= options_.generation_deliveries) rotate();
}

void ActivityRecords::rotate() {
  stats_.correlations_expired += previous_.size();
  previous_.swap(current_);
  current_.clear();  // keeps its buckets for the next generation
  generation_start_ = delivery_;
}

void ActivityRecords::release_waiting() {
  for (const auto& w : waiting_) deliver(w.record);
  waiting_.clear();
  waiting_ids_.clear();
}

void ActivityRecords::drain() {
  release_waiting();
  stats_.correlations_expired += current_.size() + previous_.size();
  current_.clear();
  previous_.clear();
  std::fill(std::begin(recent_), std::end(recent_), Recent{});
  generation_start_ = delivery_;
}

void ActivityRecords::deliver(KernelRecord record) {
  if (ready_.size() >= options_.max_ready) {
    ++stats_.overflowed;
    ++lost_;
    return;
  }
  if (record.step >= 0) {
    ++stats_.attributed;
  } else {
    ++stats_.unattributed;
  }
  ready_.push_back(record);
}

void ActivityRecords::take(std::vector<KernelRecord>& out) {
  if (out.empty()) {
    out.swap(ready_);  // the common case: no copy, and ready_ gets out's old capacity
  } else {
    out.insert(out.end(), ready_.begin(), ready_.end());
  }
  ready_.clear();
}

std::int64_t ActivityRecords::take_lost() noexcept { return std::exchange(lost_, 0); }

const std::string& ActivityRecords::name(std::uint32_t name_id) const {
  static const std::string kNone;
  return name_id < names_.size() ? names_[name_id] : kNone;
}

std::uint32_t ActivityRecords::intern(const char* name) {
  if (name == nullptr) name = kUnnamed;
  if (auto it = by_pointer_.find(name); it != by_pointer_.end() && names_[it->second] == name) {
    return it->second;
  }
  std::uint32_t id = 0;
  std::string copy(name);
  if (auto it = by_name_.find(copy); it != by_name_.end()) {
    id = it->second;
  } else if (names_.size() >= options_.max_names) {
    if (overflow_id_ == UINT32_MAX) {
      overflow_id_ = static_cast<std::uint32_t>(names_.size());
      names_.emplace_back("(more distinct kernel names than steptrace keeps)");
      works_.push_back(KernelWork::kCompute);
    }
    return overflow_id_;  // not cached by pointer: the per-record work needs the name
  } else {
    id = static_cast<std::uint32_t>(names_.size());
    works_.push_back(work_for(copy));
    ++classifications_;
    names_.push_back(copy);
    by_name_.emplace(std::move(copy), id);
  }
  // a pointer can change (module reloaded): bound the cache instead of tracking that
  if (by_pointer_.size() >= 4 * options_.max_names) by_pointer_.clear();
  by_pointer_[name] = id;
  return id;
}

}  // namespace steptrace::detail::cupti
