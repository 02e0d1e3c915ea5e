# The examples' own end-to-end checks, on small problems: each trains a few
# steps domain-parallel, then compares one sharded float64 Adam step with a
# single-process step (loss and every parameter) and exits non-zero on MISMATCH.
# The main job (unet_train) runs under `make demo`; these keep the other
# examples from rotting.
if(TARGET fno_train AND TARGET gnn_train)
  add_test(NAME example.fno_train.np4
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:fno_train>
            --size 32 --steps 3 --solver-steps 20 --modes 6 --png example_fno.png)
  add_test(NAME example.gnn_train.np3
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 3 $<TARGET_FILE:gnn_train>
            --nodes 2000 --check-nodes 400 --steps 3)
  set_tests_properties(example.fno_train.np4 example.gnn_train.np3 PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV}" TIMEOUT 300 PROCESSORS 2 LABELS "mpi;example"
    FAIL_REGULAR_EXPRESSION "MISMATCH")
endif()
