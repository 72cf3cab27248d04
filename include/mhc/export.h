// mhc/export.h: MHC_API marks the public API, the only symbols a shared libmhc exports.
//
// The library is compiled with hidden visibility (CMake's CXX_VISIBILITY_PRESET), so everything
// without MHC_API stays inside it. MHC_STATIC (set for every user of the static library by its
// CMake target and pkg-config file) empties the macro: nothing is exported from a static archive,
// and a program that links it into its own shared library does not re-export mhc.
#pragma once

#if defined(MHC_STATIC)
#define MHC_API
#else
#define MHC_API __attribute__((visibility("default")))
#endif
