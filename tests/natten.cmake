shardtensor_add_mpi_test(test_natten SOURCES test_natten.cpp RANKS 1 2 3 4 MESH2X2)
