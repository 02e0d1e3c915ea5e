shardtensor_add_mpi_test(test_settings SOURCES test_settings.cpp RANKS 2 3 MESH2X2 TIMEOUT 300)

# Settings agreed at init without SHARDTENSOR_DEBUG (Note [agreed settings]):
# one launch per case, the last rank's environment differs; every rank must
# raise the same error from init() (mpirun and torchrun, 2 and 3 ranks). The
# `.agree` cases set the variable on every rank: init() succeeds.
add_executable(settings_init settings_init.cpp ${SHARDTENSOR_KEEP_LOADED})
target_link_libraries(settings_init PRIVATE shardtensor)
target_include_directories(settings_init PRIVATE ${PROJECT_SOURCE_DIR}/src)
foreach(np 2 3)
  foreach(var_value STRICT:1 HALO_NEIGHBOR:1 CONV_OVERLAP:0 FSDP_PREFETCH:0)
    string(REPLACE ":" ";" _vv ${var_value})
    list(GET _vv 0 _var)
    list(GET _vv 1 _value)
    foreach(mode disagree agree)
      set(_extra "")
      if(mode STREQUAL "agree")
        set(_extra all)
      endif()
      if(SHARDTENSOR_WITH_MPI)
        add_test(NAME settings_init.${_var}.${mode}.np${np}
          COMMAND ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np}
                  $<TARGET_FILE:settings_init> SHARDTENSOR_${_var} ${_value} ${_extra})
        set_tests_properties(settings_init.${_var}.${mode}.np${np} PROPERTIES
          ENVIRONMENT "${SHARDTENSOR_TEST_ENV}" TIMEOUT 60 PROCESSORS 2 LABELS mpi)
      endif()
      add_test(NAME settings_init.${_var}.${mode}.torchrun.np${np}
        COMMAND ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --no-python
                --nproc-per-node ${np} $<TARGET_FILE:settings_init> SHARDTENSOR_${_var} ${_value}
                ${_extra})
      set_tests_properties(settings_init.${_var}.${mode}.torchrun.np${np} PROPERTIES
        ENVIRONMENT "${SHARDTENSOR_TEST_ENV}" TIMEOUT 90 PROCESSORS 2 LABELS torchrun)
    endforeach()
  endforeach()
endforeach()
