shardtensor_add_mpi_test(test_pool SOURCES test_pool.cpp RANKS 1 2 3 4 MESH2X2)
