#pragma once
/// \file The distributed FFT's output layout (Note [fft layout]).
///
/// `torch::fft::fft/ifft/rfft/irfft/hfft/ihfft/fft2/ifft2/rfft2/irfft2/fftn/
/// ifftn/rfftn/irfftn` on a ShardTensor reach the `aten::_fft_r2c`,
/// `aten::_fft_c2r` and `aten::_fft_c2c` rules (src/ops/fft.cpp), which
/// transform the dims that are local, make the next transformed dim local with
/// an all-to-all over the mesh dim that shards it (pencil decomposition), and
/// transform it, until every transformed dim is done. Gradients flow through
/// the same local FFTs and all-to-alls. Collective over the mesh dims that
/// shard a transformed dim; local when none does.
///
/// Note [fft layout]
/// ~~~~~~~~~~~~~~~~~
/// After the last stage, each mesh dim that sharded a transformed dim shards
/// the dim it was swapped to (the "spectral layout"): for an input `[B, C, H,
/// W]` sharded along H, `rfft2` returns `[B, C, H, W/2+1]` sharded along the
/// last dim (balanced split). The swap target of a sharded dim is, in order of
/// preference: a transformed dim already done, an untransformed dim with at
/// least as many elements as the mesh dim has coordinates, another transformed
/// dim, then any free dim (largest extent first). The inverse transforms take
/// any layout; on the spectral layout they first transform the dims that are
/// local and swap back, so `irfftn(rfftn(x))` costs one all-to-all per sharded
/// transformed dim each way (two in all), and returns the input's placements
/// (with the balanced split). With FftLayout::Input every transform swaps back
/// at the end: the result keeps the input's placements (the original split when
/// the extent is unchanged, else balanced), at the cost of a second all-to-all
/// per sharded dim (four for a round trip). A Partial placement is kept
/// (the FFT is linear). When every dim of the tensor is sharded or transformed
/// and no free dim can take a swap, the op throws on every rank.
///
/// Bytes (Note [traffic accounting]): each swap is one comm::all_to_all, which
/// sends every other coordinate the part of this rank's piece it will own.

#include <cstdint>

namespace shardtensor {

/// Where the distributed FFT leaves the sharding (Note [fft layout]).
enum class FftLayout {
  Spectral,  ///< default: the transposed layout of the last stage (fewer all-to-alls)
  Input,     ///< swap back: the result has the input's placements
};

/// Local. Sets the output layout of every following distributed FFT in this
/// process. Every rank of a mesh must use the same setting (the layout decides
/// the collectives); with SHARDTENSOR_DEBUG=1 each FFT checks it (one
/// uncounted all-reduce) and, where ranks differ, throws c10::Error on every
/// rank naming set_fft_layout and each rank's value (Note [agreed settings]).
/// Does not throw.
void set_fft_layout(FftLayout layout);

/// Local. The current setting (FftLayout::Spectral unless changed).
FftLayout fft_layout();

/// Local. RAII: sets the layout for its scope and restores the previous one.
class FftLayoutGuard {
 public:
  explicit FftLayoutGuard(FftLayout layout) : previous_(fft_layout()) { set_fft_layout(layout); }
  ~FftLayoutGuard() { set_fft_layout(previous_); }
  FftLayoutGuard(const FftLayoutGuard&) = delete;
  FftLayoutGuard& operator=(const FftLayoutGuard&) = delete;

 private:
  FftLayout previous_;
};

}  // namespace shardtensor
