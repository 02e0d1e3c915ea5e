shardtensor_add_mpi_test(test_reductions SOURCES test_reductions.cpp RANKS 1 2 3 4 MESH2X2)
