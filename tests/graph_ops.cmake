shardtensor_add_mpi_test(test_graph_ops SOURCES test_graph_ops.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN TIMEOUT 300)
