# 1,000 training steps at 2 and 4 ranks and on the 2x2 mesh: nothing grows (issue 15).
shardtensor_add_mpi_test(test_longrun SOURCES test_longrun.cpp RANKS 2 4 MESH2X2)
