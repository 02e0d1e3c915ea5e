// conv_stack: `layers` x (Conv2d 3x3, padding 1, + ReLU), channels
// in -> base -> ... -> base -> out. The simplest halo-exchange workload.
#include "bench.h"

namespace bench {
namespace {

Instance make_conv_stack(const Problem& p) {
  TORCH_CHECK(p.shape.size() == 2, "conv_stack: --shape takes H,W");
  auto seq = std::make_shared<torch::nn::SequentialImpl>();
  int64_t c = p.in_channels;
  for (int64_t i = 0; i < p.layers; ++i) {
    const int64_t out = i + 1 == p.layers ? p.out_channels : p.base_channels;
    seq->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(c, out, 3).padding(1)));
    if (i + 1 < p.layers) seq->push_back(torch::nn::ReLU());
    c = out;
  }
  Instance in;
  in.module = seq;
  in.inputs = {Input{{p.batch, p.in_channels, p.shape[0], p.shape[1]}, {2, 3}, false}};
  in.spatial_dims = 2;
  in.forward = [seq](const std::vector<at::Tensor>& x) { return seq->forward(x[0]); };
  return in;
}

const Registrar reg(Workload{"conv_stack",
                             "layers x (Conv2d 3x3 + ReLU), base_channels wide",
                             {512, 512},
                             [](const Problem&) { return int64_t{1}; },
                             make_conv_stack});

}  // namespace
}  // namespace bench
