# Core and mesh layers: runtime, MPI errors, DeviceMesh, observability.
shardtensor_add_mpi_test(test_core SOURCES test_core.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)

# The host application owns MPI (MPI_Init/MPI_Finalize in its own main) and
# shardtensor adopts it: a separate executable without the shared MPI main.
add_executable(test_adopt test_adopt.cpp ${SHARDTENSOR_KEEP_LOADED})
target_link_libraries(test_adopt PRIVATE shardtensor GTest::gtest)
add_test(NAME test_adopt.np2
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 2 $<TARGET_FILE:test_adopt>)
set_tests_properties(test_adopt.np2 PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
  TIMEOUT 120 PROCESSORS 2 LABELS mpi)
