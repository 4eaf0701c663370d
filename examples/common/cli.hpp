// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The command-line parsing the example tools share (not part of the library's API):
// parse_integer(), an integer option read as the value the user typed (std::from_chars into a
// 64-bit integer, the whole string consumed) and range-checked, or moe::Error naming the option,
// the value and the allowed range.
#pragma once

#include <charconv>
#include <cstdint>
#include <string_view>
#include <system_error>
#include <type_traits>

#include "moe/core/error.hpp"

namespace moe_cli {

/// The integer `text` of `option` as typed: std::from_chars into a 64-bit integer (signed for a
/// signed Int, unsigned otherwise), the whole string consumed, within [lo, hi]. Throws
/// moe::Error "<option> '<text>' is not an integer in [lo, hi]" otherwise (overflow included:
/// 4294967298 is never read as 2), followed by "; <why>" when `why` is given (what the bounds
/// come from).
template <class Int>
Int parse_integer(std::string_view option, std::string_view text, Int lo, Int hi,
                  std::string_view why = {}) {
  static_assert(std::is_integral_v<Int>);
  using Wide = std::conditional_t<std::is_signed_v<Int>, std::int64_t, std::uint64_t>;
  Wide v = 0;
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() ||
      v < static_cast<Wide>(lo) || v > static_cast<Wide>(hi)) {
    moe::detail::fail(option, " '", text, "' is not an integer in [", lo, ", ", hi, "]",
                      why.empty() ? "" : "; ", why);
  }
  return static_cast<Int>(v);
}

}  // namespace moe_cli
