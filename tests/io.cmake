shardtensor_add_mpi_test(test_io SOURCES test_io.cpp RANKS 1 2 3 4 MESH2X2)
target_compile_definitions(test_io PRIVATE SHARDTENSOR_TEST_PYTHON="${Python3_EXECUTABLE}")
# A checkpoint saved by one run at 4 ranks is loaded by other runs at 3 and 1
# ranks and on a 2x2 mesh (CheckpointAcrossRuns.*; skipped unless
# SHARDTENSOR_IO_CKPT_DIR is set).
set(_io_ckpt_env "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_IO_CKPT_DIR=${CMAKE_CURRENT_BINARY_DIR}/io_ckpt")
add_test(NAME test_io.ckpt_save.np4
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:test_io>
          --gtest_filter=CheckpointAcrossRuns.Save)
set_tests_properties(test_io.ckpt_save.np4 PROPERTIES ENVIRONMENT "${_io_ckpt_env}"
  TIMEOUT 300 PROCESSORS 2 LABELS mpi FIXTURES_SETUP io_ckpt)
foreach(np 3 1)
  add_test(NAME test_io.ckpt_load.np${np}
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np} $<TARGET_FILE:test_io>
            --gtest_filter=CheckpointAcrossRuns.Load)
  set_tests_properties(test_io.ckpt_load.np${np} PROPERTIES ENVIRONMENT "${_io_ckpt_env}"
    TIMEOUT 300 PROCESSORS 2 LABELS mpi FIXTURES_REQUIRED io_ckpt)
endforeach()
add_test(NAME test_io.ckpt_load.mesh2x2
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:test_io>
          --gtest_filter=CheckpointAcrossRuns.Load)
set_tests_properties(test_io.ckpt_load.mesh2x2 PROPERTIES
  ENVIRONMENT "${_io_ckpt_env};SHARDTENSOR_TEST_MESH=2x2"
  TIMEOUT 300 PROCESSORS 2 LABELS mpi FIXTURES_REQUIRED io_ckpt)
