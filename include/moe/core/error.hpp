// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// moe::Error, the one exception type moe throws, and the check helper behind it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace moe {

/// The exception every moe precondition failure throws. Its message has the form
/// "moe: <where>: <what is wrong>; <how to fix it>".
class Error : public std::runtime_error {
 public:
  explicit Error(std::string const& message) : std::runtime_error(message) {}
};

namespace detail {

/// A message part as it is streamed: string literals and other arrays decay to pointers, so that
/// messages differing only in their literals' lengths share one instantiation of the code that
/// formats them (thousands of call sites; each distinct list of part types is compiled once).
template <class T>
using MessagePart = std::conditional_t<std::is_array_v<std::remove_reference_t<T>>, std::decay_t<T>,
                                       std::remove_cvref_t<T> const&>;

/// Formats "moe: " and the parts and throws moe::Error. Cold and never inlined: it is only
/// reached on bad input, and its stream code stays out of the hot functions that check.
template <class... Parts>
[[noreturn, gnu::cold, gnu::noinline]] void fail_with(Parts... parts) {
  std::ostringstream out;
  out << "moe: ";
  (out << ... << parts);
  throw Error(out.str());
}

/// Throws moe::Error whose message is "moe: " followed by the streamed parts.
template <class... Parts>
[[noreturn]] inline void fail(Parts&&... parts) {
  fail_with<MessagePart<Parts>...>(parts...);
}

/// Throws moe::Error with the concatenated parts when `ok` is false.
template <class... Parts>
inline void check(bool ok, Parts&&... parts) {
  if (!ok) [[unlikely]]
    fail_with<MessagePart<Parts>...>(parts...);
}

}  // namespace detail
}  // namespace moe
