# Bit-identity across transports (issue 24, Note [ordered sums]): the same
# program under mpirun (MPI) and launched the torchrun way (c10d / Gloo)
# prints the same digests of every result, at 2, 3 and 4 ranks.
add_executable(transport_identity transport_identity.cpp ${SHARDTENSOR_KEEP_LOADED})
target_link_libraries(transport_identity PRIVATE shardtensor)
target_include_directories(transport_identity PRIVATE ${PROJECT_SOURCE_DIR}/examples)
foreach(np 2 3 4)
  add_test(NAME transport_identity.np${np}
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/transport_identity.py ${np}
            $<TARGET_FILE:transport_identity> ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS})
  set_tests_properties(transport_identity.np${np} PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
    TIMEOUT 300 PROCESSORS 2 LABELS "mpi;torchrun"
    PASS_REGULAR_EXPRESSION "transport identity: PASSED")
endforeach()
# The same with every transport buffer staged through a host copy (Note [host
# staging]), against an unstaged run: staging changes no bit.
foreach(np 3 4)
  add_test(NAME transport_identity.staged.np${np}
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/transport_identity.py --staged ${np}
            $<TARGET_FILE:transport_identity> ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS})
  set_tests_properties(transport_identity.staged.np${np} PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV}" TIMEOUT 400 PROCESSORS 2 LABELS "mpi;torchrun;staged"
    PASS_REGULAR_EXPRESSION "transport identity: PASSED")
endforeach()
