shardtensor_add_mpi_test(test_tensor SOURCES test_tensor.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)
# The whole suite again with the cross-rank agreement checks of SHARDTENSOR_DEBUG.
if(SHARDTENSOR_WITH_MPI)
add_test(NAME test_tensor.debug.np3
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 3 $<TARGET_FILE:test_tensor>)
set_tests_properties(test_tensor.debug.np3 PROPERTIES
  ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_DEBUG=1" TIMEOUT 600 PROCESSORS 2 LABELS mpi)
endif()
