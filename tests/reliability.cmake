# Reliability tests (issue 15). The > 2 GiB test (LargeCount.*) runs only at
# np = 2, with the label "large" so that `ctest -LE large` skips it where RAM
# is short: it needs about 6 GiB per rank at peak (see its printed peak RSS).
add_executable(test_reliability test_reliability.cpp)
target_link_libraries(test_reliability PRIVATE shardtensor_testing)
if(SHARDTENSOR_USE_PCH)
  target_precompile_headers(test_reliability REUSE_FROM shardtensor_testing)
endif()
foreach(np 1 2 3 4)
  add_test(NAME test_reliability.np${np}
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np}
            $<TARGET_FILE:test_reliability> --gtest_filter=-LargeCount.*)
  set_tests_properties(test_reliability.np${np} PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
    TIMEOUT 300 PROCESSORS 2 LABELS mpi)
endforeach()
add_test(NAME test_reliability.mesh2x2
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4
          $<TARGET_FILE:test_reliability> --gtest_filter=-LargeCount.*)
set_tests_properties(test_reliability.mesh2x2 PROPERTIES
  ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TEST_MESH=2x2" TIMEOUT 300 PROCESSORS 2 LABELS mpi)
add_test(NAME test_reliability.large.np2
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 2
          $<TARGET_FILE:test_reliability> --gtest_filter=LargeCount.*)
set_tests_properties(test_reliability.large.np2 PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
  TIMEOUT 600 PROCESSORS 2 LABELS "mpi;large")
# Note [rule errors]: a rule throws on one rank only (injected with
# SHARDTENSOR_INJECT_RULE_FAULT=op@rank@n on the last rank, or every rank).
# Every rank raises an error naming the op and the failing rank, within the
# timeout, no hang. before_comm / local_op / every_rank: nothing was stranded,
# the next sum is right everywhere (exit code 0). mid_comm: the others were
# waiting in the sum's all-reduce: the job is poisoned, finalize exits 86.
add_executable(rule_fault_scenario rule_fault_scenario.cpp)
target_link_libraries(rule_fault_scenario PRIVATE shardtensor_testing)
if(SHARDTENSOR_USE_PCH)
  target_precompile_headers(rule_fault_scenario REUSE_FROM shardtensor_testing)
endif()
foreach(scenario before_comm local_op every_rank mid_comm)
  foreach(np 2 3 4 2x2)
    if(np STREQUAL "2x2")
      set(_n 4)
      set(_mesh ";SHARDTENSOR_TEST_MESH=2x2")
    else()
      set(_n ${np})
      set(_mesh "")
    endif()
    math(EXPR _culprit "${_n} - 1")
    set(_op aten::sum)
    set(_nth 2)  # the warm-up sum is the first
    set(_who ${_culprit})
    set(_expect "0;caught: .*'aten::sum'.*world rank ${_culprit};continues: the next sum is right")
    if(scenario STREQUAL "local_op")
      set(_op aten::mul)
      set(_nth 1)
      set(_expect "0;caught: .*'aten::mul'.*world rank ${_culprit};continues: the next sum is right")
    elseif(scenario STREQUAL "every_rank")
      set(_who "*")
      set(_expect "0;caught: .*'aten::sum'.*world rank;continues: the next sum is right")
    elseif(scenario STREQUAL "mid_comm")
      set(_expect "86;caught: .*'aten::sum'.*world rank ${_culprit};raises at the next op: .*inconsistent")
    endif()
    add_test(NAME rule_errors.${scenario}.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/carried_check.sh 40 ${_n} "${_expect}"
              ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${_n}
              $<TARGET_FILE:rule_fault_scenario> ${scenario})
    set_tests_properties(rule_errors.${scenario}.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=15;SHARDTENSOR_INJECT_RULE_FAULT=${_op}@${_who}@${_nth}${_mesh}"
      TIMEOUT 60 PROCESSORS 2 LABELS "mpi;watchdog")
  endforeach()
endforeach()
