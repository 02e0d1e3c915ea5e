shardtensor_add_mpi_test(test_select SOURCES test_select.cpp RANKS 1 2 3 4 MESH2X2)
