# cmake -P script behind the `downstream` CTest test:
#   1. install the current build into a fresh prefix (cmake --install),
#   2. check that the installed CMake package does not point into the build or source tree
#      (paths into TORCH_ROOT, the torch package it was built against, are expected: it
#      may live in the source tree's .venv),
#   3. configure and build tests/downstream against that prefix (CMAKE_PREFIX_PATH only:
#      ShardTensorConfig.cmake finds the Torch it was built with by itself),
#   4. run it under MPI: ${MPIEXEC} ${MPIEXEC_FLAGS} -np ${NP} downstream_app.
# Inputs (-D): BUILD_DIR SOURCE_DIR SRC_ROOT WORK_DIR MPIEXEC MPIEXEC_FLAGS NP
#              BUILD_TYPE CXX_COMPILER LAUNCHER TORCH_ROOT (optional)
cmake_minimum_required(VERSION 3.18)

foreach(v BUILD_DIR SOURCE_DIR SRC_ROOT WORK_DIR MPIEXEC NP)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "downstream: -D${v}=... is required")
  endif()
endforeach()

function(run_step what)
  message(STATUS "downstream: ${what}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "downstream: ${what} failed (${rc})")
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

run_step("install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}")

# The installed package must be relocatable: no build-tree or source-tree paths.
file(GLOB_RECURSE pkg_files "${prefix}/*.cmake")
if(NOT pkg_files)
  message(FATAL_ERROR "downstream: no CMake package files installed under ${prefix}")
endif()
foreach(f ${pkg_files})
  file(READ "${f}" text)
  if(TORCH_ROOT)
    string(REPLACE "${TORCH_ROOT}" "<torch>" text "${text}")
  endif()
  foreach(bad "${BUILD_DIR}" "${SRC_ROOT}")
    string(FIND "${text}" "${bad}" pos)
    if(NOT pos EQUAL -1)
      message(FATAL_ERROR "downstream: ${f} refers to ${bad}")
    endif()
  endforeach()
endforeach()

set(configure_args -S "${SOURCE_DIR}" -B "${build}" "-DCMAKE_PREFIX_PATH=${prefix}")
if(BUILD_TYPE)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
endif()
run_step("configure" "${CMAKE_COMMAND}" ${configure_args})
run_step("build" "${CMAKE_COMMAND}" --build "${build}")

separate_arguments(flags UNIX_COMMAND "${MPIEXEC_FLAGS}")
execute_process(COMMAND ${MPIEXEC} ${flags} -np ${NP} "${build}/downstream_app"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "downstream: downstream_app failed (${rc})")
endif()
if(NOT out MATCHES "(^|\n)OK(\n|$)")
  message(FATAL_ERROR "downstream: downstream_app did not print OK")
endif()
