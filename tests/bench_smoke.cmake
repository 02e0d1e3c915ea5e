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

# bench_smoke.rebalance: the rebalance timing program at 2 ranks on a tiny cloud
# runs its rounds and moves rows (timings are not asserted).
if(SHARDTENSOR_BUILD_BENCH)
  add_test(NAME bench_smoke.rebalance
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 2
      $<TARGET_FILE:shardtensor_bench_rebalance> --points 600 --radius 0.2 --max-neighbors 16
      --features 8 --hidden 16 --rounds 1 --repeats 1)
  set_tests_properties(bench_smoke.rebalance PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
    TIMEOUT 300 PROCESSORS 2 LABELS "mpi;bench"
    PASS_REGULAR_EXPRESSION "round 0: rows 300 300;.*round 1: rows [0-9]+ [0-9]+;")
endif()
