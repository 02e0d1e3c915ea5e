shardtensor_add_mpi_test(test_interpolate SOURCES test_interpolate.cpp RANKS 1 2 3 4 MESH2X2)
