// Precompiled header for the library's translation units: the heavy libtorch
// headers are parsed once per build instead of once per file.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <shardtensor/config.h>
#if SHARDTENSOR_WITH_MPI
#include <mpi.h>
#endif
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <algorithm>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>
