#pragma once
#include <gtest/gtest.h>
#include <shardtensor/config.h>
#if SHARDTENSOR_WITH_MPI
#include <mpi.h>
#endif
#include <torch/torch.h>
