shardtensor_add_mpi_test(test_loss SOURCES test_loss.cpp RANKS 1 2 3 4 MESH2X2)
