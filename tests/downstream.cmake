# downstream: install this build into a temporary prefix, build tests/downstream
# against it with find_package(ShardTensor), and run it on 2 ranks.
string(REPLACE ";" " " _downstream_mpiexec_flags "${SHARDTENSOR_MPIEXEC_FLAGS}")
# The torch package the library is built against (.../site-packages/torch): the installed
# package refers to it on purpose. It only tells the check which paths are expected; the
# downstream project itself gets no Torch path (only CMAKE_PREFIX_PATH=<install prefix>).
get_filename_component(_downstream_torch_root "${SHARDTENSOR_TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
add_test(NAME downstream
  COMMAND ${CMAKE_COMMAND}
    -DBUILD_DIR=${PROJECT_BINARY_DIR}
    -DSRC_ROOT=${PROJECT_SOURCE_DIR}
    -DSOURCE_DIR=${CMAKE_CURRENT_SOURCE_DIR}/downstream
    -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/downstream
    -DMPIEXEC=${SHARDTENSOR_MPIEXEC}
    -DMPIEXEC_FLAGS=${_downstream_mpiexec_flags}
    -DNP=2
    -DBUILD_TYPE=${CMAKE_BUILD_TYPE}
    -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
    -DLAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
    -DTORCH_ROOT=${_downstream_torch_root}
    -P ${CMAKE_CURRENT_SOURCE_DIR}/downstream/run.cmake)
# It compiles a program, so it gets the CPU budget of an MPI test and a long timeout.
set_tests_properties(downstream PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
  TIMEOUT 1200 PROCESSORS 2 LABELS "mpi;install")
