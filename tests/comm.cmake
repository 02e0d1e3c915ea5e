shardtensor_add_mpi_test(test_comm SOURCES test_comm.cpp RANKS 1 2 3 4 MESH2X2 TORCHRUN)

# Host staging (Note [host staging] in src/comm/transport_mpi.cpp): the suite
# again with SHARDTENSOR_STAGE_HOST=1, so that every transport buffer moves
# through a host copy, as a device buffer does: under mpirun (MPI) and launched
# the torchrun way (c10d / Gloo), on 3 ranks and on the 2x2 mesh.
if(SHARDTENSOR_WITH_MPI)
  add_test(NAME test_comm.staged.np3
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 3 $<TARGET_FILE:test_comm>)
  set_tests_properties(test_comm.staged.np3 PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_STAGE_HOST=1"
    TIMEOUT 600 PROCESSORS 2 LABELS "mpi;staged")
endif()
add_test(NAME test_comm.staged.torchrun.mesh2x2
  COMMAND ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --no-python
          --nproc-per-node 4 $<TARGET_FILE:test_comm>)
set_tests_properties(test_comm.staged.torchrun.mesh2x2 PROPERTIES
  ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TEST_MESH=2x2;SHARDTENSOR_STAGE_HOST=1"
  TIMEOUT 600 PROCESSORS 2 LABELS "torchrun;staged")
