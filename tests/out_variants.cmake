shardtensor_add_mpi_test(test_out_variants SOURCES test_out_variants.cpp RANKS 1 2 3 4 MESH2X2 TIMEOUT 300)
