"""Expected refusals of the OpInfo sweep (tests/python/opinfo_sweep.py), one entry per
op (`name` or `name.variant_test_name`): (group, reason). A refusal here means an
exception on every rank naming the op; a WRONG answer or an exception on some ranks
only is never listed. Groups:
  decision: shardtensor refuses this on purpose (the reason says why);
  gap: to be fixed (the issue that tracks it).
An op listed here that passes every sample is reported by the sweep as stale.
"""

EXPECTED = {
    # ---- decisions: shardtensor refuses with a message naming the op and placements ----
    'broadcast_to': ("decision", 'float64 (5, 1, 1) S(1): expand cannot change the size of the sharded dim 1 (Shard(1) on mesh dim 0, sizes [1, 0]); redistribute mesh dim 0 to Replicate first'),
    'expand': ("decision", 'float64 (5, 1, 1) S(1): expand cannot change the size of the sharded dim 1 (Shard(1) on mesh dim 0, sizes [1, 0]); redistribute mesh dim 0 to Replicate first'),
    'expand_as': ("decision", 'float64 (5, 1, 1) S(1): expand cannot change the size of the sharded dim 1 (Shard(1) on mesh dim 0, sizes [1, 0]); redistribute mesh dim 0 to Replicate first'),
    'linalg.matrix_norm': ("decision", 'complex128 (2, 3, 2) R: complex inputs are not supported by the sharded norm rule'),
    'linalg.norm': ("decision", 'complex128 (5,) R: complex inputs are not supported by the sharded norm rule'),
    'linalg.norm.subgradients_at_zero': ("decision", 'complex128 (5,) R: complex inputs are not supported by the sharded norm rule'),
    'linalg.vector_norm': ("decision", 'complex128 (3, 5) R: complex inputs are not supported by the sharded norm rule'),
    'masked.normalize': ("decision", 'complex128 (5,) R: complex inputs are not supported by the sharded norm rule'),
    'nn.functional.batch_norm': ("decision", 'float64 (5, 5, 5) S(1): batch_norm: the channel dim (dim 1) is sharded; shard the batch or spatial dims instead (statistics are per channel and the channel dim must be whole '),
    'nn.functional.cross_entropy': ("decision", 'float64 (2, 3) S(1): the class dim (dim 1) is sharded; shard the batch or spatial dims instead (the class dim must be whole on every rank)'),
    'nn.functional.group_norm': ("decision", 'float64 (1, 6, 3) S(1): group_norm: the channel dim (dim 1) is sharded; shard the batch or spatial dims instead (statistics are per channel and the channel dim must be whole '),
    'nn.functional.instance_norm': ("decision", 'float64 (5, 5, 5) S(1): instance_norm: the channel dim (dim 1) is sharded; shard the batch or spatial dims instead (statistics are per channel and the channel dim must be who'),
    'nn.functional.linear_cross_entropy.chunked': ("decision", 'float64 (3,) R: the out= tensor must be a ShardTensor when an input is one'),
    'nn.functional.linear_cross_entropy.chunked_none': ("decision", 'float64 (3,) R: the out= tensor must be a ShardTensor when an input is one'),
    'nn.functional.nll_loss': ("decision", 'float64 (2, 3) S(1): the class dim (dim 1) is sharded; shard the batch or spatial dims instead (the class dim must be whole on every rank)'),
    'nn.functional.normalize': ("decision", 'complex128 (2, 1, 4, 5) R: complex inputs are not supported by the sharded norm rule'),
    'nn.functional.pairwise_distance': ("decision", 'complex128 (3,) R: complex inputs are not supported by the sharded norm rule'),
    'nn.functional.scaled_dot_product_attention': ("decision", 'float64 (4, 3, 8) R: shardtensor::scaled_dot_product_attention: q, k and v must be 4-D ([B, H, S, D]) (q=ShardTensor(global=[4, 3, 8], placements=[Replicate()]), k=Tensor['),
    'nn.functional.triplet_margin_loss': ("decision", 'complex128 (5, 10) R: complex inputs are not supported by the sharded norm rule'),
    'nn.functional.triplet_margin_with_distance_loss': ("decision", 'complex128 (5, 10) R: complex inputs are not supported by the sharded norm rule'),
    'norm': ("decision", 'complex128 (5, 5) R: complex inputs are not supported by the sharded norm rule'),
    'norm.fro': ("decision", 'complex128 (5, 5) R: complex inputs are not supported by the sharded norm rule'),
    'norm.inf': ("decision", 'complex128 (5, 5) R: complex inputs are not supported by the sharded norm rule'),
    'rand_like': ("decision", 'complex128 (5, 5) R: random *_like needs a floating-point dtype'),
    'randn_like': ("decision", 'complex128 (5, 5) R: random *_like needs a floating-point dtype'),
    'resize_': ("decision", 'float64 (5, 5, 5) S(0): aten::resize_ resized a ShardTensor argument written in place (ShardSpec(global=[5, 5, 5], placements=[Shard(0)], mesh=[2], sizes={0: [3, 2]}) -> [25,'),
    'std': ("decision", 'complex128 (5, 5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'std.unbiased': ("decision", 'complex128 (5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'std_mean': ("decision", 'complex128 (5, 5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'std_mean.unbiased': ("decision", 'complex128 (5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'var': ("decision", 'complex128 (5, 5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'var.unbiased': ("decision", 'complex128 (5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'var_mean': ("decision", 'complex128 (5, 5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    'var_mean.unbiased': ("decision", 'complex128 (5, 5) S(0): complex inputs are supported by the var/std rule only when no reduced dim is sharded'),
    "to_sparse": ("decision", "float64 (5, 5) Shard(0): a sparse result cannot be split into pieces; "
                  "refused on every rank naming the op, placements and layout (was an internal error)"),
    # ---- gaps: refused on every rank, but by libtorch's own error on the pieces (no message
    # naming the op and placements, or an op plain torch supports): to be fixed ----
    'nn.functional.conv1d': ("gap", "complex128 (1, 3, 4) S(0): complex convolution is not supported on ShardTensors (Note [complex convolution], src/ops/conv.cpp): libtorch decomposes it into real convolutions, the sharded rule calls at::convolution, which has no complex CPU kernel"),
    'nn.functional.conv2d': ("gap", "complex128: complex convolution is not supported on ShardTensors (Note [complex convolution], src/ops/conv.cpp)"),
    'nn.functional.conv3d': ("gap", "complex128: complex convolution is not supported on ShardTensors (Note [complex convolution], src/ops/conv.cpp)"),
    'nn.functional.conv_transpose1d': ("gap", "complex128: complex convolution is not supported on ShardTensors (Note [complex convolution], src/ops/conv.cpp); a sharded channel dim is taken since Note [channel-sharded transposed convolution] (src/ops/conv_transpose.cpp)"),
    'nn.functional.conv_transpose2d': ("gap", "complex128: complex convolution is not supported on ShardTensors (Note [complex convolution], src/ops/conv.cpp); a sharded channel dim is taken since Note [channel-sharded transposed convolution] (src/ops/conv_transpose.cpp)"),
    'nn.functional.conv_transpose3d': ("gap", "complex128: complex convolution is not supported on ShardTensors (Note [complex convolution], src/ops/conv.cpp); a sharded channel dim is taken since Note [channel-sharded transposed convolution] (src/ops/conv_transpose.cpp)"),
    'nn.functional.interpolate.bilinear': ("gap", "uint8: linear/cubic interpolation of integer dtypes refused on every rank (Note [integer linear interpolation], src/ops/interpolate.cpp): the sharded uint8 results differed from torch's (found by this sweep); float samples are compared"),
    'nn.functional.interpolate.bicubic': ("gap", "uint8: linear/cubic interpolation of integer dtypes refused on every rank (Note [integer linear interpolation], src/ops/interpolate.cpp): the sharded uint8 results differed from torch's (found by this sweep); float samples are compared"),
    'nn.functional.upsample_bilinear': ("gap", "uint8: linear/cubic interpolation of integer dtypes refused on every rank (Note [integer linear interpolation], src/ops/interpolate.cpp): the sharded uint8 results differed from torch's (found by this sweep); float samples are compared"),
    'sparse.mm.reduce': ("gap", 'float64 (5, 5) R: RuntimeError: unsupported memory format option Contiguous'),
    'sparse.sampled_addmm': ("gap", 'float64 (0, 5) R: RuntimeError: unsupported memory format option Contiguous'),
}

# Bugs the sweep found that end the job when run (an exception on some ranks only:
# the carried error then makes every later call raise), keyed (op, dtype). They are
# NOT expected behaviour: the sweep skips them only so that the rest can run, prints
# each as "KNOWN BUG, not run", and runs them with --run-known-bugs. Remove an entry
# with its fix.
KNOWN_BUGS = {}
