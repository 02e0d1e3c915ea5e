# Launcher detection (issue 24, Note [launcher detection]): unit tests over
# synthetic environments; a C++ program started the way torchrun starts its
# workers (plain processes, torch's variables, no mpirun) must run as one job
# over the c10d transport (Note [c10d handles]); torchrun itself must print
# exactly what mpirun prints for the conv tutorial; under mpirun, init exports
# torch's variables so torch.distributed's Gloo group works beside it.
add_executable(test_launch test_launch.cpp ${SHARDTENSOR_KEEP_LOADED})
target_link_libraries(test_launch PRIVATE shardtensor GTest::gtest)
add_test(NAME launch.detect COMMAND $<TARGET_FILE:test_launch>)
set_tests_properties(launch.detect PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
  TIMEOUT 60 LABELS core)

set(_st_launch_py_env ${SHARDTENSOR_TEST_ENV} PYTHONPATH=${PROJECT_BINARY_DIR}/python
  PYTHONDONTWRITEBYTECODE=1)
foreach(np 2 3 4)
  add_test(NAME launch.torchrun_cpp.np${np}
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/launch_check.py ${np} --plain
            $<TARGET_FILE:test_launch> --init)
  set_tests_properties(launch.torchrun_cpp.np${np} PROPERTIES
    ENVIRONMENT "${_st_launch_py_env}" TIMEOUT 300 PROCESSORS 2 LABELS "core;torchrun"
    PASS_REGULAR_EXPRESSION "launch check: PASSED")
endforeach()
add_test(NAME launch.torchrun_conv_example.np4
  COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/launch_check.py 4 --torchrun
          ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} --
          ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/examples/python/conv_example.py)
set_tests_properties(launch.torchrun_conv_example.np4 PROPERTIES
  ENVIRONMENT "${_st_launch_py_env};SHARDTENSOR_CONV_SIZE=256" TIMEOUT 600 PROCESSORS 2
  LABELS "python;torchrun" PASS_REGULAR_EXPRESSION "launch check: PASSED")
add_test(NAME launch.mpirun_gloo.np3
  COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 3
          ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/python/launch_gloo_check.py)
set_tests_properties(launch.mpirun_gloo.np3 PROPERTIES ENVIRONMENT "${_st_launch_py_env}"
  TIMEOUT 120 PROCESSORS 2 LABELS "mpi;python"
  PASS_REGULAR_EXPRESSION "gloo check: PASSED.*gloo check: PASSED.*gloo check: PASSED"
  FAIL_REGULAR_EXPRESSION "FAILED|Traceback|MPI_ABORT|exited on signal")
# Parallel HDF5 under torchrun: a clear error on every rank, and the job goes on.
add_test(NAME launch.torchrun_io.np3
  COMMAND ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --nproc-per-node 3
          ${CMAKE_CURRENT_SOURCE_DIR}/python/torchrun_io_check.py)
set_tests_properties(launch.torchrun_io.np3 PROPERTIES ENVIRONMENT "${_st_launch_py_env}"
  TIMEOUT 300 PROCESSORS 2 LABELS "python;torchrun"
  PASS_REGULAR_EXPRESSION "rank 0: io check: PASSED.*" FAIL_REGULAR_EXPRESSION "io check: FAILED|Traceback")
