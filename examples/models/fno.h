#pragma once
// A 2-D Fourier neural operator (Li et al., 2021) written as people write it in
// plain libtorch: nothing in it knows about shardtensor. Used by
// examples/fno_train.cpp and the bench workload fno2d.
//
// Lifting (1x1 conv) -> `blocks` x [SpectralConv2d + 1x1 conv skip, GELU] ->
// projection (1x1 conv, GELU, 1x1 conv). The spectral convolution is the usual
// one: rfft2, a zero spectrum allocated like x_ft, the two low-frequency mode
// corners written by slice assignment from an einsum with complex weights,
// irfft2 back to the grid size. Run on a ShardTensor sharded along H (or H and
// W), it becomes the distributed pencil FFT (Note [fft layout]), a local einsum
// in the spectral layout, and a distributed inverse FFT.
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace models {

struct FNOOptions {
  FNOOptions(int64_t in_channels, int64_t out_channels)
      : in_channels_(in_channels), out_channels_(out_channels) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, out_channels);
  TORCH_ARG(int64_t, width) = 16;
  TORCH_ARG(int64_t, modes1) = 8;
  TORCH_ARG(int64_t, modes2) = 8;
  TORCH_ARG(int64_t, blocks) = 4;
  TORCH_ARG(int64_t, projection) = 32;
};

/// out[b, o, kx, ky] = sum_i x_ft[b, i, kx, ky] * w[i, o, kx, ky] on the lowest
/// modes1 x modes2 modes (both signs of kx); the other modes are zeroed.
/// Weights are real tensors [in, out, m1, m2, 2] viewed as complex, so that
/// Module::to(dtype) and the optimizers treat them as ordinary real parameters.
class SpectralConv2dImpl : public torch::nn::Module {
 public:
  SpectralConv2dImpl(int64_t in, int64_t out, int64_t modes1, int64_t modes2)
      : out_(out), m1_(modes1), m2_(modes2) {
    const double scale = 1.0 / static_cast<double>(in * out);
    w1_ = register_parameter("w1", scale * torch::rand({in, out, m1_, m2_, 2}));
    w2_ = register_parameter("w2", scale * torch::rand({in, out, m1_, m2_, 2}));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), H = x.size(-2), W = x.size(-1);
    TORCH_CHECK(2 * m1_ <= H && m2_ <= W / 2 + 1, "SpectralConv2d: too many modes for ", H, "x", W);
    auto x_ft = torch::fft::rfft2(x);
    auto out_ft = x_ft.new_zeros({B, out_, H, W / 2 + 1});
    auto w1 = torch::view_as_complex(w1_), w2 = torch::view_as_complex(w2_);
    out_ft.slice(2, 0, m1_).slice(3, 0, m2_).copy_(
        torch::einsum("bixy,ioxy->boxy", {x_ft.slice(2, 0, m1_).slice(3, 0, m2_), w1}));
    out_ft.slice(2, H - m1_, H)
        .slice(3, 0, m2_)
        .copy_(torch::einsum("bixy,ioxy->boxy", {x_ft.slice(2, H - m1_, H).slice(3, 0, m2_), w2}));
    return torch::fft::irfft2(out_ft, std::vector<int64_t>{H, W});
  }

 private:
  int64_t out_, m1_, m2_;
  torch::Tensor w1_, w2_;
};
TORCH_MODULE(SpectralConv2d);

class FNO2dImpl : public torch::nn::Module {
 public:
  explicit FNO2dImpl(const FNOOptions& o) {
    using torch::nn::Conv2d;
    using torch::nn::Conv2dOptions;
    lift_ = register_module("lift", Conv2d(Conv2dOptions(o.in_channels(), o.width(), 1)));
    for (int64_t i = 0; i < o.blocks(); ++i) {
      spectral_.push_back(
          register_module("spectral" + std::to_string(i),
                          SpectralConv2d(o.width(), o.width(), o.modes1(), o.modes2())));
      skip_.push_back(register_module("skip" + std::to_string(i),
                                      Conv2d(Conv2dOptions(o.width(), o.width(), 1))));
    }
    proj1_ = register_module("proj1", Conv2d(Conv2dOptions(o.width(), o.projection(), 1)));
    proj2_ = register_module("proj2", Conv2d(Conv2dOptions(o.projection(), o.out_channels(), 1)));
  }

  torch::Tensor forward(torch::Tensor x) {
    x = lift_(x);
    for (size_t i = 0; i < spectral_.size(); ++i) {
      x = spectral_[i](x) + skip_[i](x);
      if (i + 1 < spectral_.size()) x = torch::gelu(x);
    }
    return proj2_(torch::gelu(proj1_(x)));
  }

 private:
  torch::nn::Conv2d lift_{nullptr}, proj1_{nullptr}, proj2_{nullptr};
  std::vector<SpectralConv2d> spectral_;
  std::vector<torch::nn::Conv2d> skip_;
};
TORCH_MODULE(FNO2d);

}  // namespace models
