shardtensor_add_mpi_test(test_index_ops SOURCES test_index_ops.cpp RANKS 1 2 3 4 MESH2X2 TIMEOUT 300)
