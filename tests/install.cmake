# install.pip: `pip install --no-build-isolation .` into a fresh virtual environment made
# from the project's base interpreter, holding only the torch this build uses and the
# pinned build tools; then examples/python/conv_example.py on 4 ranks from that install,
# and the import-time torch version check (tests/install_check.sh says each step).
# Slow cold (a Release build of the library at -j2 in tests/install/build); ccache makes
# reruns fast. Needs the Python package (SHARDTENSOR_BUILD_PYTHON) and bash.
find_program(SHARDTENSOR_BASH bash)
if(SHARDTENSOR_BUILD_PYTHON AND SHARDTENSOR_BASH)
  add_test(NAME install.pip
    COMMAND ${SHARDTENSOR_BASH} ${CMAKE_CURRENT_SOURCE_DIR}/install_check.sh
            ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/install
            ${Python3_EXECUTABLE} ${SHARDTENSOR_TORCH_PY_VERSION}
            ${SHARDTENSOR_MPIEXEC} ${SHARDTENSOR_MPIEXEC_FLAGS})
  set_tests_properties(install.pip PROPERTIES ENVIRONMENT "${SHARDTENSOR_TEST_ENV}"
    TIMEOUT 1800 PROCESSORS 2 LABELS "install;python")
endif()
