#pragma once
/// \file A plain-libtorch U-Net, 2-D or 3-D, shared by the main job
/// (examples/unet_train.cpp), the tests and the benchmarks.
///
/// Nothing in it knows about shardtensor: it is ordinary `torch::nn` code
/// (conv, GroupNorm or BatchNorm, SiLU, max-pool down, bilinear/trilinear or
/// transposed-conv up, skip connections with `torch::cat`). Fed a ShardTensor
/// sharded along spatial dims, every op runs domain-parallel.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace models {

enum class Norm { Group, Batch, None };
enum class Up { Interpolate, Transposed };

/// Options with chained setters, libtorch style.
struct UNetOptions {
  UNetOptions(int64_t in_channels, int64_t out_channels)
      : in_channels_(in_channels), out_channels_(out_channels) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, out_channels);
  /// Channels of the first level; doubled at every level down.
  TORCH_ARG(int64_t, base_channels) = 16;
  /// Number of 2x down-samplings (levels - 1).
  TORCH_ARG(int64_t, depth) = 3;
  TORCH_ARG(Norm, norm) = Norm::Group;
  /// Groups for GroupNorm (clamped to the channel count).
  TORCH_ARG(int64_t, groups) = 4;
  TORCH_ARG(Up, up) = Up::Interpolate;
};

namespace detail {
template <int D>
struct Layers;
template <>
struct Layers<2> {
  using Conv = torch::nn::Conv2d;
  using ConvOptions = torch::nn::Conv2dOptions;
  using ConvT = torch::nn::ConvTranspose2d;
  using ConvTOptions = torch::nn::ConvTranspose2dOptions;
  using BatchNorm = torch::nn::BatchNorm2d;
  static torch::nn::functional::InterpolateFuncOptions::mode_t mode() { return torch::kBilinear; }
  static at::Tensor pool(const at::Tensor& x) { return torch::max_pool2d(x, 2, 2); }
};
template <>
struct Layers<3> {
  using Conv = torch::nn::Conv3d;
  using ConvOptions = torch::nn::Conv3dOptions;
  using ConvT = torch::nn::ConvTranspose3d;
  using ConvTOptions = torch::nn::ConvTranspose3dOptions;
  using BatchNorm = torch::nn::BatchNorm3d;
  static torch::nn::functional::InterpolateFuncOptions::mode_t mode() { return torch::kTrilinear; }
  static at::Tensor pool(const at::Tensor& x) { return torch::max_pool3d(x, 2, 2); }
};
}  // namespace detail

/// conv3 -> norm -> SiLU -> conv3 -> norm -> SiLU.
template <int D>
struct DoubleConvImpl : torch::nn::Module {
  using L = detail::Layers<D>;
  DoubleConvImpl(int64_t in, int64_t out, const UNetOptions& o) {
    const bool bias = o.norm() == Norm::None;
    conv1 = register_module(
        "conv1", typename L::Conv(typename L::ConvOptions(in, out, 3).padding(1).bias(bias)));
    conv2 = register_module(
        "conv2", typename L::Conv(typename L::ConvOptions(out, out, 3).padding(1).bias(bias)));
    norm1 = make_norm("norm1", out, o);
    norm2 = make_norm("norm2", out, o);
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::silu(apply_norm(norm1, conv1->forward(x)));
    return torch::silu(apply_norm(norm2, conv2->forward(x)));
  }

  typename L::Conv conv1{nullptr}, conv2{nullptr};
  torch::nn::AnyModule norm1, norm2;

 private:
  torch::nn::AnyModule make_norm(const std::string& name, int64_t c, const UNetOptions& o) {
    switch (o.norm()) {
      case Norm::Group: {
        int64_t g = std::min(o.groups(), c);
        while (c % g != 0) --g;
        torch::nn::GroupNorm m(torch::nn::GroupNormOptions(g, c));
        register_module(name, m);
        return torch::nn::AnyModule(m);
      }
      case Norm::Batch: {
        typename L::BatchNorm m(c);
        register_module(name, m);
        return torch::nn::AnyModule(m);
      }
      case Norm::None:
        break;
    }
    return {};
  }
  static at::Tensor apply_norm(torch::nn::AnyModule& m, const at::Tensor& x) {
    return m.is_empty() ? x : m.forward(x);
  }
};
template <int D>
struct DoubleConv : torch::nn::ModuleHolder<DoubleConvImpl<D>> {
  using torch::nn::ModuleHolder<DoubleConvImpl<D>>::ModuleHolder;
};

/// A U-Net over D spatial dims. Input [N, C_in, S_1..S_D] with every spatial
/// size divisible by 2^depth; output [N, C_out, S_1..S_D].
template <int D>
struct UNetImpl : torch::nn::Module {
  static_assert(D == 2 || D == 3, "UNet is 2-D or 3-D");
  using L = detail::Layers<D>;

  explicit UNetImpl(const UNetOptions& o) : options(o) {
    int64_t c = o.base_channels();
    enc.push_back(register_module("enc0", DoubleConv<D>(o.in_channels(), c, o)));
    for (int64_t i = 1; i <= o.depth(); ++i) {
      enc.push_back(register_module("enc" + std::to_string(i), DoubleConv<D>(c, 2 * c, o)));
      c *= 2;
    }
    for (int64_t i = o.depth() - 1; i >= 0; --i) {
      const int64_t half = c / 2;
      if (o.up() == Up::Transposed) {
        up_t.push_back(
            register_module("up" + std::to_string(i),
                            typename L::ConvT(typename L::ConvTOptions(c, half, 2).stride(2))));
      } else {
        up_c.push_back(register_module("up" + std::to_string(i),
                                       typename L::Conv(typename L::ConvOptions(c, half, 1))));
      }
      dec.push_back(register_module("dec" + std::to_string(i), DoubleConv<D>(c, half, o)));
      c = half;
    }
    head =
        register_module("head", typename L::Conv(typename L::ConvOptions(c, o.out_channels(), 1)));
  }

  at::Tensor forward(at::Tensor x) {
    std::vector<at::Tensor> skips;
    for (size_t i = 0; i < enc.size(); ++i) {
      if (i > 0) x = L::pool(x);
      x = enc[i]->forward(x);
      skips.push_back(x);
    }
    skips.pop_back();
    for (size_t i = 0; i < dec.size(); ++i) {
      x = upsample(i, x);
      x = torch::cat({skips.back(), x}, 1);
      skips.pop_back();
      x = dec[i]->forward(x);
    }
    return head->forward(x);
  }

  UNetOptions options;
  std::vector<DoubleConv<D>> enc, dec;
  /// Up-sampling: a stride-2 transposed conv, or interpolation then a 1x1 conv.
  std::vector<typename L::ConvT> up_t;
  std::vector<typename L::Conv> up_c;
  typename L::Conv head{nullptr};

 private:
  at::Tensor upsample(size_t i, const at::Tensor& x) {
    if (options.up() == Up::Transposed) {
      return up_t[i]->forward(x);
    }
    std::vector<double> scale(D, 2.0);
    auto y = torch::nn::functional::interpolate(x, torch::nn::functional::InterpolateFuncOptions()
                                                       .scale_factor(scale)
                                                       .mode(L::mode())
                                                       .align_corners(false));
    return up_c[i]->forward(y);
  }
};
using UNet2dImpl = UNetImpl<2>;
using UNet3dImpl = UNetImpl<3>;
TORCH_MODULE(UNet2d);
TORCH_MODULE(UNet3d);

}  // namespace models
