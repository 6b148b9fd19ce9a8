# Sets CROSSBAR_TORCH_IMPORTABLE: whether `import torch` works for the Python that CMake
# finds, so the torch backend and the Python package build by default where they can.
find_program(CROSSBAR_PYTHON_EXE NAMES python3 python)
set(CROSSBAR_TORCH_IMPORTABLE OFF)
if(CROSSBAR_PYTHON_EXE)
  execute_process(COMMAND ${CROSSBAR_PYTHON_EXE} -c "import torch"
    RESULT_VARIABLE _crossbar_torch_rc OUTPUT_QUIET ERROR_QUIET)
  if(_crossbar_torch_rc EQUAL 0)
    set(CROSSBAR_TORCH_IMPORTABLE ON)
  endif()
endif()
