shardtensor_add_mpi_test(test_double_backward SOURCES test_double_backward.cpp RANKS 1 2 3 4 MESH2X2)
