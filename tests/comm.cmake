shardtensor_add_mpi_test(test_comm SOURCES test_comm.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)
