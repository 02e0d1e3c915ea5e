shardtensor_add_mpi_test(test_precision SOURCES test_precision.cpp RANKS 1 2 3 4 MESH2X2)
