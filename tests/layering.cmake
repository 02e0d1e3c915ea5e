# layering: the include graph obeys the layer order in cmake/layers.txt (no
# header from a higher layer, <mpi.h> and comm/transport.h only where allowed)
# and docs/architecture.md renders that order. layering_selftest feeds the
# check deliberately wrong trees and asserts that it fails on each.
# Plain system Python: the check needs nothing beyond the standard library.
set(SHARDTENSOR_CHECK_PYTHON /usr/bin/python3 CACHE FILEPATH "Python 3 for cmake/check_layers.py")
if(NOT EXISTS ${SHARDTENSOR_CHECK_PYTHON})
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_Interpreter_FOUND)
    set(SHARDTENSOR_CHECK_PYTHON ${Python3_EXECUTABLE})
  endif()
endif()
add_test(NAME layering
  COMMAND ${SHARDTENSOR_CHECK_PYTHON} ${PROJECT_SOURCE_DIR}/cmake/check_layers.py
          --root ${PROJECT_SOURCE_DIR})
add_test(NAME layering_selftest
  COMMAND ${SHARDTENSOR_CHECK_PYTHON} ${PROJECT_SOURCE_DIR}/cmake/check_layers.py --self-test)
set_tests_properties(layering layering_selftest PROPERTIES TIMEOUT 60 LABELS lint)
