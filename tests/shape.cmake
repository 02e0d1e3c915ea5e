shardtensor_add_mpi_test(test_shape SOURCES test_shape.cpp RANKS 1 2 3 4 MESH2X2)
