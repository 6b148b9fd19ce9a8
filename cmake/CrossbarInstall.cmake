# Installs libraries, headers, binaries, a CMake package (find_package(crossbar))
# and a pkg-config file. Both are relocatable: `cmake --install build --prefix P`
# works for any P, not only CMAKE_INSTALL_PREFIX.
include(CMakePackageConfigHelpers)
get_property(CROSSBAR_LAYER_TARGETS GLOBAL PROPERTY CROSSBAR_LAYERS)

# Layers link each other (symmem -> comm); installed, they find each other next door.
set_target_properties(${CROSSBAR_LAYER_TARGETS} PROPERTIES INSTALL_RPATH "$ORIGIN")

install(TARGETS ${CROSSBAR_LAYER_TARGETS} EXPORT crossbarTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# A layer that links NCCL publicly needs the (interface) NCCL target in the export set.
if(TARGET crossbar_nccl)
  install(TARGETS crossbar_nccl EXPORT crossbarTargets)
endif()
install(EXPORT crossbarTargets NAMESPACE crossbar:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/crossbar)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/crossbarConfig.cmake.in
  ${CMAKE_BINARY_DIR}/crossbarConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/crossbar)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/crossbarConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/crossbarConfig.cmake ${CMAKE_BINARY_DIR}/crossbarConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/crossbar)

# pkg-config: -l flags in dependency order (dependents first, as static linking needs),
# prefix found from the .pc file's own location.
set(CROSSBAR_PC_LIBS "")
foreach(layer ${CROSSBAR_LAYER_TARGETS})
  string(PREPEND CROSSBAR_PC_LIBS "-l${layer} ")
endforeach()
string(STRIP "${CROSSBAR_PC_LIBS}" CROSSBAR_PC_LIBS)
file(RELATIVE_PATH CROSSBAR_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" CROSSBAR_PC_TO_PREFIX "${CROSSBAR_PC_TO_PREFIX}")
configure_file(${CMAKE_SOURCE_DIR}/cmake/crossbar.pc.in ${CMAKE_BINARY_DIR}/crossbar.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/crossbar.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
