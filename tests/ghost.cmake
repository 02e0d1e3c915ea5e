shardtensor_add_mpi_test(test_ghost SOURCES test_ghost.cpp RANKS 1 2 3 4 MESH2X2 TIMEOUT 300)
