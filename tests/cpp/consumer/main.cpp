// A program outside the steptrace tree: profiles three steps and checks its log exists.
#include <cstdio>
#include <fstream>
#include <string>

#include <steptrace/steptrace.hpp>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  steptrace::Config config;
  config.log_dir = argv[1];
  config.overwrite = true;
  std::string path;
  {
    steptrace::Profiler prof(config);
    for (int i = 0; i < 3; ++i) {
      auto step = prof.step();
      { auto p = step.phase("forward"); }
      { auto p = step.phase("backward"); }
    }
    path = prof.log_path();
  }
  std::ifstream in(path);
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"kind\":\"step\"") != std::string::npos) ++steps;
  }
  std::printf("consumer wrote %d steps\n", steps);
  return steps == 3 ? 0 : 1;
}
