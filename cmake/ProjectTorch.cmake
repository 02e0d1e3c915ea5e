# Note [torch from the project's Python]
# shardtensor builds against the libtorch inside the torch *Python package* the user
# runs, never a system libtorch: the C++ library, the Python extension and the user's
# `import torch` must be one build (one ABI, one dispatcher, one PrivateUse1 owner).
# The interpreter is, in order: -DPython3_EXECUTABLE=..., $VIRTUAL_ENV/bin/python,
# the repo's .venv/bin/python (made by `make deps`), python3 on PATH. It is asked for
# torch.utils.cmake_prefix_path, which holds TorchConfig.cmake; TORCH_CXX_FLAGS from
# there carries the C++ ABI (-D_GLIBCXX_USE_CXX11_ABI=...).
# Supported: torch 2.11 - 2.14 (CI tests 2.13.0); anything else stops here with the
# version found. Where an API differs inside that range the code uses a
# TORCH_VERSION_MAJOR/MINOR guard with a Note.
set(SHARDTENSOR_TORCH_MIN 2.11)
set(SHARDTENSOR_TORCH_MAX_EXCLUSIVE 2.15)

if(NOT Python3_EXECUTABLE)
  set(_st_candidates "")
  if(DEFINED ENV{VIRTUAL_ENV})
    list(APPEND _st_candidates "$ENV{VIRTUAL_ENV}/bin/python")
  endif()
  list(APPEND _st_candidates "${PROJECT_SOURCE_DIR}/.venv/bin/python")
  find_program(_st_path_python3 NAMES python3 NO_CACHE)
  if(_st_path_python3)
    list(APPEND _st_candidates "${_st_path_python3}")
  endif()
  foreach(candidate ${_st_candidates})
    if(EXISTS "${candidate}")
      execute_process(COMMAND "${candidate}" -c "import torch"
        RESULT_VARIABLE _st_rc OUTPUT_QUIET ERROR_QUIET)
      if(_st_rc EQUAL 0)
        set(Python3_EXECUTABLE "${candidate}" CACHE FILEPATH "Python interpreter whose torch is built against")
        break()
      endif()
    endif()
  endforeach()
endif()
if(NOT Python3_EXECUTABLE)
  message(FATAL_ERROR
    "shardtensor: no Python that can `import torch` (looked at $VIRTUAL_ENV, ${PROJECT_SOURCE_DIR}/.venv "
    "and python3 on PATH). Run `make deps` (creates .venv with the pinned torch), or pass "
    "-DPython3_EXECUTABLE=/path/to/python.")
endif()

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
  OUTPUT_VARIABLE _st_torch_out RESULT_VARIABLE _st_rc ERROR_VARIABLE _st_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _st_rc EQUAL 0)
  message(FATAL_ERROR "shardtensor: ${Python3_EXECUTABLE} cannot import torch: ${_st_err}")
endif()
string(REPLACE "\n" ";" _st_torch_out "${_st_torch_out}")
list(GET _st_torch_out 0 SHARDTENSOR_TORCH_CMAKE_PREFIX)
list(GET _st_torch_out 1 SHARDTENSOR_TORCH_PY_VERSION)
string(REGEX MATCH "^[0-9]+\\.[0-9]+(\\.[0-9]+)?" _st_torch_ver "${SHARDTENSOR_TORCH_PY_VERSION}")
if(_st_torch_ver VERSION_LESS SHARDTENSOR_TORCH_MIN OR
   NOT _st_torch_ver VERSION_LESS SHARDTENSOR_TORCH_MAX_EXCLUSIVE)
  message(FATAL_ERROR
    "shardtensor: found torch ${SHARDTENSOR_TORCH_PY_VERSION} (${Python3_EXECUTABLE}); "
    "supported: torch >= ${SHARDTENSOR_TORCH_MIN} and < ${SHARDTENSOR_TORCH_MAX_EXCLUSIVE} "
    "(CI tests 2.13.0). `make deps` installs the pinned version into .venv.")
endif()
# torch 2.14's headers require C++20 (ATen.h: "#error C++20 or later compatible compiler is
# required"); 2.11-2.13 take C++17, which stays the project's standard there.
if(NOT _st_torch_ver VERSION_LESS 2.14)
  set(CMAKE_CXX_STANDARD 20)
endif()
list(PREPEND CMAKE_PREFIX_PATH "${SHARDTENSOR_TORCH_CMAKE_PREFIX}")
find_package(Torch REQUIRED CONFIG)
message(STATUS "shardtensor: torch ${SHARDTENSOR_TORCH_PY_VERSION} from ${Python3_EXECUTABLE}")
