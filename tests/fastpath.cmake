shardtensor_add_mpi_test(test_fastpath SOURCES test_fastpath.cpp RANKS 1 2 3 4 MESH2X2)
