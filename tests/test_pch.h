#pragma once
#include <gtest/gtest.h>
#include <mpi.h>
#include <torch/torch.h>
