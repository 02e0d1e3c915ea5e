shardtensor_add_mpi_test(test_unfold SOURCES test_unfold.cpp RANKS 1 2 3 4 MESH2X2)
