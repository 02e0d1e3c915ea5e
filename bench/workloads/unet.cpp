// unet2d / unet3d: models::UNet2d / UNet3d from examples/models/unet.h (the
// model of the main job), interpolation up-sampling, norm from --norm.
#include <models/unet.h>

#include "bench.h"

namespace bench {
namespace {

models::Norm parse_norm(const std::string& s) {
  if (s == "none") return models::Norm::None;
  if (s == "group") return models::Norm::Group;
  if (s == "batch") return models::Norm::Batch;
  TORCH_CHECK(false, "unet: --norm must be none, group or batch, got '", s, "'");
}

models::UNetOptions options(const Problem& p) {
  return models::UNetOptions(p.in_channels, p.out_channels)
      .base_channels(p.base_channels)
      .depth(p.depth)
      .norm(parse_norm(p.norm));
}

template <int D>
Instance make_unet(const Problem& p) {
  TORCH_CHECK(static_cast<int>(p.shape.size()) == D, "unet", D, "d: --shape takes ", D,
              " spatial sizes");
  std::vector<int64_t> shape = {p.batch, p.in_channels};
  shape.insert(shape.end(), p.shape.begin(), p.shape.end());
  Instance in;
  if constexpr (D == 2) {
    models::UNet2d net(options(p));
    in.module = net.ptr();
    in.forward = [net](const std::vector<at::Tensor>& x) mutable { return net->forward(x[0]); };
  } else {
    models::UNet3d net(options(p));
    in.module = net.ptr();
    in.forward = [net](const std::vector<at::Tensor>& x) mutable { return net->forward(x[0]); };
  }
  in.inputs = {Input{shape, {2, 3, 4}, false}};
  in.spatial_dims = D;
  return in;
}

int64_t multiple(const Problem& p) { return int64_t{1} << p.depth; }

const Registrar reg2(Workload{"unet2d",
                              "models::UNet2d (examples/models/unet.h), bilinear up",
                              {256, 256},
                              multiple,
                              make_unet<2>});
const Registrar reg3(Workload{"unet3d",
                              "models::UNet3d (examples/models/unet.h), trilinear up",
                              {32, 32, 32},
                              multiple,
                              make_unet<3>});

}  // namespace
}  // namespace bench
