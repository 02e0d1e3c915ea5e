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

# The main job's pipeline on a small grid at 4 ranks: the solver writes each
# batch to HDF5, training reads every rank's subdomain, a sharded checkpoint is
# saved; then a second run resumes from it (on a 2x2 data x domain mesh, so the
# checkpoint is read back onto another layout) and must say where it resumed.
if(TARGET unet_train)
  set(_unet_args --size 64 --steps 2 --solver-steps 10 --base-channels 4 --depth 2
                 --checkpoint example_unet_ckpt --data example_unet_data.h5 --png example_unet.png)
  add_test(NAME example.unet_train.np4
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:unet_train>
            ${_unet_args})
  add_test(NAME example.unet_train_resume.np4
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:unet_train>
            ${_unet_args} --mesh 2x2 --resume)
  set_tests_properties(example.unet_train.np4 PROPERTIES FIXTURES_SETUP unet_checkpoint)
  set_tests_properties(example.unet_train_resume.np4 PROPERTIES FIXTURES_REQUIRED unet_checkpoint
    PASS_REGULAR_EXPRESSION "resumed from example_unet_ckpt at step 2.*MATCH"
    FAIL_REGULAR_EXPRESSION "MISMATCH|MPI_ABORT|exited on signal")
  set_tests_properties(example.unet_train.np4 example.unet_train_resume.np4 PROPERTIES
    ENVIRONMENT "${SHARDTENSOR_TEST_ENV}" TIMEOUT 300 PROCESSORS 2 LABELS "mpi;example"
    FAIL_REGULAR_EXPRESSION "MISMATCH|MPI_ABORT|exited on signal")
  # The same with --fully-shard (issue 26): 2x2 saves a fully sharded checkpoint, 4x1
  # resumes from it (another data size D), and both runs' one-step check prints MATCH.
  set(_unet_fs_args --size 64 --steps 2 --solver-steps 10 --base-channels 4 --depth 2
                    --checkpoint example_unet_fs_ckpt --data example_unet_fs_data.h5
                    --png example_unet_fs.png
                    --fully-shard)
  add_test(NAME example.unet_train.fully_shard.np4
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:unet_train>
            ${_unet_fs_args} --mesh 2x2)
  add_test(NAME example.unet_train.fully_shard_resume.np4
    COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np 4 $<TARGET_FILE:unet_train>
            ${_unet_fs_args} --mesh 4x1 --resume)
  set_tests_properties(example.unet_train.fully_shard.np4 PROPERTIES
    FIXTURES_SETUP unet_fs_checkpoint
    PASS_REGULAR_EXPRESSION "bytes/rank: [0-9]+ \\(replicated: [0-9]+; ratio 0\\.5[0-9]*, 1/D = 0\\.5000\\).*\\(fully_shard\\).*MATCH")
  set_tests_properties(example.unet_train.fully_shard_resume.np4 PROPERTIES
    FIXTURES_REQUIRED unet_fs_checkpoint
    PASS_REGULAR_EXPRESSION "resumed from example_unet_fs_ckpt at step 2.*ratio 0\\.25[0-9]*, 1/D = 0\\.2500.*MATCH")
  set_tests_properties(example.unet_train.fully_shard.np4 example.unet_train.fully_shard_resume.np4
    PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}" TIMEOUT 300 PROCESSORS 2
    LABELS "mpi;example" FAIL_REGULAR_EXPRESSION "MISMATCH|MPI_ABORT|exited on signal")
endif()
