// What comes into the core from outside it as a value (the Python bindings' entries,
// runtime/profiler_access.hpp) against the text overloads C++ callers use: the same
// validation, the same errors, the same lines; and the flight recorder's answer to a hang
// request stored as the object it is.
#include "runtime/profiler_access.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/alert.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace::detail {
namespace {

using Json = nlohmann::ordered_json;
using steptrace::testing::TempDir;

std::vector<std::string> lines_of_kind(const std::string& path, const std::string& kind) {
  std::vector<std::string> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (Json::parse(line).at("kind") == kind) out.push_back(line);
  }
  return out;
}

std::string usage_error(const std::function<void()>& write) {
  try {
    write();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ExternalRecords, AValueAndItsTextAreWrittenAsTheSameLine) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str("run");
  config.rank = 0;
  Profiler prof(config);
  const Json cluster = Json::parse(
      R"({"kind":"cluster","step":3,"rank":7,"ranks":[{"rank":1,"straggler_pct":30.77,"ok":true,"comm_ms":null}],"big":18446744073709551615,"neg":-5,"text":"é\u0001"})");
  const Json alert = Json::parse(
      R"({"kind":"alert","type":"straggler","step":4,"value":1.5,"baseline":1,"threshold":1.2,"message":"m","subject_rank":1})");
  for (const Json& record : {cluster, alert}) {
    ProfilerAccess::write_record(prof, record);
    prof.write_record(record.dump());
  }
  prof.close();
  for (const char* kind : {"cluster", "alert"}) {
    const auto lines = lines_of_kind(prof.log_path(), kind);
    ASSERT_EQ(lines.size(), 2u) << kind;
    EXPECT_EQ(lines[0], lines[1]);
  }
  const auto written = Json::parse(lines_of_kind(prof.log_path(), "cluster")[0]);
  EXPECT_EQ(written.at("rank"), 0);  // this rank's, whatever the record said
  EXPECT_EQ(written.at("big").get<std::uint64_t>(), 18446744073709551615ULL);
}

TEST(ExternalRecords, AValueAndItsTextAreRefusedWithTheSameError) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str("run");
  Profiler prof(config);
  for (const char* text : {R"({"kind":"step","step":1})", R"({"step":1})",
                           R"({"kind":"alert","step":1})", R"({"kind":"resolved","type":3})"}) {
    const std::string by_value =
        usage_error([&] { ProfilerAccess::write_record(prof, Json::parse(text)); });
    EXPECT_NE(by_value, "(no error)") << text;
    EXPECT_EQ(by_value, usage_error([&] { prof.write_record(text); })) << text;
  }
  EXPECT_NE(usage_error([&] { ProfilerAccess::write_record(prof, Json::array({1})); }),
            "(no error)");
  prof.close();
  EXPECT_TRUE(lines_of_kind(prof.log_path(), "alert").empty());
}

// The watchdog asks, the subscriber answers: what the watchdog gets back is the object
// answered (no text in between), and nothing for an answer that is not an object.
TEST(ExternalRecords, TheCollectivesAnswerIsTheObjectAnswered) {
  AlertLog log;
  log.subscribe();
  const Json state =
      Json::parse(R"({"recorder":"on","summary":"rank 1 waits in all_reduce #3","groups":[]})");
  for (const Json& answer : {state, Json("not an object"), Json()}) {
    std::future<Json> got =
        std::async(std::launch::async, [&] { return log.request_collectives(60'000); });
    const auto event = log.wait_event(60'000);  // the request, queued before the wait
    ASSERT_TRUE(event.has_value());
    EXPECT_EQ(event->kind, SubscriberEvent::kCollectivesRequest);
    log.answer_collectives(answer);
    const Json back = got.get();
    if (answer.is_object()) {
      EXPECT_EQ(back, state);
      EXPECT_EQ(back.dump(), state.dump());  // the members in their order
    } else {
      EXPECT_TRUE(back.is_null()) << back.dump();
    }
  }
}

}  // namespace
}  // namespace steptrace::detail
