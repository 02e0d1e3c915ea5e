shardtensor_add_mpi_test(test_fft SOURCES test_fft.cpp RANKS 1 2 3 4 MESH2X2)
