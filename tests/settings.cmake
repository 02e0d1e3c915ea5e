shardtensor_add_mpi_test(test_settings SOURCES test_settings.cpp RANKS 2 3 MESH2X2 TIMEOUT 300)
