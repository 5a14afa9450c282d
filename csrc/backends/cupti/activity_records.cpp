#include "activity_records.hpp"

#include <algorithm>
#include <utility>

#include "kernel_classes.hpp"
#include "steptrace/ext/device_activity.hpp"

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

ActivityRecords::ActivityRecords(Options options) : options_(options) {
  // the bitmap is a ring of whole words: a power-of-two window of at least 64 ids
  std::uint64_t window = 64;
  while (window < options_.seen_window) window <<= 1;
  options_.seen_window = window;
  seen_bits_.assign(window / 64, 0);
}

void ActivityRecords::add(const ParsedRecord& record) {
  switch (record.kind) {
    case ParsedRecord::Kind::kKernel:
      add_kernel(record);
      break;
    case ParsedRecord::Kind::kApi:
      add_api(record);
      break;
    case ParsedRecord::Kind::kOther:
      ++stats_.other;
      break;
  }
}

void ActivityRecords::add_mark(std::int64_t step, bool begin, std::int64_t t_ns) {
  ++stats_.marks;
  if (!marks_.empty() && t_ns < marks_.back().t_ns) t_ns = marks_.back().t_ns;  // keep order
  Mark m;
  m.t_ns = t_ns;
  m.step = begin ? step : -1;
  marks_.push_back(m);
  // the oldest segments go first: their kernels arrived long ago (2 marks per step)
  while (marks_.size() > options_.max_marks) marks_.pop_front();
}

std::uint64_t ActivityRecords::unwrap(std::uint32_t id) noexcept {
  if (!any_id_) {
    any_id_ = true;
    last_id_ = (std::uint64_t{1} << 32) + id;  // room below for ids a little older
    return last_id_;
  }
  // ids within 2^31 of the newest seen: CUPTI's 32-bit counter wraps after 2^32 calls
  const auto delta = static_cast<std::int32_t>(id - static_cast<std::uint32_t>(last_id_));
  const std::uint64_t wide =
      last_id_ + static_cast<std::uint64_t>(static_cast<std::int64_t>(delta));
  if (delta > 0) last_id_ = wide;
  return wide;
}

void ActivityRecords::mark_seen(std::uint64_t id) {
  const std::uint64_t window = options_.seen_window;
  if (id < seen_base_) return;  // older than the window: already treated as seen
  if (id >= seen_base_ + window) {
    // slide the window (word by word) so that it ends just past `id`
    const std::uint64_t base = (id + 1 - window + 63) & ~std::uint64_t{63};
    if (base - seen_base_ >= window) {
      std::fill(seen_bits_.begin(), seen_bits_.end(), 0);
    } else {
      for (std::uint64_t x = seen_base_; x < base; x += 64) seen_bits_[(x % window) / 64] = 0;
    }
    seen_base_ = base;
  }
  seen_bits_[(id % window) / 64] |= std::uint64_t{1} << (id % 64);
}

bool ActivityRecords::seen(std::uint64_t id) const noexcept {
  const std::uint64_t window = options_.seen_window;
  if (id < seen_base_) return true;  // forgotten: its record came long ago, or never will
  if (id >= seen_base_ + window) return false;
  return (seen_bits_[(id % window) / 64] >> (id % 64) & 1) != 0;
}

void ActivityRecords::add_api(const ParsedRecord& r) {
  ++stats_.api_records;
  const std::uint64_t id = unwrap(r.correlation_id);
  mark_seen(id);
  const auto start = static_cast<std::int64_t>(r.start_ns);
  if (marks_.empty() || start < marks_.front().t_ns) {
    ++stats_.api_before_marks;  // before the first step kept: its kernels are outside
    return;
  }
  // the segment it started in: nearly always the newest, else a binary search
  auto it = marks_.end() - 1;
  if (start < it->t_ns) {
    it = std::upper_bound(marks_.begin(), marks_.end(), start,
                          [](std::int64_t t, const Mark& m) { return t < m.t_ns; }) -
         1;
  }
  it->min_id = std::min(it->min_id, id);
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
  if (waiting_.size() >= options_.max_waiting_kernels) drain();  // bound: place them now
  waiting_.push_back({rec, unwrap(r.correlation_id), buffer_mark_, false});
}

void ActivityRecords::prepare_placement() {
  // suffix_min_[j]: the smallest launch id at or after mark j, so first(mark j) in the
  // rule above; non-decreasing in j, hence a binary search per kernel
  suffix_min_.resize(marks_.size());
  std::uint64_t m = kNoId;
  for (std::size_t j = marks_.size(); j-- > 0;) {
    m = std::min(m, marks_[j].min_id);
    suffix_min_[j] = m;
  }
}

std::int64_t ActivityRecords::place(std::uint64_t id) const {
  // the last mark whose first id is at most `id`: the segment the launch started in
  const auto it = std::upper_bound(suffix_min_.begin(), suffix_min_.end(), id);
  if (it == suffix_min_.begin()) return -1;  // before the oldest mark kept
  return marks_[static_cast<std::size_t>(it - suffix_min_.begin()) - 1].step;
}

void ActivityRecords::end_buffer(std::uint64_t done_through) {
  if (waiting_.empty()) return;
  prepare_placement();
  auto keep = waiting_.begin();
  for (Waiting& w : waiting_) {
    const bool launch_seen = seen(w.id);
    if (launch_seen || w.buffer_mark <= done_through) {
      if (!launch_seen) count_unseen_launch();
      w.record.step = place(w.id);
      deliver(w.record);
    } else {
      if (!w.counted) ++stats_.waited;
      w.counted = true;
      *keep++ = w;
    }
  }
  waiting_.erase(keep, waiting_.end());
}

void ActivityRecords::drain() {
  if (waiting_.empty()) return;
  prepare_placement();
  for (Waiting& w : waiting_) {
    if (!seen(w.id)) count_unseen_launch();
    w.record.step = place(w.id);
    deliver(w.record);
  }
  waiting_.clear();
}

void ActivityRecords::count_unseen_launch() noexcept {
  ++stats_.placed_by_neighbours;
  if (stats_.api_records == 0) ++stats_.without_launch_records;
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
