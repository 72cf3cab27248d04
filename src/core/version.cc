// version.cc: the compiled library's version (mhc/version.h).
#include "mhc/version.h"

namespace mhc {

const char* version() { return MHC_VERSION_STRING; }

}  // namespace mhc
