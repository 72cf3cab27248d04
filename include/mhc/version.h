// mhc/version.h: the library's version, written here and nowhere else. CMake's project() and the
// Python package's metadata (pyproject.toml, scikit-build-core's regex provider) read these three
// lines; keep their form "#define MHC_VERSION_<PART> <number>".
#pragma once

#include "mhc/export.h"

#define MHC_VERSION_MAJOR 0
#define MHC_VERSION_MINOR 1
#define MHC_VERSION_PATCH 0

// One number for #if: 10000 * major + 100 * minor + patch.
#define MHC_VERSION (MHC_VERSION_MAJOR * 10000 + MHC_VERSION_MINOR * 100 + MHC_VERSION_PATCH)

#define MHC_VERSION_STRINGIFY_(x) #x
#define MHC_VERSION_STRINGIFY(x) MHC_VERSION_STRINGIFY_(x)
// "MAJOR.MINOR.PATCH" of these headers.
#define MHC_VERSION_STRING                 \
  MHC_VERSION_STRINGIFY(MHC_VERSION_MAJOR) \
  "." MHC_VERSION_STRINGIFY(MHC_VERSION_MINOR) "." MHC_VERSION_STRINGIFY(MHC_VERSION_PATCH)

namespace mhc {

// "MAJOR.MINOR.PATCH" of the library as it was compiled. A program can compare it with
// MHC_VERSION_STRING to catch headers and a library from different installs.
MHC_API const char* version();

}  // namespace mhc
