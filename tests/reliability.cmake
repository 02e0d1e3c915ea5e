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
