// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// moe::Error, the one exception type moe throws, and the check helper behind it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace moe {

/// The exception every moe precondition failure throws. Its message has the form
/// "moe: <where>: <what is wrong>; <how to fix it>".
class Error : public std::runtime_error {
 public:
  explicit Error(std::string const& message) : std::runtime_error(message) {}
};

namespace detail {

template <class... Parts>
[[noreturn]] inline void fail(Parts&&... parts) {
  std::ostringstream out;
  out << "moe: ";
  (out << ... << std::forward<Parts>(parts));
  throw Error(out.str());
}

/// Throws moe::Error with the concatenated parts when `ok` is false.
template <class... Parts>
inline void check(bool ok, Parts&&... parts) {
  if (!ok) fail(std::forward<Parts>(parts)...);
}

}  // namespace detail
}  // namespace moe
