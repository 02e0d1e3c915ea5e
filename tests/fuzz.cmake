# Randomized differential tester (tests/fuzz/): a fixed budget of random
# programs at 2, 3 and 4 ranks and on the 2x2 mesh (FUZZ_COUNT programs each,
# different seeds per rank count, at most FUZZ_SECONDS each: about 10 to 45 ms
# per program, so the four take about 70 s together on 2 cores);
# `make fuzz SECONDS=...` runs longer campaigns. Honesty limits: each run
# fails below FUZZ_MIN_COMPARED programs compared (half the budget: a loaded
# machine may hit FUZZ_SECONDS first) or above FUZZ_MAX_REFUSED_PERCENT of its
# programs refused on every rank (every reason is printed with its count).
# The draw includes integer and complex programs and Inf/NaN inputs by
# default (issue 25; FUZZ_EXTENDED=2); FUZZ_EXTENDED=1 leaves out the Inf/NaN
# inputs and FUZZ_EXTENDED=0 draws float32/float64 only, for bisecting.
# Measured on the default seeds (2026-11-29, FUZZ_EXTENDED=2): 600 programs
# compared at np2, np3, np4 and 2x2, 0 refused on every rank, 0 failed, with
# 60, 55, 57 and 59 of them non-finite in the output; a few s each here.
set(SHARDTENSOR_FUZZ_BUDGET
  "FUZZ_COUNT=600;FUZZ_SECONDS=60;SHARDTENSOR_TIMEOUT=60;FUZZ_MIN_COMPARED=300;FUZZ_MAX_REFUSED_PERCENT=10")
add_executable(test_fuzz fuzz/test_fuzz.cpp)
target_link_libraries(test_fuzz PRIVATE shardtensor_testing)
if(SHARDTENSOR_USE_PCH)
  target_precompile_headers(test_fuzz REUSE_FROM shardtensor_testing)
endif()
foreach(np 2 3 4)
  math(EXPR _fuzz_seed "${np} * 100000")
  add_test(NAME test_fuzz.np${np}
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np} $<TARGET_FILE:test_fuzz>)
  set_tests_properties(test_fuzz.np${np} PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV};FUZZ_SEED=${_fuzz_seed};${SHARDTENSOR_FUZZ_BUDGET}"
    TIMEOUT 300 PROCESSORS 2 LABELS "mpi;fuzz")
endforeach()
add_test(NAME test_fuzz.mesh2x2
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:test_fuzz>)
set_tests_properties(test_fuzz.mesh2x2 PROPERTIES
  ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TEST_MESH=2x2;FUZZ_SEED=500000;${SHARDTENSOR_FUZZ_BUDGET}"
  TIMEOUT 300 PROCESSORS 2 LABELS "mpi;fuzz")
