shardtensor_add_mpi_test(test_dispatch_stats SOURCES test_dispatch_stats.cpp RANKS 1 2 4 MESH2X2 TIMEOUT 120)
