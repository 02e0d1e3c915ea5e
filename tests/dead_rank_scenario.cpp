// A rank dies in the middle of a training step (Note [flight recorder] in
// comm/flight_recorder.h): a small convolutional model, its input sharded along
// the height (halo exchanges) and its parameters replicated (gradient
// all-reduces), trained with SGD. At step 2 the last rank ends itself after the
// forward pass, before backward, by abort(), SIGKILL, SIGTERM or exit(3), while
// the others go on into backward and wait for it. Run by
// tests/dead_rank_check.sh, which asserts that the job ends within the watchdog
// timeout plus a few seconds, that every survivor names the call it was in and
// the missing rank, and that the exit code is not 0.
#include <shardtensor/shardtensor.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace st = shardtensor;

int main(int argc, char** argv) {
  st::Runtime runtime(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "none";
  auto mesh = st::DeviceMesh::create({-1}, {"domain"});
  const int rank = st::world_rank();
  const int culprit = st::world_size() - 1;
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)),
                              torch::nn::ReLU(),
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 1, 3).padding(1)));
  st::distribute_module(*model, mesh);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  for (int step = 0; step < 4; ++step) {
    at::Tensor x =
        st::distribute_tensor(torch::randn({2, 2, 8 * st::world_size(), 8}), mesh, {st::Shard{2}});
    opt.zero_grad();
    at::Tensor loss = model->forward(x).pow(2).mean();
    if (step == 2 && rank == culprit && mode != "none") {
      const double now =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      std::fprintf(stderr,
                   "dead_rank_scenario: world rank %d ends itself (%s) in step %d at %.3f s\n",
                   rank, mode.c_str(), step, now);
      std::fflush(stderr);
      if (mode == "abort") std::abort();
      if (mode == "sigkill") std::raise(SIGKILL);
      if (mode == "sigterm") std::raise(SIGTERM);
      if (mode == "exit3") std::exit(3);
    }
    loss.backward();
    opt.step();
    const double value = loss.detach().item<double>();
    if (rank == 0) std::printf("step %d loss %.6f\n", step, value);
  }
  std::printf("dead_rank_scenario: world rank %d finished\n", rank);
  return 0;
}
