shardtensor_add_mpi_test(test_views SOURCES test_views.cpp RANKS 1 2 3 4 MESH2X2)
