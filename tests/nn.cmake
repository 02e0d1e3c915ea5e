shardtensor_add_mpi_test(test_nn SOURCES test_nn.cpp RANKS 1 2 3 4 MESH2X2)
