shardtensor_add_mpi_test(test_tensor SOURCES test_tensor.cpp RANKS 1 2 3 4 MESH2X2)
