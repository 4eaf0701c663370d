// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
//
// The command-line parsing the example tools share (not part of the library's API):
//   - Usage: a tool's synopsis and one line per option. --help / -h prints it on stdout with exit
//     status 0 (print_help, exit_help); an unknown argument is one line on stderr naming it and
//     pointing at --help, exit status 2 (print_unknown_argument, exit_unknown_argument). The
//     print_ forms return the status, for tools that must clean up first (MPI_Finalize);
//   - parse_integer(): an integer option read as the value the user typed (std::from_chars into
//     a 64-bit integer, the whole string consumed) and range-checked, or moe::Error naming the
//     option, the value and the allowed range.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include "moe/core/error.hpp"

namespace moe_cli {

/// Exit status of --help / -h.
inline constexpr int kExitHelp = 0;
/// Exit status of an unknown argument (and, in the tools that say so, of any bad argument).
inline constexpr int kExitUsage = 2;

/// One option of a tool: how it is spelt with its value ("--threads N") and what it does, in one
/// line.
struct Option {
  std::string_view flag;
  std::string_view meaning;
};

/// What --help prints: "usage: <tool> <synopsis>", then "options:" and one line per option, the
/// meanings aligned.
struct Usage {
  std::string_view tool;
  std::string_view synopsis;
  std::span<Option const> options;
};

/// Whether `arg` asks for the usage (--help or -h).
inline bool is_help(std::string_view arg) { return arg == "--help" || arg == "-h"; }

inline void print_usage(Usage const& usage, std::FILE* out) {
  auto const str = [](std::string_view s) { return static_cast<int>(s.size()); };
  std::fprintf(out, "usage: %.*s %.*s\noptions:\n", str(usage.tool), usage.tool.data(),
               str(usage.synopsis), usage.synopsis.data());
  std::size_t width = 0;
  for (Option const& o : usage.options) width = std::max(width, o.flag.size());
  for (Option const& o : usage.options) {
    std::fprintf(out, "  %-*.*s  %.*s\n", static_cast<int>(width), str(o.flag), o.flag.data(),
                 str(o.meaning), o.meaning.data());
  }
}

/// --help / -h: the usage on stdout; returns kExitHelp.
[[nodiscard]] inline int print_help(Usage const& usage) {
  print_usage(usage, stdout);
  return kExitHelp;
}

/// "<tool>: unknown argument '<arg>'; <tool> --help lists the options" on stderr; returns
/// kExitUsage.
[[nodiscard]] inline int print_unknown_argument(Usage const& usage, std::string_view arg) {
  auto const str = [](std::string_view s) { return static_cast<int>(s.size()); };
  std::fprintf(stderr, "%.*s: unknown argument '%.*s'; %.*s --help lists the options\n",
               str(usage.tool), usage.tool.data(), str(arg), arg.data(), str(usage.tool),
               usage.tool.data());
  return kExitUsage;
}

/// print_help, then std::exit(kExitHelp) (for parsers deep in a tool; nothing to clean up yet).
[[noreturn]] inline void exit_help(Usage const& usage) {
  int const status = print_help(usage);
  std::fflush(stdout);
  std::exit(status);
}

/// print_unknown_argument, then std::exit(kExitUsage).
[[noreturn]] inline void exit_unknown_argument(Usage const& usage, std::string_view arg) {
  std::exit(print_unknown_argument(usage, arg));
}

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

/// A size in bytes with its unit, as `option` takes it: "8GiB", "512MiB", "64KiB", "2GB",
/// "500MB", "100B" (a non-negative number, fractions allowed: "1.5GiB"). Throws moe::Error
/// naming the option and the accepted forms otherwise, or past 2^62 bytes.
inline std::uint64_t parse_bytes(std::string_view option, std::string_view text) {
  struct Unit {
    std::string_view suffix;
    double scale;
  };
  constexpr Unit kUnits[] = {{"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0},
                             {"GB", 1e9},           {"MB", 1e6},        {"B", 1.0}};
  for (Unit const& u : kUnits) {
    if (text.size() <= u.suffix.size() || !text.ends_with(u.suffix)) continue;
    std::string const number(text.substr(0, text.size() - u.suffix.size()));
    char* end = nullptr;
    double const v = std::strtod(number.c_str(), &end);
    if (end == number.c_str() + number.size() &&
        number.find_first_of("xXnN") == std::string::npos && v >= 0.0 && v * u.scale <= 4.6e18) {
      return static_cast<std::uint64_t>(v * u.scale);
    }
    break;
  }
  moe::detail::fail(option, " '", text,
                    "' is not a size with a unit (8GiB, 512MiB, 64KiB, 2GB, 500MB, 100B)");
}

}  // namespace moe_cli
