// Shared helpers of the C++ tests: temporary folders and reading a log back.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "steptrace/config.hpp"

namespace steptrace::testing {

/// A fresh folder under the system temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            (std::string("steptrace-") + info->test_suite_name() + "-" + info->name() + "-" +
             std::to_string(getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str(const std::string& sub = "") const { return (path_ / sub).string(); }

 private:
  std::filesystem::path path_;
};

/// Every line of a JSONL file, parsed (a parse error fails the test).
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    records.push_back(nlohmann::json::parse(line));
  }
  return records;
}

/// The records of one kind, in file order.
inline std::vector<nlohmann::json> of_kind(const std::vector<nlohmann::json>& records,
                                           const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& r : records) {
    if (r.at("kind") == kind) out.push_back(r);
  }
  return out;
}

/// A config that writes to <tmp>/run as rank 0 of 1.
inline Config run_config(const TempDir& tmp) {
  Config c;
  c.log_dir = tmp.str("run");
  c.rank = 0;
  c.world_size = 1;
  return c;
}

/// Moves a (fake) backend into its Backends slot; the test keeps driving it by pointer.
template <typename T, typename Slot>
T* install(std::unique_ptr<T> backend, Slot& slot) {
  T* raw = backend.get();
  slot = std::move(backend);
  return raw;
}

// The ids of this process's threads, and one thread's blocked signals (/proc: SigBlk).
inline std::set<std::string> thread_ids() {
  std::set<std::string> ids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    ids.insert(entry.path().filename().string());
  }
  return ids;
}
inline unsigned long long blocked_signals(const std::string& tid) {
  std::ifstream status("/proc/self/task/" + tid + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigBlk:", 0) == 0) return std::stoull(line.substr(7), nullptr, 16);
  }
  return 0;
}
inline unsigned long long signal_bit(int sig) { return 1ULL << (sig - 1); }

/// The blocked signals of each thread started since `before` (thread_ids()), read once
/// every one of them is past glibc's thread start, where every signal is blocked: waits
/// until none has SIGSEGV blocked (steptrace's threads leave the faults unblocked), for
/// at most `limit`; a thread that never gets there is returned as it is then.
inline std::map<std::string, unsigned long long> masks_of_started_threads(
    const std::set<std::string>& before, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    std::map<std::string, unsigned long long> masks;
    bool starting = false;
    for (const std::string& tid : thread_ids()) {
      if (before.count(tid) != 0) continue;
      masks[tid] = blocked_signals(tid);
      starting = starting || (masks[tid] & signal_bit(SIGSEGV)) != 0;
    }
    if (!starting || std::chrono::steady_clock::now() > deadline) return masks;
    std::this_thread::yield();
  }
}

/// What a thread steptrace starts must block: the asynchronous signals a program's own
/// threads take (SIGTERM, SIGINT), not the faults (SIGSEGV) that faulthandler reports.
inline void expect_signals_left_to_the_program(
    const std::map<std::string, unsigned long long>& masks) {
  for (const auto& [tid, mask] : masks) {
    EXPECT_NE(mask & signal_bit(SIGTERM), 0U) << "thread " << tid;
    EXPECT_NE(mask & signal_bit(SIGINT), 0U) << "thread " << tid;
    EXPECT_EQ(mask & signal_bit(SIGSEGV), 0U) << "thread " << tid;
  }
}

}  // namespace steptrace::testing
