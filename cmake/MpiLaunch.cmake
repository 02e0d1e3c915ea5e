# Note [Open MPI 4.1 and 5.0 spellings]
# How shardtensor launches and configures MPI jobs depends on the Open MPI
# version; this file is the one place that knows the spellings. Debian 12 ships
# Open MPI 4.1 (ORTE runtime), Debian 13 Open MPI 5.0 (PRRTE runtime, PMIx):
#
#   what                        Open MPI 4.1                              Open MPI 5.0
#   oversubscribe (command)     --oversubscribe                           --map-by :OVERSUBSCRIBE
#   oversubscribe (environment) OMPI_MCA_rmaps_base_oversubscribe=1       PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
#   shared-memory BTL           OMPI_MCA_btl=self,vader                   OMPI_MCA_btl=self,sm
#   no single-copy (containers) OMPI_MCA_btl_vader_single_copy_mechanism  OMPI_MCA_smsc=^cma,knem,xpmem
#                                 =none
#   run as root                 OMPI_ALLOW_RUN_AS_ROOT=1 + OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (both)
#   unbound ranks               --bind-to none (both)
#
# Sources (Open MPI 5.0 documentation and sources, read for this table):
# - "MCA parameter changes between Open MPI 4.x and 5.x" (docs/mca.rst): the Open MPI
#   parameter rmaps_base_oversubscribe is replaced by the PRRTE parameter
#   rmaps_default_mapping_policy = [<mapping>]:oversubscribe, set as PRTE_MCA_...
#   PRRTE 3.0 registers no rmaps_base_oversubscribe, so the 4.1 variable is ignored.
# - PRRTE 3.0's schizo/ompi (the mpirun of Open MPI 5.0.x) still accepts
#   --oversubscribe as a deprecated option and turns it into --map-by :OVERSUBSCRIBE,
#   silently unless schizo_ompi_warn_deprecations is set; we use the new spelling.
# - The shared-memory tuning page: "As of Open MPI version 5.0.0, the BTL has been
#   renamed sm"; vader and vader_* parameters are aliases that "will likely disappear".
# - btl_sm_single_copy_mechanism does NOT exist in 5.0: commit "btl/sm: use the
#   shared-memory single-copy framework for single-copy" removed it; single copy
#   (CMA, KNEM, XPMEM) is the smsc framework's, chosen with the `smsc` selection
#   parameter; excluding every component leaves the sm BTL's copy-in/copy-out.
#   An exclusion of a component that is not built is not an error.
# - Verified in a Debian 13.8 chroot on this project's machine (2026-11-28, Open MPI
#   5.0.7): with the TCP BTL left in, every 5.0 rank prints "btl_tcp_proc.c:266 ...
#   Unable to find reachable pairing between local and remote interfaces" (the machine
#   has ifb0/ifb1 virtual interfaces; 4.1 stays silent), so the 5.0 launch environment
#   of our own one-machine launches (make demo, bench/) also selects OMPI_MCA_btl=self,sm.
# 4.1-only workarounds are gated on the version where they are applied: the OMPIO
# fcoll/vulcan one at run time (src/core/runtime.cpp, Note [OMPIO vulcan write
# corruption]), the mpirun PMIx_server_finalize crash in tests/watchdog_check.sh.
# Other MPI libraries get no flags and no Open MPI variables.
#
# Configure mode (include()d after find_package(MPI)) sets, from MPIEXEC_EXECUTABLE:
#   SHARDTENSOR_OPEN_MPI_VERSION  major.minor ("4.1", "5.0"), or "" for another MPI;
#                                 -DSHARDTENSOR_OPEN_MPI_VERSION=5.0 skips the probe
#                                 (to inspect the 5.0 test lines on a 4.1 machine)
#   SHARDTENSOR_MPIEXEC_FLAGS     list of launcher flags (a -D value wins)
#   SHARDTENSOR_MPI_LAUNCH_ENV    list of NAME=VALUE for every launch (make, bench/)
#   SHARDTENSOR_MPI_TEST_ENV      list of NAME=VALUE for the tests (CTest ENVIRONMENT):
#                                 the launch list, root permission, oversubscription,
#                                 shared memory only
# Script mode, for the Makefile and bench/*.sh (one line of words on stdout):
#   cmake -DMPIEXEC_EXECUTABLE=mpirun -DSHARDTENSOR_MPI_PRINT=words -P cmake/MpiLaunch.cmake
#   -> version=5.0 flag=--map-by flag=:OVERSUBSCRIBE flag=--bind-to flag=none env=OMPI_MCA_smsc=^cma,knem,xpmem
#   (version=none for another MPI; nothing at all when the launcher cannot be run).

# shardtensor_open_mpi_version(<out> <mpiexec>): "major.minor" of Open MPI behind
# <mpiexec>, or "". The launcher says "mpirun (Open MPI) 5.0.7" (4.1's mpiexec:
# "(OpenRTE) 4.1.4"); if it does not, ompi_info beside it says "Open MPI v5.0.7".
function(shardtensor_open_mpi_version out mpiexec)
  set(version "")
  if(mpiexec)
    execute_process(COMMAND "${mpiexec}" --version OUTPUT_VARIABLE text ERROR_VARIABLE text
                    RESULT_VARIABLE rc TIMEOUT 30)
    if(text MATCHES "\\((Open MPI|OpenRTE)\\) ([0-9]+)\\.([0-9]+)")
      set(version "${CMAKE_MATCH_2}.${CMAKE_MATCH_3}")
    else()
      # Only beside the launcher (or its link target): an ompi_info elsewhere on PATH says
      # nothing about an MPICH mpiexec.
      get_filename_component(dir "${mpiexec}" DIRECTORY)
      get_filename_component(real "${mpiexec}" REALPATH)
      get_filename_component(real_dir "${real}" DIRECTORY)
      find_program(_st_ompi_info NAMES ompi_info PATHS "${dir}" "${real_dir}" NO_DEFAULT_PATH
                   NO_CACHE)
      if(_st_ompi_info)
        execute_process(COMMAND "${_st_ompi_info}" --version OUTPUT_VARIABLE text
                        ERROR_QUIET TIMEOUT 30)
        if(text MATCHES "Open MPI v([0-9]+)\\.([0-9]+)")
          set(version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
        endif()
      endif()
    endif()
  endif()
  set(${out} "${version}" PARENT_SCOPE)
endfunction()

# shardtensor_mpi_launch(<version>): sets _st_flags, _st_launch_env, _st_test_env
# for Open MPI <version> ("" = not Open MPI). The table of the Note above.
macro(shardtensor_mpi_launch version)
  set(_st_flags "")
  set(_st_launch_env "")
  set(_st_test_env "")
  if(NOT "${version}" STREQUAL "")
    set(_st_test_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
    if("${version}" VERSION_LESS 5.0)
      set(_st_flags --oversubscribe --bind-to none)
      set(_st_launch_env OMPI_MCA_btl_vader_single_copy_mechanism=none)
      list(APPEND _st_test_env ${_st_launch_env}
           OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader)
    else()
      set(_st_flags --map-by :OVERSUBSCRIBE --bind-to none)
      set(_st_launch_env OMPI_MCA_smsc=^cma,knem,xpmem OMPI_MCA_btl=self,sm)
      list(APPEND _st_test_env ${_st_launch_env}
           PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe)
    endif()
  endif()
endmacro()

if(CMAKE_SCRIPT_MODE_FILE)
  if(NOT DEFINED SHARDTENSOR_OPEN_MPI_VERSION)
    if(NOT MPIEXEC_EXECUTABLE)
      set(MPIEXEC_EXECUTABLE mpirun)
    endif()
    find_program(_st_mpiexec NAMES "${MPIEXEC_EXECUTABLE}" NO_CACHE)
    if(NOT _st_mpiexec)
      return()  # no launcher (yet): print nothing, the caller keeps its defaults
    endif()
    shardtensor_open_mpi_version(SHARDTENSOR_OPEN_MPI_VERSION "${_st_mpiexec}")
  endif()
  shardtensor_mpi_launch("${SHARDTENSOR_OPEN_MPI_VERSION}")
  if(SHARDTENSOR_MPI_PRINT STREQUAL "words")
    set(words "version=${SHARDTENSOR_OPEN_MPI_VERSION}")
    if(words STREQUAL "version=")
      set(words "version=none")
    endif()
    foreach(f ${_st_flags})
      string(APPEND words " flag=${f}")
    endforeach()
    foreach(e ${_st_launch_env})
      string(APPEND words " env=${e}")
    endforeach()
    execute_process(COMMAND "${CMAKE_COMMAND}" -E echo "${words}")
  else()
    message(FATAL_ERROR "cmake/MpiLaunch.cmake: script mode wants -DSHARDTENSOR_MPI_PRINT=words")
  endif()
  return()
endif()

if(NOT DEFINED SHARDTENSOR_OPEN_MPI_VERSION)
  shardtensor_open_mpi_version(SHARDTENSOR_OPEN_MPI_VERSION "${MPIEXEC_EXECUTABLE}")
endif()
shardtensor_mpi_launch("${SHARDTENSOR_OPEN_MPI_VERSION}")
if(NOT DEFINED SHARDTENSOR_MPIEXEC_FLAGS)
  set(SHARDTENSOR_MPIEXEC_FLAGS ${_st_flags})
endif()
set(SHARDTENSOR_MPI_LAUNCH_ENV ${_st_launch_env})
set(SHARDTENSOR_MPI_TEST_ENV ${_st_test_env})
if(SHARDTENSOR_OPEN_MPI_VERSION)
  set(_st_what "Open MPI ${SHARDTENSOR_OPEN_MPI_VERSION}")
else()
  set(_st_what "not Open MPI (no Open MPI flags or variables)")
endif()
string(REPLACE ";" " " _st_flags_text "${SHARDTENSOR_MPIEXEC_FLAGS}")
string(REPLACE ";" " " _st_env_text "${SHARDTENSOR_MPI_TEST_ENV}")
message(STATUS "shardtensor: ${MPIEXEC_EXECUTABLE} is ${_st_what}; launcher flags: "
               "${_st_flags_text}; test environment: ${_st_env_text}")
