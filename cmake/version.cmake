# mhc_read_version(<out-var>): "MAJOR.MINOR.PATCH" from include/mhc/version.h, where the version
# is written once (pyproject.toml reads the same three lines).
function(mhc_read_version out)
  file(READ "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/../include/mhc/version.h" header)
  set(parts "")
  foreach(part MAJOR MINOR PATCH)
    if(NOT header MATCHES "\n#define MHC_VERSION_${part} ([0-9]+)\n")
      message(FATAL_ERROR "include/mhc/version.h: no line \"#define MHC_VERSION_${part} <number>\"")
    endif()
    list(APPEND parts "${CMAKE_MATCH_1}")
  endforeach()
  list(JOIN parts "." version)
  set(${out} "${version}" PARENT_SCOPE)
endfunction()
