// fno2d: models::FNO2d from examples/models/fno.h (the FNO of
// examples/fno_train.cpp): lifting, 4 spectral blocks (rfft2 -> mode
// corners by einsum -> irfft2, plus a 1x1 skip), projection. width =
// --base-channels, modes = min(12, H/2, W/2+1) per direction. Sharded along H
// (and W on a 2-D mesh): every spectral block is a pencil FFT with one
// all-to-all per sharded dim each way (Note [fft layout]).
#include <models/fno.h>

#include "bench.h"

namespace bench {
namespace {

Instance make_fno2d(const Problem& p) {
  TORCH_CHECK(p.shape.size() == 2, "fno2d: --shape takes H,W");
  const int64_t modes = std::min<int64_t>({12, p.shape[0] / 2, p.shape[1] / 2 + 1});
  models::FNO2d net(models::FNOOptions(p.in_channels, p.out_channels)
                        .width(p.base_channels)
                        .modes1(modes)
                        .modes2(modes)
                        .blocks(4));
  Instance in;
  in.module = net.ptr();
  in.inputs = {Input{{p.batch, p.in_channels, p.shape[0], p.shape[1]}, {2, 3}, false}};
  in.spatial_dims = 2;
  in.forward = [net](const std::vector<at::Tensor>& x) mutable { return net->forward(x[0]); };
  return in;
}

const Registrar reg(Workload{"fno2d",
                             "models::FNO2d (examples/models/fno.h): 4 spectral blocks, "
                             "base_channels wide, 12 modes",
                             {256, 256},
                             [](const Problem&) { return int64_t{1}; },
                             make_fno2d});

}  // namespace
}  // namespace bench
