shardtensor_add_mpi_test(test_attention SOURCES test_attention.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)
