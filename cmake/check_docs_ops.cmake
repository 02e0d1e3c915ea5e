# Fails when docs/ops.md differs from what shardtensor_op_coverage prints now
# (run `make docs-ops` to regenerate it). Used by the docs_ops_current test.
execute_process(COMMAND ${GENERATOR} OUTPUT_FILE ${ACTUAL} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "docs_ops_current: ${GENERATOR} failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${EXPECTED} ${ACTUAL}
                RESULT_VARIABLE differ)
if(NOT differ EQUAL 0)
  message(FATAL_ERROR "docs_ops_current: ${EXPECTED} is stale (differs from ${ACTUAL}); "
                      "run `make docs-ops` and commit it")
endif()
message(STATUS "docs_ops_current: docs/ops.md matches op_coverage()")
