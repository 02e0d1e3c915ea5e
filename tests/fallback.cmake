shardtensor_add_mpi_test(test_fallback SOURCES test_fallback.cpp RANKS 1 2 3 4 MESH2X2)
