shardtensor_add_mpi_test(test_alias SOURCES test_alias.cpp RANKS 1 2 3 4 MESH2X2)
