// Trains a small MLP with LibTorch on the CPU, profiled by steptrace.
//
//   train_mlp_cpp runs/train_mlp_cpp [steps]
//   steptrace summary runs/train_mlp_cpp
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <steptrace/steptrace.hpp>
#include <steptrace/torch.hpp>

int main(int argc, char** argv) {
  const std::string log_dir = argc > 1 ? argv[1] : "runs/train_mlp_cpp";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 300;
  torch::manual_seed(0);

  // Generated data: the label is the argmax of the first 10 features.
  const auto x = torch::randn({4096, 64});
  const auto y = std::get<1>(x.slice(1, 0, 10).max(1));
  torch::nn::Sequential model(torch::nn::Linear(64, 128), torch::nn::ReLU(),
                              torch::nn::Linear(128, 10));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  const int batch = 64;

  steptrace::Config config;
  config.log_dir = log_dir;
  config.overwrite = true;
  steptrace::Profiler prof(config, {{{"torch", TORCH_VERSION}}}, steptrace::torch_backends());
  // Interning the names once makes every phase a plain index.
  const auto forward = prof.phase_id("forward");
  const auto loss_phase = prof.phase_id("loss");
  const auto backward = prof.phase_id("backward");
  const auto clip = prof.phase_id("clip");
  const auto optimizer = prof.phase_id("optimizer");

  torch::Tensor loss;
  for (int i = 0; i < steps; ++i) {
    prof.begin_data();
    const auto offset = (i * batch) % (4096 - batch);
    const auto xb = x.slice(0, offset, offset + batch);
    const auto yb = y.slice(0, offset, offset + batch);
    prof.end_data();

    auto step = prof.step();
    torch::Tensor out;
    { auto p = step.phase(forward); out = model->forward(xb); }
    { auto p = step.phase(loss_phase); loss = torch::nn::functional::cross_entropy(out, yb); }
    { auto p = step.phase(backward); loss.backward(); }
    { auto p = step.phase(clip); torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0); }
    { auto p = step.phase(optimizer); opt.step(); opt.zero_grad(); }
  }
  const std::string path = prof.log_path();
  prof.close();

  int written = 0;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"kind\":\"step\"") != std::string::npos) ++written;
  }
  std::printf("final loss %.4f; wrote %d steps to %s\n", loss.item<float>(), written, path.c_str());
  return written == steps ? 0 : 1;
}
