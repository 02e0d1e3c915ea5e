shardtensor_add_mpi_test(test_norm SOURCES test_norm.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)
