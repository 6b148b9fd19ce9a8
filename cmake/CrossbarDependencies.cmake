# Third-party dependencies: Debian packages, plus CUDA/NCCL from /usr/local/cuda.
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
# UCX: the system's (pkg-config; Debian 12: 1.13) unless CROSSBAR_UCX_ROOT names another
# install prefix with a CMake package (lib/cmake/ucx), e.g. the libucx-cu13 wheel's
# site-packages/libucx (UCX 1.22; scripts/setup.sh with CROSSBAR_UCX=pypi). Either way the
# layers link PkgConfig::UCX. The wheel's .pc files name its build machine's prefix, so
# its CMake package (relocatable) is used instead.
set(CROSSBAR_UCX_ROOT "" CACHE PATH "UCX install prefix to build against instead of the system's (empty: pkg-config ucx)")
if(CROSSBAR_UCX_ROOT)
  unset(ucx_DIR CACHE)  # found again under the current root, not a previous one
  find_package(ucx CONFIG REQUIRED PATHS "${CROSSBAR_UCX_ROOT}" NO_DEFAULT_PATH)
  add_library(PkgConfig::UCX INTERFACE IMPORTED)
  target_link_libraries(PkgConfig::UCX INTERFACE ucx::ucp ucx::uct ucx::ucs)
  # Libraries and binaries get the wheel's lib/ in their RPATH (CMAKE_INSTALL_RPATH_USE_LINK_PATH:
  # it is outside the system's paths).
  message(STATUS "crossbar: UCX ${ucx_VERSION} from ${CROSSBAR_UCX_ROOT}")
else()
  pkg_check_modules(UCX REQUIRED IMPORTED_TARGET ucx)
endif()

# CUDA: AUTO turns on when nvcc is found. The build links libcudart only (never
# libcuda) so it loads on machines without a driver.
set(CROSSBAR_HAVE_CUDA OFF)
if(NOT CROSSBAR_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc's C++20 flag; CUDA targets inherit CXX_STANDARD 20.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    find_package(CUDAToolkit REQUIRED)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    if(NCCL_LIBRARY AND NCCL_INCLUDE_DIR)
      set(CROSSBAR_HAVE_CUDA ON)
      add_library(crossbar_nccl INTERFACE)
      target_include_directories(crossbar_nccl INTERFACE ${NCCL_INCLUDE_DIR})
      target_link_libraries(crossbar_nccl INTERFACE ${NCCL_LIBRARY})
    elseif(CROSSBAR_WITH_CUDA STREQUAL "ON")
      message(FATAL_ERROR "CROSSBAR_WITH_CUDA=ON but NCCL was not found (looked in /usr/local/cuda)")
    endif()
  elseif(CROSSBAR_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "CROSSBAR_WITH_CUDA=ON but nvcc was not found; install the CUDA toolkit or use OFF")
  endif()
endif()
message(STATUS "crossbar: CUDA ${CROSSBAR_HAVE_CUDA}")
if(CROSSBAR_HAVE_CUDA)
  set(CROSSBAR_HAVE_CUDA_INT 1)
else()
  set(CROSSBAR_HAVE_CUDA_INT 0)
endif()

if(CROSSBAR_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(CROSSBAR_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
