// Shared helpers of the C++ tests: temporary folders and reading a log back.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
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

}  // namespace steptrace::testing
