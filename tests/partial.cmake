shardtensor_add_mpi_test(test_partial SOURCES test_partial.cpp RANKS 1 2 3 4 MESH2X2)
