shardtensor_add_mpi_test(test_linear SOURCES test_linear.cpp RANKS 1 2 3 4 MESH2X2)
