# Watchdog tests (Note [watchdog]): a misbehaving rank must end the job within
# seconds with the watchdog's message and exit code 85, never hang. Each
# scenario runs under timeout(1) inside tests/watchdog_check.sh, with a 3 s
# watchdog timeout.
add_executable(watchdog_scenario watchdog_scenario.cpp)
target_link_libraries(watchdog_scenario PRIVATE shardtensor_testing)
if(SHARDTENSOR_USE_PCH)
  target_precompile_headers(watchdog_scenario REUSE_FROM shardtensor_testing)
endif()
set(_watchdog_expect_throw_mid_op "during op 'aten::sum'.*every rank of the communicator")
set(_watchdog_expect_skip_collective "during op 'aten::sum'")
set(_watchdog_expect_rank_exits "during op 'aten::sum'")
# (no square brackets: CMake does not split lists inside them)
set(_watchdog_expect_skip_exchange "exchange finish.*for peers .*(point-to-point)")
set(_watchdog_launcher_rank_exits "without calling \"finalize\"")
set(_watchdog_expect_backward_one_rank "during op 'distribute_module gradient buckets")
set(_watchdog_expect_blocking_collective "in MPI_Barrier (stand-in for a collective H5Dwrite).*blocking collective inside another library")
foreach(scenario throw_mid_op skip_collective rank_exits skip_exchange backward_one_rank
        blocking_collective)
  set(_nps 2 3)
  set(_each "")
  set(_expect_each "")
  if(scenario STREQUAL "skip_collective")
    set(_nps 2 3 4)
  endif()
  foreach(np ${_nps})
    if(scenario STREQUAL "skip_collective")
      # The last rank skips the sum's all-reduce: every other rank must name
      # exactly it, with the call's sequence number and communicator, from the
      # wait board (Note [flight recorder]; under MPI a collective itself does
      # not tell who has not joined). The sum is ordered (Note [ordered
      # sums]): rank 0 waits in its point-to-point half, the others in the
      # all-gather, which only the board can answer: at 3 and 4 ranks the
      # output must show it. (No ';' in these patterns: ENVIRONMENT is a
      # CMake list.)
      math(EXPR _culprit "${np} - 1")
      math(EXPR _each "${np} - 1")
      set(_expect_each "^shardtensor watchdog: world rank @R waited .* during op 'aten::sum' on communicator 'mesh dim 0 ('domain') of mesh .${np}.' of size ${np} .*. its last primitive call: all_reduce_nograd call #1 on world ranks .0.*${_culprit}.. missing: world ranks .${_culprit}. (")
      if(np GREATER 2)
        set(_watchdog_expect_skip_collective
          "in all_gatherv (MPI_Iallgatherv) during op 'aten::sum'.*missing: world ranks .${_culprit}. (not in this call after a .* s grace, by the wait board: world rank ${_culprit} reported no wait")
      endif()
    endif()
    if(scenario STREQUAL "throw_mid_op")
      # The waiting rank is in the point-to-point half of an ordered sum (Note
      # [ordered sums]: then the line names the culprit, the last rank) or in
      # an MPI collective (then it cannot see who is missing).
      math(EXPR _culprit "${np} - 1")
      set(_watchdog_expect_throw_mid_op
        "during op 'aten::sum'.*\\(every rank of the communicator\\|missing: world ranks .${_culprit}.\\)")
    endif()
    add_test(NAME watchdog.${scenario}.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/watchdog_check.sh 90
              ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np}
              $<TARGET_FILE:watchdog_scenario> ${scenario})
    set_tests_properties(watchdog.${scenario}.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=3;WATCHDOG_EXPECT=${_watchdog_expect_${scenario}};WATCHDOG_OR_LAUNCHER=${_watchdog_launcher_${scenario}};WATCHDOG_EACH=${_each};WATCHDOG_EXPECT_EACH=${_expect_each}"
      TIMEOUT 120 PROCESSORS 2 LABELS "mpi;watchdog")
  endforeach()
endforeach()
# The same under torchrun (c10d transport): every wait is point-to-point, so
# the line names exactly the missing rank (Note [flight recorder]); the culprit
# is the last rank.
foreach(scenario throw_mid_op skip_exchange)
  foreach(np 2 3)
    math(EXPR _culprit "${np} - 1")
    if(scenario STREQUAL "throw_mid_op")
      set(_expect "during op 'aten::sum'.*missing: world ranks .${_culprit}.")
    else()
      set(_expect "exchange finish (c10d send/recv).*missing: world ranks .${_culprit}.")
    endif()
    add_test(NAME watchdog.${scenario}.torchrun.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/watchdog_check.sh 90
              ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --no-python
              --nproc-per-node ${np} $<TARGET_FILE:watchdog_scenario> ${scenario})
    set_tests_properties(watchdog.${scenario}.torchrun.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=3;WATCHDOG_EXPECT=${_expect};WATCHDOG_LAUNCHER=torchrun"
      TIMEOUT 120 PROCESSORS 2 LABELS "torchrun;watchdog")
  endforeach()
endforeach()
# Carried errors (Note [carried errors]): a check of the local tensor fails on
# one rank only, without SHARDTENSOR_DEBUG. Every rank raises (naming the
# primitive and the culprit's error), the next op raises everywhere, and
# finalize ends the job with exit code 86. When every rank fails alike nothing
# was started: every rank raises and the next op runs normally (exit code 0).
set(_carried_one_rank_bad_piece "86;caught: .*all_gather.*the local tensor has extent 3;raises at the next op: .*inconsistent")
set(_carried_every_rank_bad_piece "0;caught: .*all_gather.*the local tensor has extent 3;continues: the next sum is right")
foreach(scenario one_rank_bad_piece every_rank_bad_piece)
  foreach(np 2 3 4)
    add_test(NAME carried_errors.${scenario}.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/carried_check.sh 60 ${np} "${_carried_${scenario}}"
              ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np}
              $<TARGET_FILE:watchdog_scenario> ${scenario})
    set_tests_properties(carried_errors.${scenario}.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=20"
      TIMEOUT 90 PROCESSORS 2 LABELS "mpi;watchdog")
  endforeach()
endforeach()
# The same over c10d, launched by torchrun (the store carries the errors, Note
# [carried errors]). torchrun itself exits with 1 when a worker fails (here:
# every worker ends with 86 at finalize).
set(_carried_torchrun_one_rank_bad_piece "1;caught: .*all_gather.*the local tensor has extent 3;raises at the next op: .*inconsistent")
set(_carried_torchrun_every_rank_bad_piece "${_carried_every_rank_bad_piece}")
foreach(scenario one_rank_bad_piece every_rank_bad_piece)
  foreach(np 2 3)
    add_test(NAME carried_errors.${scenario}.torchrun.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/carried_check.sh 60 ${np}
              "${_carried_torchrun_${scenario}}"
              ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --no-python
              --nproc-per-node ${np} $<TARGET_FILE:watchdog_scenario> ${scenario})
    set_tests_properties(carried_errors.${scenario}.torchrun.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=20"
      TIMEOUT 90 PROCESSORS 2 LABELS "torchrun;watchdog")
  endforeach()
endforeach()
# Carried rule errors (Note [carried rule errors]): the rule of an outermost op
# raises on the last rank only, before its all-reduce (the others wait in it),
# after it (the others pass the op and meet the culprit at the next one), or
# in a rule that does not communicate, after which no rank communicates again
# (finalize finds it); or on every rank alike (the job goes on, exit code 0);
# or a backward formula raises on the last rank (rule_backward).
# A hang is killed by carried_check.sh and fails.
foreach(np 2 3 4)
  math(EXPR _c "${np} - 1")
  set(_rule_before "caught: .*simulated rule failure on world rank ${_c};raises at the next op: .*inconsistent")
  set(_rule_after "1@caught: .*simulated rule failure on world rank ${_c};raises at the next op: .*simulated rule failure on world rank ${_c}")
  set(_rule_local_last "1@caught: .*simulated rule failure on world rank ${_c};1@ends the job with exit code 86")
  set(_rule_alike "caught: .*simulated rule failure;continues: the next sum is right")
  set(_rule_backward "caught: .*simulated rule failure on world rank ${_c};raises at the next op: .*inconsistent")
  foreach(scenario rule_before rule_after rule_local_last rule_alike rule_backward)
    if(scenario STREQUAL "rule_alike")
      set(_rc_mpi 0)
      set(_rc_torchrun 0)
    else()
      set(_rc_mpi 86)
      set(_rc_torchrun 1)
    endif()
    add_test(NAME carried_errors.${scenario}.np${np}
      COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/carried_check.sh 60 ${np} "${_rc_mpi};${_${scenario}}"
              ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS} -np ${np}
              $<TARGET_FILE:watchdog_scenario> ${scenario})
    set_tests_properties(carried_errors.${scenario}.np${np} PROPERTIES
      ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=20"
      TIMEOUT 90 PROCESSORS 2 LABELS "mpi;watchdog")
    if(np LESS 4)
      add_test(NAME carried_errors.${scenario}.torchrun.np${np}
        COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/carried_check.sh 60 ${np}
                "${_rc_torchrun};${_${scenario}}"
                ${Python3_EXECUTABLE} -m torch.distributed.run --standalone --no-python
                --nproc-per-node ${np} $<TARGET_FILE:watchdog_scenario> ${scenario})
      set_tests_properties(carried_errors.${scenario}.torchrun.np${np} PROPERTIES
        ENVIRONMENT "${SHARDTENSOR_TEST_ENV};SHARDTENSOR_TIMEOUT=20"
        TIMEOUT 90 PROCESSORS 2 LABELS "torchrun;watchdog")
    endif()
  endforeach()
endforeach()
