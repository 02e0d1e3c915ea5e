# bench_smoke: shardtensor_bench at 2 ranks on a tiny configuration writes a
# parseable JSON array with the expected fields (timings are not asserted).
if(SHARDTENSOR_BUILD_BENCH)
  string(REPLACE ";" " " _bench_mpiexec_flags "${SHARDTENSOR_MPIEXEC_FLAGS}")
  add_test(NAME bench_smoke
    COMMAND ${CMAKE_COMMAND}
      -DBENCH=$<TARGET_FILE:shardtensor_bench>
      -DMPIEXEC=${SHARDTENSOR_MPIEXEC}
      "-DMPIEXEC_FLAGS=${_bench_mpiexec_flags}"
      -DOUT=${CMAKE_CURRENT_BINARY_DIR}/bench_smoke.json
      -P ${PROJECT_SOURCE_DIR}/bench/smoke_check.cmake)
  set_tests_properties(bench_smoke PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
    TIMEOUT 300 PROCESSORS 2 LABELS "mpi;bench")
endif()
