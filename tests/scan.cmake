shardtensor_add_mpi_test(test_scan SOURCES test_scan.cpp RANKS 1 2 3 4 MESH2X2)
