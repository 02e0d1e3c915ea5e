shardtensor_add_mpi_test(test_conv SOURCES test_conv.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)
