# cmake -P script behind the install_consumer test (arguments: see CMakeLists.txt).
cmake_minimum_required(VERSION 3.25)

function(step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install test: ${name} failed (${rc}):\n  ${ARGN}\n${out}")
  endif()
  message(STATUS "install test: ${name}: ok")
  set(STEP_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install test: cmake --install ${BUILD_DIR} failed; build every target first "
                      "(ninja -C ${BUILD_DIR}):\n${out}")
endif()
foreach(f include/crossbar/comm/store.h include/crossbar/crossbar_build_info.h
          ${LIBDIR}/cmake/crossbar/crossbarConfig.cmake ${LIBDIR}/pkgconfig/crossbar.pc)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "install test: ${prefix}/${f} was not installed")
  endif()
endforeach()

# The installed tool runs from its prefix (RPATH finds the libraries).
if(EXISTS ${prefix}/${BINDIR}/crossbar-info)
  step("installed crossbar-info" ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
       ${prefix}/${BINDIR}/crossbar-info --json)
endif()

# An installed benchmark runs from its prefix too, and nothing installed searches the
# current directory for libraries.
if(EXISTS ${prefix}/${BINDIR}/all_reduce_perf)
  step("installed all_reduce_perf" ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
       ${prefix}/${BINDIR}/all_reduce_perf --nranks 2 -b 8 -e 8 -n 1 -w 0)
endif()
step("installed RPATHs" ${CMAKE_CURRENT_LIST_DIR}/check_rpath.sh ${prefix})

# 1. CMake package.
step("configure consumer" ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
step("build consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step("run consumer" ${WORK_DIR}/build/consumer ${WORK_DIR}/store-cmake)
message(STATUS "${STEP_OUTPUT}")

# 2. pkg-config.
if(NOT PKG_CONFIG)
  message(FATAL_ERROR "install test: pkg-config not found")
endif()
step("pkg-config --cflags --libs crossbar" ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${prefix}/${LIBDIR}/pkgconfig
     ${PKG_CONFIG} --cflags --libs crossbar)
string(STRIP "${STEP_OUTPUT}" flags)
message(STATUS "pkg-config: ${flags}")
separate_arguments(flag_list UNIX_COMMAND "${flags}")
set(include_ok FALSE)
foreach(f ${flag_list})
  if(f MATCHES "^-I(.*)")
    file(REAL_PATH "${CMAKE_MATCH_1}" dir)
    file(REAL_PATH "${prefix}/include/crossbar" want)
    if(dir STREQUAL want)
      set(include_ok TRUE)
    endif()
  endif()
endforeach()
if(NOT include_ok OR NOT flags MATCHES "-lcrossbar_comm")
  message(FATAL_ERROR "install test: pkg-config gave '${flags}'; expected -I${prefix}/include/crossbar and -lcrossbar_comm")
endif()
step("compile consumer with pkg-config flags" ${CXX_COMPILER} -std=c++20 ${CONSUMER_DIR}/main.cc ${flag_list}
     -o ${WORK_DIR}/consumer-pc)
step("run pkg-config consumer" ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/${LIBDIR}
     ${WORK_DIR}/consumer-pc ${WORK_DIR}/store-pc)
