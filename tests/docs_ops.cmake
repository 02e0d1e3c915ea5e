# docs/ops.md must match what the library does: the test regenerates it with
# shardtensor_op_coverage (bench/) and compares (`make docs-ops` rewrites it).
if(TARGET shardtensor_op_coverage)
  add_test(NAME docs_ops_current
    COMMAND ${CMAKE_COMMAND} -DGENERATOR=$<TARGET_FILE:shardtensor_op_coverage>
            -DEXPECTED=${PROJECT_SOURCE_DIR}/docs/ops.md
            -DACTUAL=${CMAKE_CURRENT_BINARY_DIR}/ops.md
            -P ${PROJECT_SOURCE_DIR}/cmake/check_docs_ops.cmake)
  set_tests_properties(docs_ops_current PROPERTIES TIMEOUT 120 LABELS lint
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV}")
endif()
