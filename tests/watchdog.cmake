# Watchdog tests (Note [watchdog]): a misbehaving rank must end the job within
# seconds with the watchdog's message and exit code 85, never hang. Each
# scenario runs under timeout(1) inside tests/watchdog_check.sh, with a 3 s
# watchdog timeout.
add_executable(watchdog_scenario watchdog_scenario.cpp)
target_link_libraries(watchdog_scenario PRIVATE shardtensor_testing)
if(SHARDTENSOR_USE_PCH)
  target_precompile_headers(watchdog_scenario REUSE_FROM shardtensor_testing)
endif()
set(_watchdog_expect_throw_mid_op "during op 'aten::sum'.*every rank of the communicator")
set(_watchdog_expect_skip_collective "during op 'aten::sum'")
set(_watchdog_expect_rank_exits "during op 'aten::sum'")
# (no square brackets: CMake does not split lists inside them)
set(_watchdog_expect_skip_exchange "exchange finish.*for peers .*(point-to-point)")
set(_watchdog_launcher_rank_exits "without calling \"finalize\"")
set(_watchdog_expect_backward_one_rank "during op 'distribute_module gradient buckets")
foreach(scenario throw_mid_op skip_collective rank_exits skip_exchange backward_one_rank)
  foreach(np 2 3)
    add_test(NAME watchdog.${scenario}.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/watchdog_check.sh 90
              ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np}
              $<TARGET_FILE:watchdog_scenario> ${scenario})
    set_tests_properties(watchdog.${scenario}.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=3;WATCHDOG_EXPECT=${_watchdog_expect_${scenario}};WATCHDOG_OR_LAUNCHER=${_watchdog_launcher_${scenario}}"
      TIMEOUT 120 PROCESSORS 2 LABELS "mpi;watchdog")
  endforeach()
endforeach()
