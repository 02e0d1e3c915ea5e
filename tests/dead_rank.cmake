# A dead rank is named (Note [flight recorder] in src/comm/flight_recorder.h):
# one of 3 ranks ends itself in the middle of a training step by abort(),
# SIGKILL, SIGTERM or exit(3); the job must end within SHARDTENSOR_TIMEOUT plus
# a few seconds with a non-zero exit code, and every survivor must name the
# call it was in and the missing rank. Under mpirun and under torchrun (c10d
# Gloo transport); docs/reliability.md says what each launcher does.
add_executable(dead_rank_scenario dead_rank_scenario.cpp)
target_link_libraries(dead_rank_scenario PRIVATE shardtensor_testing)
if(SHARDTENSOR_USE_PCH)
  target_precompile_headers(dead_rank_scenario REUSE_FROM shardtensor_testing)
endif()
foreach(how abort sigkill sigterm exit3)
  add_test(NAME dead_rank.${how}.np3
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/dead_rank_check.sh 45 mpirun 2
            ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 3
            $<TARGET_FILE:dead_rank_scenario> ${how})
  set_tests_properties(dead_rank.${how}.np3 PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=10"
    TIMEOUT 60 PROCESSORS 2 LABELS "mpi;watchdog")
  add_test(NAME dead_rank.${how}.torchrun.np3
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/dead_rank_check.sh 45 torchrun 2
            ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --no-python
            --nproc-per-node 3 $<TARGET_FILE:dead_rank_scenario> ${how})
  set_tests_properties(dead_rank.${how}.torchrun.np3 PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=10"
    TIMEOUT 60 PROCESSORS 2 LABELS "torchrun;watchdog")
endforeach()
