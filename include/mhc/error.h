// mhc/error.h: the one exception type every public entry point throws for bad input.
#pragma once

#include <stdexcept>
#include <string>

#include "mhc/export.h"

namespace mhc {

// Thrown before any memory is touched when an argument is invalid. what() reads
//   "mhc::pre_forward: x: expected shape [T, 4, 130], got [5, 3, 130]"
// i.e. "<operation>: <argument>: <what was expected>, got <what was passed>".
class MHC_API Error : public std::invalid_argument {
 public:
  Error(const std::string& op, const std::string& argument, const std::string& problem);
  const std::string& op() const { return op_; }
  const std::string& argument() const { return argument_; }

 private:
  std::string op_;
  std::string argument_;
};

}  // namespace mhc
