#pragma once
/// \file Umbrella header: the whole public API of shardtensor.
///
/// Layers, bottom to top (docs/architecture.md): core (runtime, errors,
/// stats), mesh, spec, comm, tensor, ops, dispatch, nn, io.

#include <shardtensor/comm/ghost.h>
#include <shardtensor/comm/primitives.h>
#include <shardtensor/core/comm.h>
#include <shardtensor/core/error.h>
#include <shardtensor/core/policy.h>
#include <shardtensor/core/runtime.h>
#include <shardtensor/core/stats.h>
#include <shardtensor/io/checkpoint.h>
#include <shardtensor/io/hdf5.h>
#include <shardtensor/mesh/device_mesh.h>
#include <shardtensor/nn/fully_shard.h>
#include <shardtensor/nn/module.h>
#include <shardtensor/ops/attention.h>
#include <shardtensor/ops/fft.h>
#include <shardtensor/ops/graph.h>
#include <shardtensor/ops/halo.h>
#include <shardtensor/ops/neighborhood_attention.h>
#include <shardtensor/ops/neighbors.h>
#include <shardtensor/ops/rebalance.h>
#include <shardtensor/spec/placement.h>
#include <shardtensor/spec/shard_spec.h>
#include <shardtensor/tensor/shard_tensor.h>
