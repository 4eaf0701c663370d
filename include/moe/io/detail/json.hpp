// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// A strict pull parser for JSON (RFC 8259), UTF-8 validation and JSON string escaping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "moe/core/error.hpp"

namespace moe::io::detail {

/// The streamed parts as one string. Error messages are built with it rather than with
/// `"literal" + std::string` chains, on which GCC 12 at -O2/-O3 reports a false -Wrestrict
/// (GCC PR 105651) that -Werror builds of our users would turn into an error.
template <class... Parts>
std::string concat_parts(Parts... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
template <class... Parts>
std::string concat(Parts const&... parts) {
  return concat_parts<moe::detail::MessagePart<Parts const&>...>(parts...);
}

/// Returns the offset of the first byte that is not part of well-formed UTF-8 (Unicode 15,
/// table 3-7: no overlong forms, no surrogates, nothing above U+10FFFF), or npos when all of
/// `text` is well-formed. This is the rule of Rust's `str::from_utf8`, which the reference
/// safetensors reader applies to the header.
inline std::size_t find_invalid_utf8(std::string_view text) noexcept {
  auto const* s = reinterpret_cast<unsigned char const*>(text.data());
  std::size_t const n = text.size();
  std::size_t i = 0;
  while (i < n) {
    unsigned const c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3, lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
      len = 3;
    } else if (c == 0xED) {
      len = 3, hi = 0x9F;
    } else if (c == 0xF0) {
      len = 4, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4, hi = 0x8F;
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k) {
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

/// Appends `text` as a JSON string literal, escaped the way serde_json (the reference writer)
/// does it: `"` and `\` escaped, U+0000..U+001F as \b \t \n \f \r or \u00XX, all else verbatim.
inline void append_json_string(std::string& out, std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char const ch : text) {
    auto const c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

/// A name from a file, made safe to print in an error message: quoted with single quotes,
/// control characters and quotes escaped, cut after 120 bytes.
inline std::string printable_name(std::string_view name) {
  static constexpr char kHex[] = "0123456789abcdef";
  static constexpr std::size_t kMaxShown = 120;
  std::string out = "'";
  std::size_t const shown = name.size() > kMaxShown ? kMaxShown : name.size();
  for (std::size_t i = 0; i < shown; ++i) {
    auto const c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7F || c == '\'' || c == '\\') {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += name[i];
    }
  }
  if (shown < name.size()) out += "...";
  out += '\'';
  return out;
}

/// The kind of the next JSON value, judged by its first character.
enum class JsonKind : std::uint8_t { kObject, kArray, kString, kNumber, kBool, kNull };

/// "an object", "a string", ...: for error messages.
inline char const* json_kind_name(JsonKind kind) noexcept {
  switch (kind) {
    case JsonKind::kObject:
      return "an object";
    case JsonKind::kArray:
      return "an array";
    case JsonKind::kString:
      return "a string";
    case JsonKind::kNumber:
      return "a number";
    case JsonKind::kBool:
      return "a boolean";
    case JsonKind::kNull:
      return "null";
  }
  return "a value";
}

/// A JSON number as written: its text and, when it is a plain non-negative integer (no sign,
/// fraction or exponent) that fits 64 bits, its value.
struct JsonNumber {
  std::string_view text;
  bool is_u64 = false;
  std::uint64_t value = 0;
};

/// The UTF-8 encoding of code point `cp` (at most 0x10FFFF) appended to `out`.
inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// A strict, allocation-light pull parser over a UTF-8 JSON document.
///
/// Accepts exactly RFC 8259 JSON: whitespace is space, tab, LF and CR only; no comments, trailing
/// commas, single quotes, leading zeros, NaN/Infinity or unescaped control characters; `\u`
/// escapes must pair surrogates. Nesting deeper than kMaxDepth arrays/objects is rejected
/// (serde_json, the reference reader's parser, stops at 128 too). The caller validates UTF-8
/// first (find_invalid_utf8); the parser itself never reads outside `text` whatever it holds.
///
/// Syntax errors throw moe::Error: "moe: <context>: <what> at byte <k> of <document>; <hint>".
/// The caller drives the parse with peek()/begin_object()/next_member()/read_string()/...,
/// which lets it report schema errors with its own context.
class JsonCursor {
 public:
  static constexpr int kMaxDepth = 128;

  /// `context` prefixes every message (e.g. "safetensors: model.safetensors"), `document`
  /// names the text ("the header"), `hint` ends the message (how to fix it).
  JsonCursor(std::string_view text, std::string context, std::string document, std::string hint)
      : text_(text),
        context_(std::move(context)),
        document_(std::move(document)),
        hint_(std::move(hint)) {}

  /// Byte offset of the next unread character.
  std::size_t offset() const noexcept { return pos_; }

  /// Skips whitespace and classifies the next value; throws at end of input or on a character
  /// that cannot start a value.
  JsonKind peek() {
    skip_ws();
    if (pos_ >= text_.size()) syntax_error("unexpected end of JSON, expected a value");
    char const c = text_[pos_];
    switch (c) {
      case '{':
        return JsonKind::kObject;
      case '[':
        return JsonKind::kArray;
      case '"':
        return JsonKind::kString;
      case 't':
      case 'f':
        return JsonKind::kBool;
      case 'n':
        return JsonKind::kNull;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return JsonKind::kNumber;
        syntax_error(concat("unexpected ", describe_char(c), ", expected a JSON value"));
    }
  }

  /// Consumes '{'.
  void begin_object() {
    skip_ws();
    expect('{', "'{'");
    enter();
  }
  /// Reads the next member key and its ':' (returns true), or consumes the closing '}' (returns
  /// false). `first` is true before the first call for an object and is cleared by this call.
  bool next_member(std::string& key, bool& first) {
    if (!next_item('}', "'}'", first)) return false;
    if (pos_ >= text_.size() || text_[pos_] != '"') {
      if (pos_ >= text_.size()) syntax_error("unexpected end of JSON, expected a string key");
      syntax_error(concat("unexpected ", describe_char(text_[pos_]),
                          ", expected a string key in double quotes"));
    }
    key = read_string();
    skip_ws();
    expect(':', "':' after an object key");
    return true;
  }

  /// Consumes '['.
  void begin_array() {
    skip_ws();
    expect('[', "'['");
    enter();
  }
  /// Returns true when another element follows (positioned at it), false after consuming ']'.
  bool next_element(bool& first) { return next_item(']', "']'", first); }

  /// Reads a string value, decoding escapes into UTF-8.
  std::string read_string() {
    skip_ws();
    expect('"', "'\"'");
    std::string out;
    while (true) {
      if (pos_ >= text_.size()) syntax_error("unterminated string");
      auto const c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) {
        syntax_error(
            concat("unescaped control character ", describe_char(text_[pos_]), " in a string"));
      }
      if (c != '\\') {
        // Copy the run of ordinary characters in one go.
        std::size_t end = pos_ + 1;
        while (end < text_.size()) {
          auto const d = static_cast<unsigned char>(text_[end]);
          if (d == '"' || d == '\\' || d < 0x20) break;
          ++end;
        }
        out.append(text_.data() + pos_, end - pos_);
        pos_ = end;
        continue;
      }
      ++pos_;  // the backslash
      if (pos_ >= text_.size()) syntax_error("unterminated escape sequence");
      char const e = text_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u':
          append_utf8(out, read_unicode_escape());
          break;
        default:
          --pos_;
          syntax_error(concat("invalid escape sequence: backslash followed by ", describe_char(e)));
      }
    }
  }

  /// Reads a number (RFC 8259 grammar); see JsonNumber.
  JsonNumber read_number() {
    skip_ws();
    std::size_t const start = pos_;
    bool plain = true;  // no sign, fraction or exponent
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_, plain = false;
    if (pos_ >= text_.size() || !is_digit(text_[pos_])) {
      syntax_error("invalid number: expected a digit");
    }
    if (text_[pos_] == '0') {
      ++pos_;
      if (pos_ < text_.size() && is_digit(text_[pos_])) {
        syntax_error("invalid number: leading zeros are not allowed");
      }
    } else {
      while (pos_ < text_.size() && is_digit(text_[pos_])) ++pos_;
    }
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_, plain = false;
      if (pos_ >= text_.size() || !is_digit(text_[pos_])) {
        syntax_error("invalid number: expected a digit after '.'");
      }
      while (pos_ < text_.size() && is_digit(text_[pos_])) ++pos_;
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_, plain = false;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (pos_ >= text_.size() || !is_digit(text_[pos_])) {
        syntax_error("invalid number: expected a digit in the exponent");
      }
      while (pos_ < text_.size() && is_digit(text_[pos_])) ++pos_;
    }
    JsonNumber number;
    number.text = text_.substr(start, pos_ - start);
    if (plain) {
      number.is_u64 = true;
      for (char const d : number.text) {
        auto const digit = static_cast<std::uint64_t>(d - '0');
        if (number.value > (UINT64_MAX - digit) / 10) {
          number.is_u64 = false;  // does not fit 64 bits
          break;
        }
        number.value = number.value * 10 + digit;
      }
      if (!number.is_u64) number.value = 0;
    }
    return number;
  }

  /// Reads `true` or `false`.
  bool read_bool() {
    skip_ws();
    if (consume_literal("true")) return true;
    if (consume_literal("false")) return false;
    syntax_error("invalid literal, expected true or false");
  }

  /// Reads `null`.
  void read_null() {
    skip_ws();
    if (!consume_literal("null")) syntax_error("invalid literal, expected null");
  }

  /// Parses and discards one value of any kind (still checking its syntax and depth).
  void skip_value() {
    switch (peek()) {
      case JsonKind::kObject: {
        begin_object();
        std::string key;
        bool first = true;
        while (next_member(key, first)) skip_value();
        return;
      }
      case JsonKind::kArray: {
        begin_array();
        bool first = true;
        while (next_element(first)) skip_value();
        return;
      }
      case JsonKind::kString:
        (void)read_string();
        return;
      case JsonKind::kNumber:
        (void)read_number();
        return;
      case JsonKind::kBool:
        (void)read_bool();
        return;
      case JsonKind::kNull:
        read_null();
        return;
    }
  }

  /// Requires that only whitespace is left.
  void finish() {
    skip_ws();
    if (pos_ != text_.size()) {
      syntax_error(
          concat("unexpected ", describe_char(text_[pos_]), " after the end of the JSON value"));
    }
  }

  /// Throws moe::Error for a syntax error at the current position.
  [[noreturn]] void syntax_error(std::string const& what) const {
    moe::detail::fail(context_, ": ", document_, " is not valid JSON: ", what, " at byte ", pos_,
                      " of ", document_, "; ", hint_);
  }

 private:
  static bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

  static std::string describe_char(char ch) {
    static constexpr char kHex[] = "0123456789abcdef";
    auto const c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F) return concat("character '", ch, "'");
    std::string out = "byte 0x";
    out += kHex[c >> 4];
    out += kHex[c & 0xF];
    return out;
  }

  void skip_ws() noexcept {
    while (pos_ < text_.size()) {
      char const c = text_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  void expect(char c, char const* what) {
    if (pos_ >= text_.size()) syntax_error(concat("unexpected end of JSON, expected ", what));
    if (text_[pos_] != c) {
      syntax_error(concat("unexpected ", describe_char(text_[pos_]), ", expected ", what));
    }
    ++pos_;
  }

  void enter() {
    if (++depth_ > kMaxDepth) {
      syntax_error(concat("arrays and objects nested deeper than ", kMaxDepth, " levels"));
    }
  }

  // Shared by objects and arrays: positions at the next item (true) or consumes `close` (false).
  bool next_item(char close, char const* close_name, bool& first) {
    skip_ws();
    if (pos_ >= text_.size()) {
      syntax_error(concat("unexpected end of JSON, expected ", close_name));
    }
    if (text_[pos_] == close) {
      ++pos_;
      --depth_;
      return false;
    }
    if (!first) {
      if (text_[pos_] != ',') {
        syntax_error(
            concat("unexpected ", describe_char(text_[pos_]), ", expected ',' or ", close_name));
      }
      ++pos_;
      skip_ws();
      if (pos_ < text_.size() && text_[pos_] == close) {
        syntax_error(concat("trailing comma before ", close_name));
      }
    }
    first = false;
    return true;
  }

  bool consume_literal(std::string_view word) noexcept {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  unsigned read_hex4() {
    if (text_.size() - pos_ < 4) syntax_error("truncated \\u escape");
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      char const c = text_[pos_];
      unsigned digit = 0;
      if (c >= '0' && c <= '9') {
        digit = static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        digit = static_cast<unsigned>(c - 'A' + 10);
      } else {
        syntax_error("invalid hex digit in a \\u escape");
      }
      value = value * 16 + digit;
      ++pos_;
    }
    return value;
  }

  // After "\u": returns the code point, combining a surrogate pair.
  std::uint32_t read_unicode_escape() {
    unsigned const first = read_hex4();
    if (first >= 0xDC00 && first <= 0xDFFF) {
      syntax_error("lone trailing surrogate in a \\u escape");
    }
    if (first < 0xD800 || first > 0xDBFF) return first;
    if (text_.substr(pos_, 2) != "\\u") {
      syntax_error("lone leading surrogate in a \\u escape (expected a \\uDC00-\\uDFFF after it)");
    }
    pos_ += 2;
    unsigned const second = read_hex4();
    if (second < 0xDC00 || second > 0xDFFF) {
      syntax_error("leading surrogate not followed by a trailing surrogate in a \\u escape");
    }
    return 0x10000u + ((first - 0xD800u) << 10) + (second - 0xDC00u);
  }

  std::string_view text_;
  std::size_t pos_ = 0;
  int depth_ = 0;
  std::string context_;
  std::string document_;
  std::string hint_;
};

}  // namespace moe::io::detail
