# Installs libraries, headers, binaries, a CMake package (find_package(crossbar))
# and a pkg-config file.
include(CMakePackageConfigHelpers)
get_property(CROSSBAR_LAYER_TARGETS GLOBAL PROPERTY CROSSBAR_LAYERS)
install(TARGETS ${CROSSBAR_LAYER_TARGETS} EXPORT crossbarTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT crossbarTargets NAMESPACE crossbar:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/crossbar)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/crossbarConfig.cmake.in
  ${CMAKE_BINARY_DIR}/crossbarConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/crossbar)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/crossbarConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/crossbarConfig.cmake ${CMAKE_BINARY_DIR}/crossbarConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/crossbar)
string(REPLACE "crossbar_" "-lcrossbar_" CROSSBAR_PC_LIBS "${CROSSBAR_LAYER_TARGETS}")
string(REPLACE ";" " " CROSSBAR_PC_LIBS "${CROSSBAR_PC_LIBS}")
configure_file(${CMAKE_SOURCE_DIR}/cmake/crossbar.pc.in ${CMAKE_BINARY_DIR}/crossbar.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/crossbar.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
