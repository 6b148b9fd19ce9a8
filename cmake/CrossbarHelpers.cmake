# Common compile settings for every crossbar target.
function(crossbar_target_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  if(CROSSBAR_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  if(CROSSBAR_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${CROSSBAR_SANITIZE} -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=${CROSSBAR_SANITIZE})
  endif()
endfunction()

# crossbar_layer(NAME comm SOURCES ... DEPS ...): a library of one layer, with the
# repository root as include root ("comm/store.h"); installed as crossbar::NAME.
function(crossbar_layer)
  cmake_parse_arguments(L "" "NAME" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(crossbar_${L_NAME} SHARED ${L_SOURCES})
  add_library(crossbar::${L_NAME} ALIAS crossbar_${L_NAME})
  set_target_properties(crossbar_${L_NAME} PROPERTIES EXPORT_NAME ${L_NAME}
                        OUTPUT_NAME crossbar_${L_NAME} VERSION ${PROJECT_VERSION} SOVERSION 0)
  target_include_directories(crossbar_${L_NAME} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}> $<BUILD_INTERFACE:${CMAKE_BINARY_DIR}/generated>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/crossbar>)
  target_link_libraries(crossbar_${L_NAME} PUBLIC ${L_DEPS} PRIVATE ${L_PRIVATE_DEPS})
  crossbar_target_defaults(crossbar_${L_NAME})
  # Calls inside a layer's library go straight to the function (and may be inlined)
  # instead of through the PLT: nobody interposes crossbar's own symbols, and the small
  # collectives' issue path crosses a dozen such calls.
  target_compile_options(crossbar_${L_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-semantic-interposition>)
  set_property(GLOBAL APPEND PROPERTY CROSSBAR_LAYERS crossbar_${L_NAME})
  # Headers install where sources include them from: "symmem/cuda/vmm.h" ->
  # include/crossbar/symmem/cuda/vmm.h.
  file(RELATIVE_PATH rel ${CMAKE_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  file(GLOB headers ${CMAKE_CURRENT_SOURCE_DIR}/*.h)
  install(FILES ${headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/crossbar/${rel})
endfunction()
