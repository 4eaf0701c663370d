// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// moe::text::Tokenizer: byte-level BPE (GPT-2 style, as Qwen2/Qwen3, DeepSeek-V3 and gpt-oss
/// use it) and SentencePiece-style BPE (llama 2, Mixtral) loaded from a Hugging Face
/// tokenizer.json or from a GGUF file's tokenizer.ggml.* metadata, with encode, decode and a
/// decoder that streams whole UTF-8 characters. Needs PCRE2 (pre-tokenizer regexes, Unicode
/// properties) and ICU (the NFC normalizer); the CMake target moe::text links both
/// (docs/tokenizer.md).
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <queue>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/gguf/file.hpp"

namespace moe::text {

namespace detail {

using io::detail::concat;

using io::detail::append_utf8;

/// GPT-2's bytes_to_unicode: the code point that stands for each byte in byte-level tokens
/// (printable Latin-1 bytes stand for themselves, the other 68 for U+0100.. in byte order).
inline std::array<std::uint32_t, 256> const& byte_to_code_point() {
  static std::array<std::uint32_t, 256> const table = [] {
    std::array<std::uint32_t, 256> t{};
    std::uint32_t next = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      bool const printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

/// Decodes one well-formed UTF-8 character at `s[i]` (the caller validated the text); advances i.
inline std::uint32_t next_code_point(std::string_view s, std::size_t& i) {
  auto const c = static_cast<unsigned char>(s[i]);
  std::size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  std::uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (std::size_t k = 1; k < len && i + k < s.size(); ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  }
  i += len;
  return cp;
}

/// Length of the longest prefix of `s[i..]` that starts a well-formed UTF-8 sequence, as
/// WHATWG's decoder and Rust's from_utf8_lossy count a "maximal subpart" (at least 1), and
/// whether that prefix is a whole character.
inline std::size_t utf8_prefix(std::string_view s, std::size_t i, bool& complete) {
  auto const c = static_cast<unsigned char>(s[i]);
  complete = false;
  if (c < 0x80) {
    complete = true;
    return 1;
  }
  std::size_t len = 0;
  unsigned lo = 0x80, hi = 0xBF;
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
    return 1;
  }
  std::size_t k = 1;
  for (; k < len && i + k < s.size(); ++k) {
    auto const b = static_cast<unsigned char>(s[i + k]);
    unsigned const l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return k;
  }
  complete = k == len;
  return k;
}

/// `bytes` as UTF-8 with every ill-formed maximal subpart replaced by U+FFFD (what
/// transformers' and tokenizers' decoders do).
inline std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  std::size_t i = 0;
  while (i < bytes.size()) {
    bool complete = false;
    std::size_t const n = utf8_prefix(bytes, i, complete);
    if (complete) {
      out.append(bytes.substr(i, n));
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += n;
  }
  return out;
}

/// A compiled PCRE2 pattern (UTF, Unicode properties, JIT when the library has it), shared by
/// copies of the tokenizer; matching allocates its own match data, so const use is thread-safe.
class Regex {
 public:
  Regex() = default;
  Regex(std::string const& pattern, bool literal, std::string_view where) {
    int error = 0;
    PCRE2_SIZE error_offset = 0;
    std::uint32_t const options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0u);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &error, &error_offset, nullptr);
    if (code == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      moe::detail::fail(where, ": the pre-tokenizer regex ", io::detail::printable_name(pattern),
                        " does not compile with PCRE2 (",
                        reinterpret_cast<char const*>(message.data()), " at offset ", error_offset,
                        "); this tokenizer is not supported yet");
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if no JIT
    code_.reset(code, pcre2_code_free);
  }

  /// Calls `piece(begin, end, matched)` for the matches of the pattern in `text` and the text
  /// between them, in order, none empty (the "Isolated" split behaviour of tokenizers).
  template <class Piece>
  void split(std::string_view text, Piece&& piece) const {
    std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> data(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr), pcre2_match_data_free);
    auto const* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    std::size_t pos = 0, last = 0;
    while (pos <= text.size()) {
      int const rc = pcre2_match(code_.get(), subject, text.size(), pos, PCRE2_NO_UTF_CHECK,
                                 data.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) moe::detail::fail("text: tokenizer: PCRE2 match error ", rc);
      PCRE2_SIZE const* ov = pcre2_get_ovector_pointer(data.get());
      std::size_t const b = ov[0], e = ov[1];
      if (e == b) {  // an empty match: skip one character
        if (b >= text.size()) break;
        std::size_t next = b;
        next_code_point(text, next);
        pos = next;
        continue;
      }
      if (b > last) piece(last, b, false);
      piece(b, e, true);
      last = pos = e;
    }
    if (last < text.size()) piece(last, text.size(), false);
  }

 private:
  std::shared_ptr<pcre2_code> code_;
};

/// NFC of valid UTF-8 `text` by ICU (unchanged when ICU's quick check says it already is).
inline std::string nfc(std::string_view text) {
  bool ascii = true;
  for (char const c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(text);
  UErrorCode status = U_ZERO_ERROR;
  UNormalizer2 const* norm = unorm2_getNFCInstance(&status);
  auto const check = [&](char const* what) {
    if (U_FAILURE(status)) {
      moe::detail::fail("text: tokenizer: ICU ", what, " failed: ", u_errorName(status));
    }
  };
  check("unorm2_getNFCInstance");
  std::vector<UChar> utf16(text.size() + 1);
  std::int32_t len16 = 0;
  u_strFromUTF8(utf16.data(), static_cast<std::int32_t>(utf16.size()), &len16, text.data(),
                static_cast<std::int32_t>(text.size()), &status);
  check("u_strFromUTF8");
  if (unorm2_quickCheck(norm, utf16.data(), len16, &status) == UNORM_YES && U_SUCCESS(status)) {
    return std::string(text);
  }
  status = U_ZERO_ERROR;
  std::vector<UChar> out16(static_cast<std::size_t>(len16) * 3 + 16);
  std::int32_t const n = unorm2_normalize(norm, utf16.data(), len16, out16.data(),
                                          static_cast<std::int32_t>(out16.size()), &status);
  check("unorm2_normalize");
  std::string out(static_cast<std::size_t>(n) * 3 + 4, '\0');
  std::int32_t out_len = 0;
  u_strToUTF8(out.data(), static_cast<std::int32_t>(out.size()), &out_len, out16.data(), n,
              &status);
  check("u_strToUTF8");
  out.resize(static_cast<std::size_t>(out_len));
  return out;
}

/// U+2581 LOWER ONE EIGHTH BLOCK: SentencePiece's stand-in for a space.
inline constexpr char kMetaspace[] = "\xE2\x96\x81";

/// "<0xNN>" (upper-case hex), SentencePiece's byte-fallback token of byte `b`.
inline std::string byte_token(unsigned char b) {
  constexpr char hex[] = "0123456789ABCDEF";
  return std::string{'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
}

/// `text` with every occurrence of `from` (not empty) replaced by `to`.
inline std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(text.size());
  std::size_t i = 0;
  for (std::size_t j; (j = text.find(from, i)) != std::string_view::npos; i = j + from.size()) {
    out.append(text.substr(i, j - i)).append(to);
  }
  out.append(text.substr(i));
  return out;
}

/// The bytes a SentencePiece-style token stands for: "<0xNN>" is byte NN, U+2581 a space.
inline std::string spm_bytes(std::string_view token) {
  auto const hex = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
  };
  if (token.size() == 6 && token.substr(0, 3) == "<0x" && token[5] == '>' && hex(token[3]) >= 0 &&
      hex(token[4]) >= 0) {
    return std::string(1, static_cast<char>(hex(token[3]) * 16 + hex(token[4])));
  }
  return replace_all(token, kMetaspace, " ");
}

/// GPT-2's pre-tokenizer pattern (tokenizers' ByteLevel with use_regex true).
inline constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

/// Qwen2's split (Qwen2/2.5/3, DeepSeek-R1's Qwen distills): one digit at a time.
inline constexpr char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
/// Llama 3's split (also GLM-4's): up to three digits at a time.
inline constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
/// o200k's split (gpt-oss, GPT-4o): cased words with their contractions, up to three digits.
inline constexpr char kO200kPattern[] =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
/// DeepSeek-V3's three splits, applied one after the other: digits in threes, runs of CJK
/// ideographs and kana, then words and punctuation.
inline constexpr char kDeepSeekV3Digits[] = R"(\p{N}{1,3})";
inline constexpr char kDeepSeekV3Cjk[] = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+";
inline constexpr char kDeepSeekV3Words[] =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// What a GGUF file's tokenizer.ggml.pre name stands for: the splits and the normalizer of the
/// family's tokenizer.json (the regexes as the Hugging Face tokenizer writes them; llama.cpp's
/// src/llama-vocab.cpp maps the same names onto hand-adapted copies), whether whole pre-tokens
/// found in the vocabulary skip the merges, and whether BOS is added when the file does not say.
struct GgufPreTokenizer {
  std::vector<char const*> splits;
  bool nfc = false;
  bool ignore_merges = false;
  bool add_bos = false;
};

/// The pre-tokenizer names from_gguf knows, for error messages.
inline constexpr char kGgufPreNames[] =
    "qwen2, deepseek-r1-qwen, deepseek-v3, gpt-4o, minimax-m2, llama-bpe, llama3, llama-v3, glm4, "
    "chatglm-bpe, olmo, gpt-2";

inline std::optional<GgufPreTokenizer> gguf_pre_tokenizer(std::string_view pre) {
  if (pre == "qwen2" || pre == "deepseek-r1-qwen") {
    return GgufPreTokenizer{{kQwen2Pattern}, /*nfc=*/true, false, false};
  }
  if (pre == "deepseek-v3") {
    return GgufPreTokenizer{
        {kDeepSeekV3Digits, kDeepSeekV3Cjk, kDeepSeekV3Words}, false, false, false};
  }
  // gpt-oss's tokenizer.json sets ignore_merges (o200k is tiktoken's: a whole word in the
  // vocabulary is one token).
  if (pre == "gpt-4o" || pre == "minimax-m2") {
    return GgufPreTokenizer{{kO200kPattern}, false, /*ignore_merges=*/true, false};
  }
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
    return GgufPreTokenizer{{kLlama3Pattern}, false, /*ignore_merges=*/true, /*add_bos=*/true};
  }
  if (pre == "glm4" || pre == "chatglm-bpe") return GgufPreTokenizer{{kLlama3Pattern}, false};
  if (pre == "olmo" || pre == "gpt-2") return GgufPreTokenizer{{kGpt2Pattern}, false};
  return std::nullopt;
}

/// Token strings to ids: an open-addressing table of indices into one vector of strings (a
/// node-based std::unordered_map spends most of a 200k-token load in cache misses).
class TokenTable {
 public:
  void reserve(std::size_t n) {
    tokens_.reserve(n);
    ids_.reserve(n);
    if (slots_.size() < 2 * n) rehash(std::bit_ceil(2 * n));
  }
  std::size_t size() const noexcept { return tokens_.size(); }
  bool empty() const noexcept { return tokens_.empty(); }
  /// Adds `token` with `id`; a token seen before keeps its last id (as serde_json's maps do).
  void insert(std::string token, std::int32_t id) {
    if (2 * (tokens_.size() + 1) > slots_.size())
      rehash(std::max<std::size_t>(64, 2 * slots_.size()));
    std::size_t const mask = slots_.size() - 1;
    for (std::size_t i = hash(token) & mask;; i = (i + 1) & mask) {
      if (slots_[i] < 0) {
        slots_[i] = static_cast<std::int32_t>(tokens_.size());
        tokens_.push_back(std::move(token));
        ids_.push_back(id);
        return;
      }
      if (tokens_[slots_[i]] == token) {
        ids_[slots_[i]] = id;
        return;
      }
    }
  }
  std::int32_t find(std::string_view token) const noexcept {
    if (slots_.empty()) return -1;
    std::size_t const mask = slots_.size() - 1;
    for (std::size_t i = hash(token) & mask;; i = (i + 1) & mask) {
      if (slots_[i] < 0) return -1;
      if (tokens_[slots_[i]] == token) return ids_[slots_[i]];
    }
  }
  /// Calls f(token, id) for every entry.
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i < tokens_.size(); ++i) f(tokens_[i], ids_[i]);
  }

 private:
  static std::size_t hash(std::string_view s) noexcept {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a, then a final mix
    for (char const c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    return static_cast<std::size_t>(h ^ (h >> 29));
  }
  void rehash(std::size_t capacity) {
    slots_.assign(capacity, -1);
    std::size_t const mask = capacity - 1;
    for (std::size_t k = 0; k < tokens_.size(); ++k) {
      std::size_t i = hash(tokens_[k]) & mask;
      while (slots_[i] >= 0) i = (i + 1) & mask;
      slots_[i] = static_cast<std::int32_t>(k);
    }
  }
  std::vector<std::string> tokens_;
  std::vector<std::int32_t> ids_;
  std::vector<std::int32_t> slots_;
};

/// BPE merges: the pair of token ids (a << 32 | b) to the merge's rank and the merged token's id,
/// in an open-addressing table.
class MergeTable {
 public:
  struct Merge {
    std::int32_t rank;
    std::int32_t id;
  };
  static std::uint64_t key(std::int32_t a, std::int32_t b) noexcept {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }
  void reserve(std::size_t n) {
    if (slots_.size() < 2 * n) rehash(std::bit_ceil(2 * n));
  }
  /// The first merge of a pair wins (a later duplicate has a worse rank).
  void insert(std::uint64_t k, Merge m) {
    if (2 * (size_ + 1) > slots_.size()) rehash(std::max<std::size_t>(64, 2 * slots_.size()));
    std::size_t const mask = slots_.size() - 1;
    for (std::size_t i = mix(k) & mask;; i = (i + 1) & mask) {
      if (slots_[i].key == kEmpty) {
        slots_[i] = Slot{k, m};
        ++size_;
        return;
      }
      if (slots_[i].key == k) return;
    }
  }
  Merge const* find(std::uint64_t k) const noexcept {
    if (slots_.empty()) return nullptr;
    std::size_t const mask = slots_.size() - 1;
    for (std::size_t i = mix(k) & mask;; i = (i + 1) & mask) {
      if (slots_[i].key == k) return &slots_[i].merge;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  struct Slot {
    std::uint64_t key = kEmpty;
    Merge merge{};
  };
  static std::size_t mix(std::uint64_t k) noexcept {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return static_cast<std::size_t>(k);
  }
  void rehash(std::size_t capacity) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(capacity, Slot{});
    size_ = 0;
    for (Slot const& s : old) {
      if (s.key != kEmpty) insert(s.key, s.merge);
    }
  }
  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

/// Reads an object member by member: `member(key, cursor)` must consume each value.
template <class Member>
void for_members(io::detail::JsonCursor& cur, Member&& member) {
  if (cur.peek() != io::detail::JsonKind::kObject) return cur.syntax_error("expected an object");
  cur.begin_object();
  std::string key;
  bool first = true;
  while (cur.next_member(key, first)) member(key, cur);
}

/// A token of tokenizer_config.json: a string, null ("") or an AddedToken object's content.
inline std::string config_token(io::detail::JsonCursor& c) {
  if (c.peek() == io::detail::JsonKind::kNull) {
    c.read_null();
    return {};
  }
  if (c.peek() == io::detail::JsonKind::kString) return c.read_string();
  std::string content;
  for_members(c, [&](std::string const& k, io::detail::JsonCursor& q) {
    if (k == "content") {
      content = q.read_string();
    } else {
      q.skip_value();
    }
  });
  return content;
}

/// The whole file `path` (a tokenizer's JSON documents); moe::Error naming it when it cannot be
/// read.
inline std::string read_file(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    moe::detail::fail("text: tokenizer: cannot open ", path.string(),
                      "; pass a tokenizer.json file or the model directory holding it");
  }
  std::string text(static_cast<std::size_t>(in.tellg()), '\0');
  in.seekg(0);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (!in) moe::detail::fail("text: tokenizer: cannot read ", path.string());
  return text;
}

}  // namespace detail

/// An added token of tokenizer.json ("added_tokens"): matched in the raw text before anything
/// else, longest first.
struct AddedToken {
  std::string content;
  std::int32_t id = 0;
  bool special = false;
  bool lstrip = false;  ///< absorbs the whitespace before it
  bool rstrip = false;  ///< absorbs the whitespace after it
};

/// A BPE tokenizer (byte-level, or SentencePiece-style over characters with byte fallback) of a
/// Hugging Face tokenizer.json or a GGUF file. Copies share the compiled
/// regexes; const member functions may be called from several threads at once.
class Tokenizer {
 public:
  /// Parses a tokenizer.json document (`json`) and, if not empty, tokenizer_config.json
  /// (`config_json`: add_bos_token / bos_token / eos_token). `source` names the document in
  /// error messages. Throws moe::Error (one line) on bad JSON or anything not supported.
  static Tokenizer from_hf_json(std::string_view json, std::string_view config_json = {},
                                std::string_view source = "tokenizer.json") {
    Tokenizer t;
    t.parse(json, source);
    if (!config_json.empty()) t.parse_config(config_json, source);
    t.finish();
    return t;
  }

  /// Reads `path`: a tokenizer.json file, or a directory holding tokenizer.json (and, if there,
  /// tokenizer_config.json).
  static Tokenizer from_hf_file(std::filesystem::path const& path) {
    namespace fs = std::filesystem;
    fs::path json = path, config;
    if (fs::is_directory(path)) {
      json = path / "tokenizer.json";
      if (fs::exists(path / "tokenizer_config.json")) config = path / "tokenizer_config.json";
    } else if (fs::exists(path.parent_path() / "tokenizer_config.json")) {
      config = path.parent_path() / "tokenizer_config.json";
    }
    std::string const text = read_file(json);
    std::string const config_text = config.empty() ? std::string() : read_file(config);
    return from_hf_json(text, config_text, json.string());
  }

  /// Builds the tokenizer a GGUF file holds in its metadata (`file`: a GgufFile, or a
  /// GgufModel's metadata()), as llama.cpp's convert_hf_to_gguf.py writes it:
  /// tokenizer.ggml.model "gpt2" (byte-level BPE); `tokens` in id order with `token_type`
  /// (1 normal, 2 unknown, 6 byte: the vocabulary; 3 control: a special added token; 4
  /// user-defined: an added token that is not special; 5 unused: a padding slot, not a token);
  /// `merges` ("a b", by rank); `pre`, the name of the family's pre-tokenizer (qwen2,
  /// deepseek-v3, gpt-4o, llama-bpe, glm4, olmo, ...: detail::gguf_pre_tokenizer); the ids
  /// bos_token_id, eos_token_id, eot_token_id, padding_token_id; add_bos_token, add_eos_token.
  /// Control and user-defined tokens are matched in the text before anything else, longest
  /// first, as added tokens of a tokenizer.json are. tokenizer.ggml.model "llama"
  /// (SentencePiece BPE) has `scores` instead of merges (spm_merges_from_scores), <0xNN> byte
  /// tokens (type 6), add_space_prefix (default true) and BOS by default. Throws moe::Error
  /// naming the file and the key for a missing or malformed key, another model or an unknown
  /// pre-tokenizer.
  static Tokenizer from_gguf(io::GgufFile const& file) {
    Tokenizer t;
    t.source_ = file.display_name();
    std::string const where = detail::concat(file.display_name(), ": tokenizer.ggml");
    if (!file.has("tokenizer.ggml.model")) {
      moe::detail::fail("text: ", file.display_name(),
                        ": the file has no tokenizer (no tokenizer.ggml.model key); pass the "
                        "model's tokenizer.json instead");
    }
    std::string_view const model = file.string("tokenizer.ggml.model");
    if (model != "gpt2" && model != "llama") {
      moe::detail::fail("text: ", where, ".model is ", io::detail::printable_name(model),
                        ", which is not supported yet (\"gpt2\", byte-level BPE, and \"llama\", "
                        "SentencePiece BPE; see docs/tokenizer.md)");
    }
    bool const spm = model == "llama";
    std::string_view const pre = file.string_or("tokenizer.ggml.pre", "");
    std::optional<detail::GgufPreTokenizer> const p =
        spm ? std::optional(detail::GgufPreTokenizer{{}, false, false, /*add_bos=*/true})
            : detail::gguf_pre_tokenizer(pre);
    if (!p) {
      moe::detail::fail("text: ", where, ".pre is ",
                        pre.empty() ? std::string("missing") : io::detail::printable_name(pre),
                        ", which is not supported (supported: ", detail::kGgufPreNames,
                        "; see docs/tokenizer.md)");
    }
    for (char const* pattern : p->splits) {
      t.splits_.push_back(Split{detail::Regex(pattern, false, t.source_), pattern});
    }
    if (p->nfc) t.normalizers_.push_back(Normalizer{Normalizer::kNfc, {}, {}});
    t.ignore_merges_ = p->ignore_merges;
    t.byte_level_ = !spm;
    t.post_processor_ = "null";
    if (spm) {
      // SentencePiece: U+2581 for every space and, unless add_space_prefix says otherwise, one
      // before the text after each special token (llama.cpp and transformers' legacy llama
      // tokenizer alike), stripped again when decoding.
      t.spm_ = t.byte_fallback_ = true;
      if (file.boolean_or("tokenizer.ggml.add_space_prefix", true)) {
        t.normalizers_.push_back(Normalizer{Normalizer::kPrepend, detail::kMetaspace, {}});
        t.strip_start_ = 1;
      }
      t.normalizers_.push_back(Normalizer{Normalizer::kReplace, " ", detail::kMetaspace});
    }

    std::span<std::string_view const> const tokens = file.strings("tokenizer.ggml.tokens");
    std::vector<std::int64_t> types;
    if (file.has("tokenizer.ggml.token_type")) {
      types = file.integers("tokenizer.ggml.token_type");
      if (types.size() != tokens.size()) {
        moe::detail::fail("text: ", where, ".token_type has ", types.size(), " entries for ",
                          tokens.size(), " tokens; the file is damaged");
      }
    }
    if (tokens.size() > 0x7FFFFFFF) {
      moe::detail::fail("text: ", where, ".tokens has more than 2^31 - 1 tokens");
    }
    t.vocab_.reserve(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      auto const id = static_cast<std::int32_t>(i);
      std::string_view const token = tokens[i];
      std::int64_t const type = types.empty() ? 1 : types[i];
      if (type == 5) continue;  // unused: "[PAD<i>]" where the model's vocab is padded
      if (type < 1 || type > 6) {
        moe::detail::fail("text: ", where, ".token_type of token ", i, " is ", type,
                          "; expected 1 (normal) to 6 (byte)");
      }
      if (token.empty() || io::detail::find_invalid_utf8(token) != std::string_view::npos) {
        moe::detail::fail("text: ", where, ".tokens: token ", i,
                          " is empty or not UTF-8; the file is damaged");
      }
      t.vocab_.insert(std::string(token), id);
      // Control and user-defined tokens are matched in the text; so is SentencePiece's unknown
      // token (llama.cpp's special-token cache holds it too).
      if (type == 3 || type == 4 || (spm && type == 2)) {
        t.added_.push_back(AddedToken{std::string(token), id, /*special=*/type != 4});
      }
      if (spm && type == 2 && !t.unk_id_) t.unk_id_ = id;
    }
    if (spm) {
      spm_merges_from_scores(file, where, tokens, types, t);
    } else {
      gguf_merges(file, where, t);
    }
    auto const special_id =
        [&](char const* key, std::optional<std::int32_t> fallback) -> std::optional<std::int32_t> {
      std::string const k = detail::concat("tokenizer.ggml.", key);
      if (!file.has(k) && !fallback) return std::nullopt;
      std::uint64_t const id =
          file.has(k) ? file.integer(k) : static_cast<std::uint64_t>(*fallback);
      // llama.cpp ignores an id outside the vocabulary (with a warning); so does this.
      if (id >= tokens.size() || (!types.empty() && types[id] == 5)) return std::nullopt;
      return static_cast<std::int32_t>(id);
    };
    // llama.cpp's defaults for a SentencePiece vocabulary: BOS 1, EOS 2.
    t.bos_id_ = special_id("bos_token_id", spm ? std::optional(1) : std::nullopt);
    t.eos_id_ = special_id("eos_token_id", spm ? std::optional(2) : std::nullopt);
    t.eot_id_ = special_id("eot_token_id", std::nullopt);
    t.pad_id_ = special_id("padding_token_id", std::nullopt);
    t.add_bos_ = file.boolean_or("tokenizer.ggml.add_bos_token", p->add_bos);
    bool const add_eos = file.boolean_or("tokenizer.ggml.add_eos_token", false);
    t.finish();
    if (add_eos && t.eos_id_) t.suffix_ids_.push_back(*t.eos_id_);
    return t;
  }

 private:
  /// tokenizer.ggml.merges ("a b", by rank) into t.merges_.
  static void gguf_merges(io::GgufFile const& file, std::string const& where, Tokenizer& t) {
    if (!file.has("tokenizer.ggml.merges")) {
      moe::detail::fail("text: ", where, ".merges is missing; a BPE tokenizer needs its merges");
    }
    std::span<std::string_view const> const merges = file.strings("tokenizer.ggml.merges");
    t.merges_.reserve(merges.size());
    std::string joined;
    for (std::size_t rank = 0; rank < merges.size(); ++rank) {
      std::string_view const m = merges[rank];
      std::size_t const sp = m.find(' ', 1);
      std::int32_t ia = -1, ib = -1, iab = -1;
      if (sp != std::string_view::npos) {
        joined.assign(m.substr(0, sp)).append(m.substr(sp + 1));
        ia = t.vocab_.find(m.substr(0, sp));
        ib = t.vocab_.find(m.substr(sp + 1));
        iab = t.vocab_.find(joined);
      }
      if (ia < 0 || ib < 0 || iab < 0) {
        moe::detail::fail("text: ", where, ".merges: merge ", rank, " (",
                          io::detail::printable_name(m),
                          ") is not two tokens of the vocabulary separated by a space");
      }
      t.merges_.insert(pair_key(ia, ib), {static_cast<std::int32_t>(rank), iab});
    }
  }

  /// SentencePiece BPE's merges, from the scores (tokenizer.ggml.scores): every way of writing
  /// a normal token as two tokens is a merge, ranked by the token's score (highest first, then
  /// by id), then by the two parts' ids, as transformers' SentencePieceExtractor orders the
  /// merges of tokenizer.json. Merging the best-ranked pair first is then SentencePiece's (and
  /// llama.cpp's) rule of merging the pair whose result scores highest.
  static void spm_merges_from_scores(io::GgufFile const& file, std::string const& where,
                                     std::span<std::string_view const> tokens,
                                     std::vector<std::int64_t> const& types, Tokenizer& t) {
    if (!file.has("tokenizer.ggml.scores")) {
      moe::detail::fail("text: ", where,
                        ".scores is missing; a SentencePiece vocabulary merges by them");
    }
    std::vector<float> const scores = file.floats("tokenizer.ggml.scores");
    if (scores.size() != tokens.size()) {
      moe::detail::fail("text: ", where, ".scores has ", scores.size(), " entries for ",
                        tokens.size(), " tokens; the file is damaged");
    }
    std::vector<std::int32_t> order;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (types.empty() || types[i] == 1) order.push_back(static_cast<std::int32_t>(i));
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t a, std::int32_t b) { return scores[a] > scores[b]; });
    struct Merge {
      std::int32_t left, right, id;
    };
    std::vector<Merge> merges;
    std::vector<Merge> local;
    for (std::int32_t const id : order) {
      std::string_view const token = tokens[id];
      local.clear();
      std::size_t i = 0;
      detail::next_code_point(token, i);
      for (; i < token.size(); detail::next_code_point(token, i)) {
        std::int32_t const l = t.vocab_.find(token.substr(0, i));
        std::int32_t const r = t.vocab_.find(token.substr(i));
        if (l >= 0 && r >= 0) local.push_back(Merge{l, r, id});
      }
      std::sort(local.begin(), local.end(), [](Merge const& a, Merge const& b) {
        return a.left != b.left ? a.left < b.left : a.right < b.right;
      });
      merges.insert(merges.end(), local.begin(), local.end());
    }
    t.merges_.reserve(merges.size());
    for (std::size_t rank = 0; rank < merges.size(); ++rank) {
      Merge const& m = merges[rank];
      t.merges_.insert(pair_key(m.left, m.right), {static_cast<std::int32_t>(rank), m.id});
    }
  }

 public:
  /// Token ids of `utf8` (which must be well-formed UTF-8). Added tokens written in the text
  /// are recognised; `add_special_tokens` adds what the post-processor adds (BOS for
  /// DeepSeek-V3, nothing for Qwen).
  std::vector<std::int32_t> encode(std::string_view utf8, bool add_special_tokens = true) const {
    std::size_t const bad = io::detail::find_invalid_utf8(utf8);
    if (bad != std::string_view::npos) {
      moe::detail::fail("text: tokenizer: encode: the text is not well-formed UTF-8 at byte ", bad,
                        "; pass UTF-8 text");
    }
    std::vector<std::int32_t> ids;
    if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
    std::size_t seg = 0, i = 0;
    auto const flush = [&](std::size_t end) {
      if (end > seg) encode_segment(utf8.substr(seg, end - seg), ids);
    };
    while (i < utf8.size()) {
      AddedToken const* hit = match_added(utf8, i);
      if (hit == nullptr) {
        ++i;
        continue;
      }
      std::size_t begin = i, end = i + hit->content.size();
      if (hit->lstrip) {
        while (begin > seg && is_space(utf8[begin - 1])) --begin;
      }
      flush(begin);
      ids.push_back(hit->id);
      if (hit->rstrip) {
        while (end < utf8.size() && is_space(utf8[end])) ++end;
      }
      seg = i = end;
    }
    flush(utf8.size());
    if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
    return ids;
  }

  /// The text of `ids` (special tokens included unless `skip_special_tokens`); byte sequences
  /// that are not UTF-8 become U+FFFD. Throws moe::Error for an id outside the vocabulary.
  std::string decode(std::span<std::int32_t const> ids, bool skip_special_tokens = false) const {
    std::string bytes;
    for (std::int32_t const id : ids) append_bytes(id, skip_special_tokens, bytes);
    return detail::utf8_lossy(std::string_view(bytes).substr(leading_spaces(bytes)));
  }

  /// The bytes token `id` stands for (before UTF-8 repair), appended to `out`.
  void append_bytes(std::int32_t id, bool skip_special_tokens, std::string& out) const {
    if (id < 0 || static_cast<std::size_t>(id) >= id_bytes_.size() || !has_id_[id]) {
      moe::detail::fail("text: tokenizer: decode: token id ", id, " is not in the vocabulary (",
                        vocab_size(), " ids)");
    }
    if (skip_special_tokens && is_special_[id]) return;
    out += id_bytes_[id];
  }

  /// How many of the spaces at the start of `text` the decoder strips (SentencePiece-style
  /// decoders strip the one the normalizer prepended; 0 otherwise).
  std::size_t leading_spaces(std::string_view text) const noexcept {
    std::size_t n = 0;
    while (n < strip_start_ && n < text.size() && text[n] == ' ') ++n;
    return n;
  }

  /// One past the largest token id.
  std::size_t vocab_size() const noexcept { return id_bytes_.size(); }
  /// The id of token `token` as written in tokenizer.json (byte-level form for vocab entries).
  std::optional<std::int32_t> token_to_id(std::string_view token) const {
    if (std::int32_t const id = vocab_.find(token); id >= 0) return id;
    for (AddedToken const& a : added_) {
      if (a.content == token) return a.id;
    }
    return std::nullopt;
  }
  std::optional<std::int32_t> bos_id() const noexcept { return bos_id_; }
  std::optional<std::int32_t> eos_id() const noexcept { return eos_id_; }
  /// The end-of-turn token a GGUF file names (tokenizer.ggml.eot_token_id); none for a
  /// tokenizer.json.
  std::optional<std::int32_t> eot_id() const noexcept { return eot_id_; }
  /// The padding token a GGUF file names (tokenizer.ggml.padding_token_id).
  std::optional<std::int32_t> pad_id() const noexcept { return pad_id_; }
  /// Whether encode(text) (with add_special_tokens) starts with the BOS token.
  bool adds_bos() const noexcept {
    return bos_id_ && !prefix_ids_.empty() && prefix_ids_.front() == *bos_id_;
  }
  /// Whether `id` is a token of the vocabulary (decode() refuses the others; a GGUF file's
  /// unused padding slots are not tokens).
  bool contains(std::int32_t id) const noexcept {
    return id >= 0 && static_cast<std::size_t>(id) < has_id_.size() && has_id_[id];
  }
  std::vector<AddedToken> const& added_tokens() const noexcept { return added_; }
  /// How a GGUF file names this tokenizer (tokenizer.ggml.pre): the first of llama.cpp's names
  /// whose splits, NFC normalization and ignore_merges (detail::gguf_pre_tokenizer) are this
  /// byte-level BPE tokenizer's ("qwen2", "deepseek-v3", "gpt-4o", "llama-bpe", "glm4",
  /// "gpt-2"); "" for a SentencePiece one (tokenizer.ggml.model "llama", no pre); nothing when
  /// llama.cpp has no name for its splits.
  std::optional<std::string> gguf_pre() const {
    if (spm_) return std::string();
    if (!byte_level_ || add_prefix_space_) return std::nullopt;
    bool const nfc = std::any_of(normalizers_.begin(), normalizers_.end(),
                                 [](Normalizer const& n) { return n.kind == Normalizer::kNfc; });
    for (char const* name : {"qwen2", "deepseek-v3", "gpt-4o", "llama-bpe", "glm4", "gpt-2"}) {
      std::optional<detail::GgufPreTokenizer> const p = detail::gguf_pre_tokenizer(name);
      if (p->nfc != nfc || p->ignore_merges != ignore_merges_ ||
          p->splits.size() != splits_.size() || normalizers_.size() != (nfc ? 1u : 0u)) {
        continue;
      }
      // A pattern may write CR, LF and tab as characters or as the escapes \r, \n, \t
      // (DeepSeek-V3's tokenizer.json has the characters): compared with the escapes resolved.
      auto canonical = [](std::string_view re) {
        std::string out;
        for (std::size_t i = 0; i < re.size(); ++i) {
          if (re[i] != '\\' || i + 1 == re.size()) {
            out += re[i];
            continue;
          }
          char const n = re[++i];
          if (n == 'r' || n == 'n' || n == 't') {
            out += n == 'r' ? '\r' : n == 'n' ? '\n' : '\t';
          } else {
            out += '\\';
            out += n;
          }
        }
        return out;
      };
      bool same = true;
      for (std::size_t i = 0; i < splits_.size(); ++i) {
        same = same && canonical(splits_[i].pattern) == canonical(p->splits[i]);
      }
      if (same) return std::string(name);
    }
    return std::nullopt;
  }
  bool is_special(std::int32_t id) const noexcept {
    return id >= 0 && static_cast<std::size_t>(id) < is_special_.size() && is_special_[id];
  }

 private:
  struct Split {
    detail::Regex regex;
    std::string pattern;  ///< as written (tokenizer.json, or the GGUF pre name's)
  };
  static bool is_space(char c) noexcept {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  }

  static std::string read_file(std::filesystem::path const& path) {
    return detail::read_file(path);
  }

  [[noreturn]] static void unsupported(std::string_view source, std::string_view what) {
    moe::detail::fail("text: ", source, ": ", what,
                      " is not supported yet (byte-level and SentencePiece-style BPE only; see "
                      "docs/tokenizer.md)");
  }

  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) noexcept {
    return detail::MergeTable::key(a, b);
  }

  // --- parsing -------------------------------------------------------------------------------

  /// A JSON value kept as text (for the small parts of the document: normalizer, pre_tokenizer,
  /// decoder, post_processor), parsed again with a cursor of its own.
  static std::string_view raw_value(io::detail::JsonCursor& cur, std::string_view json) {
    cur.peek();
    std::size_t const begin = cur.offset();
    cur.skip_value();
    return json.substr(begin, cur.offset() - begin);
  }

  static io::detail::JsonCursor cursor(std::string_view json, std::string_view source) {
    return io::detail::JsonCursor(json, detail::concat("text: ", source), "tokenizer.json",
                                  "pass a Hugging Face tokenizer.json");
  }

  template <class Member>
  static void for_members(io::detail::JsonCursor& cur, Member&& member) {
    detail::for_members(cur, std::forward<Member>(member));
  }

  static std::string read_string_or_null(io::detail::JsonCursor& cur) {
    if (cur.peek() == io::detail::JsonKind::kNull) {
      cur.read_null();
      return {};
    }
    return cur.read_string();
  }

  void parse(std::string_view json, std::string_view source) {
    source_ = std::string(source);
    std::size_t const bad = io::detail::find_invalid_utf8(json);
    if (bad != std::string_view::npos) {
      moe::detail::fail("text: ", source, ": not UTF-8 at byte ", bad,
                        "; pass a Hugging Face tokenizer.json");
    }
    auto cur = cursor(json, source);
    std::string_view normalizer = "null", pre_tokenizer = "null", decoder = "null",
                     post_processor = "null";
    bool have_model = false;
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "model") {
        have_model = true;
        parse_model(c);
      } else if (key == "added_tokens") {
        parse_added(c);
      } else if (key == "normalizer") {
        normalizer = raw_value(c, json);
      } else if (key == "pre_tokenizer") {
        pre_tokenizer = raw_value(c, json);
      } else if (key == "decoder") {
        decoder = raw_value(c, json);
      } else if (key == "post_processor") {
        post_processor = raw_value(c, json);
      } else {
        c.skip_value();
      }
    });
    cur.finish();
    if (!have_model) moe::detail::fail("text: ", source, ": no \"model\"; not a tokenizer.json");
    parse_normalizer(normalizer);
    parse_pre_tokenizer(pre_tokenizer);
    parse_decoder(decoder);
    post_processor_ = std::string(post_processor);
  }

  void parse_model(io::detail::JsonCursor& cur) {
    std::string type;
    bool have_vocab = false;
    std::vector<std::pair<std::string, std::string>> merges;  // when "merges" precedes "vocab"
    std::int32_t rank = 0;
    std::string joined;
    auto const add_merge = [&](std::string const& a, std::string const& b) {
      if (vocab_.empty()) {
        merges.emplace_back(a, b);
        return;
      }
      joined.assign(a).append(b);
      std::int32_t const ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(joined);
      if (ia < 0 || ib < 0 || iab < 0) {
        moe::detail::fail("text: ", source_, ": merge ", rank, " (",
                          io::detail::printable_name(detail::concat(a, ' ', b)),
                          ") names a token that is not in the vocab");
      }
      merges_.insert(pair_key(ia, ib), {rank++, iab});
    };
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "type") {
        type = c.read_string();
      } else if (key == "vocab") {
        have_vocab = true;
        if (c.peek() != io::detail::JsonKind::kObject) {
          unsupported(source_, "a \"vocab\" that is not an object");
        }
        vocab_.reserve(1 << 18);
        for_members(c, [&](std::string const& token, io::detail::JsonCursor& v) {
          io::detail::JsonNumber const n = v.read_number();
          if (!n.is_u64 || n.value > 0x7FFFFFFF) {
            moe::detail::fail("text: ", source_, ": vocab id of ",
                              io::detail::printable_name(token), " is not an integer in [0, 2^31)");
          }
          vocab_.insert(token, static_cast<std::int32_t>(n.value));
        });
      } else if (key == "merges") {
        merges_.reserve(vocab_.size() + 1024);
        c.begin_array();
        bool first = true;
        while (c.next_element(first)) {
          if (c.peek() == io::detail::JsonKind::kString) {
            std::string const m = c.read_string();
            std::size_t const sp = m.find(' ');
            if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos) {
              moe::detail::fail("text: ", source_, ": merge ", io::detail::printable_name(m),
                                " is not two tokens separated by one space");
            }
            add_merge(m.substr(0, sp), m.substr(sp + 1));
          } else {
            c.begin_array();
            bool f = true;
            std::string parts[2];
            int n = 0;
            while (c.next_element(f)) {
              std::string s = c.read_string();
              if (n < 2) parts[n] = std::move(s);
              ++n;
            }
            if (n != 2) moe::detail::fail("text: ", source_, ": a merge is not a pair of tokens");
            add_merge(parts[0], parts[1]);
          }
        }
      } else if (key == "dropout") {
        if (c.peek() != io::detail::JsonKind::kNull) unsupported(source_, "BPE dropout");
        c.read_null();
      } else if (key == "byte_fallback") {
        byte_fallback_ = c.read_bool();
      } else if (key == "fuse_unk") {
        fuse_unk_ = c.read_bool();
      } else if (key == "unk_token") {
        unk_token_ = read_string_or_null(c);
      } else if (key == "ignore_merges") {
        ignore_merges_ = c.read_bool();
      } else if (key == "continuing_subword_prefix" || key == "end_of_word_suffix") {
        if (!read_string_or_null(c).empty()) unsupported(source_, detail::concat("BPE ", key));
      } else {
        c.skip_value();
      }
    });
    if (type != "BPE") {
      unsupported(source_, detail::concat("model type ", io::detail::printable_name(type)));
    }
    if (!have_vocab) moe::detail::fail("text: ", source_, ": the model has no \"vocab\"");
    if (vocab_.empty() && !merges.empty()) {
      moe::detail::fail("text: ", source_, ": merges but an empty vocab");
    }
    for (auto const& [a, b] : merges) add_merge(a, b);
  }

  void parse_added(io::detail::JsonCursor& cur) {
    cur.begin_array();
    bool first = true;
    while (cur.next_element(first)) {
      AddedToken a;
      bool have_id = false;
      for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
        if (key == "id") {
          io::detail::JsonNumber const n = c.read_number();
          if (!n.is_u64 || n.value > 0x7FFFFFFF) {
            moe::detail::fail("text: ", source_, ": an added token's id is not in [0, 2^31)");
          }
          a.id = static_cast<std::int32_t>(n.value);
          have_id = true;
        } else if (key == "content") {
          a.content = c.read_string();
        } else if (key == "special") {
          a.special = c.read_bool();
        } else if (key == "lstrip") {
          a.lstrip = c.read_bool();
        } else if (key == "rstrip") {
          a.rstrip = c.read_bool();
        } else {
          c.skip_value();
        }
      });
      if (!have_id || a.content.empty()) {
        moe::detail::fail("text: ", source_, ": an added token has no id or an empty content");
      }
      added_.push_back(std::move(a));
    }
  }

  void parse_normalizer(std::string_view json) {
    auto cur = cursor(json, source_);
    if (cur.peek() == io::detail::JsonKind::kNull) return;
    parse_normalizer_object(cur);
  }

  void parse_normalizer_object(io::detail::JsonCursor& cur) {
    std::string type, prepend, content, pattern;
    bool string_pattern = false;
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "type") {
        type = c.read_string();
      } else if (key == "normalizers") {
        c.begin_array();
        bool first = true;
        while (c.next_element(first)) parse_normalizer_object(c);
      } else if (key == "prepend") {
        prepend = c.read_string();
      } else if (key == "content") {
        content = c.read_string();
      } else if (key == "pattern") {
        for_members(c, [&](std::string const& kind, io::detail::JsonCursor& q) {
          string_pattern = kind == "String";
          pattern = q.read_string();
        });
      } else {
        c.skip_value();
      }
    });
    if (type == "NFC") {
      normalizers_.push_back(Normalizer{Normalizer::kNfc, {}, {}});
    } else if (type == "Prepend") {
      normalizers_.push_back(Normalizer{Normalizer::kPrepend, prepend, {}});
    } else if (type == "Replace" && string_pattern && !pattern.empty()) {
      normalizers_.push_back(Normalizer{Normalizer::kReplace, pattern, content});
    } else if (type == "Replace") {
      unsupported(source_, "a Replace normalizer with a regex pattern");
    } else if (type != "Sequence") {
      unsupported(source_, detail::concat("normalizer ", io::detail::printable_name(type)));
    }
  }

  void parse_pre_tokenizer(std::string_view json) {
    auto cur = cursor(json, source_);
    if (cur.peek() == io::detail::JsonKind::kNull) {
      // SentencePiece-style BPE (llama 2, Mixtral): no pre-tokenizer, the normalizer turns
      // spaces into U+2581 and prepends one, BPE runs over characters with byte fallback.
      bool const metaspace =
          std::any_of(normalizers_.begin(), normalizers_.end(), [](Normalizer const& n) {
            return n.kind == Normalizer::kReplace && n.to == detail::kMetaspace;
          });
      if (!byte_fallback_ && !metaspace) {
        unsupported(source_, "a tokenizer without a pre-tokenizer (and not SentencePiece-style)");
      }
      spm_ = true;
      return;
    }
    parse_pre_tokenizer_object(cur);
    if (!byte_level_) unsupported(source_, "a pre-tokenizer without ByteLevel");
  }

  void parse_pre_tokenizer_object(io::detail::JsonCursor& cur) {
    std::string type, pattern, behavior = "Isolated";
    bool literal = false, invert = false, use_regex = true, add_prefix_space = false;
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "type") {
        type = c.read_string();
      } else if (key == "pretokenizers") {
        c.begin_array();
        bool first = true;
        while (c.next_element(first)) parse_pre_tokenizer_object(c);
      } else if (key == "pattern") {
        for_members(c, [&](std::string const& kind, io::detail::JsonCursor& p) {
          literal = kind == "String";
          if (kind != "String" && kind != "Regex") {
            unsupported(source_, detail::concat("a Split pattern of kind ", kind));
          }
          pattern = p.read_string();
        });
      } else if (key == "behavior") {
        behavior = c.read_string();
      } else if (key == "invert") {
        invert = c.read_bool();
      } else if (key == "use_regex") {
        use_regex = c.read_bool();
      } else if (key == "add_prefix_space") {
        add_prefix_space = c.read_bool();
      } else {
        c.skip_value();
      }
    });
    if (type == "Sequence") return;
    if (byte_level_) unsupported(source_, "a pre-tokenizer after ByteLevel");
    if (type == "Split") {
      if (behavior != "Isolated" || invert) {
        unsupported(source_,
                    detail::concat("a Split with behavior ", behavior, invert ? " inverted" : ""));
      }
      splits_.push_back(Split{detail::Regex(pattern, literal, source_), literal ? "" : pattern});
    } else if (type == "ByteLevel") {
      byte_level_ = true;
      add_prefix_space_ = add_prefix_space;
      if (use_regex) {
        splits_.push_back(
            Split{detail::Regex(detail::kGpt2Pattern, false, source_), detail::kGpt2Pattern});
      }
    } else {
      unsupported(source_, detail::concat("pre-tokenizer ", io::detail::printable_name(type)));
    }
  }

  void parse_decoder(std::string_view json) {
    auto cur = cursor(json, source_);
    std::vector<std::string> types;
    if (cur.peek() != io::detail::JsonKind::kNull) parse_decoder_object(cur, types);
    if (!spm_) {
      if (types != std::vector<std::string>{"ByteLevel"}) {
        unsupported(source_,
                    detail::concat("decoder ",
                                   io::detail::printable_name(types.empty() ? "null" : types[0]),
                                   " (ByteLevel expected)"));
      }
      return;
    }
    // SentencePiece-style: Replace(U+2581 -> ' '), ByteFallback, Fuse, Strip(' ', n, 0), which
    // is what decoding by token bytes does (finish()), then strip n leading spaces.
    std::vector<std::string> const spm = {"Replace", "ByteFallback", "Fuse", "Strip"};
    if (types != spm) {
      std::string got;
      for (std::string const& t : types) got += (got.empty() ? "" : ", ") + t;
      unsupported(source_, detail::concat("a SentencePiece-style decoder of ", got,
                                          " (Replace, ByteFallback, Fuse, Strip expected)"));
    }
  }

  /// One decoder (a Sequence's members in order) into `types`; checks the parts that carry
  /// parameters (Replace U+2581 by ' ', Strip of ' ' at the start only).
  void parse_decoder_object(io::detail::JsonCursor& cur, std::vector<std::string>& types) {
    std::string type, content, pattern;
    std::int64_t start = 0, stop = 0;
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "type") {
        type = c.read_string();
      } else if (key == "decoders") {
        c.begin_array();
        bool first = true;
        while (c.next_element(first)) parse_decoder_object(c, types);
      } else if (key == "content") {
        content = c.read_string();
      } else if (key == "pattern") {
        for_members(
            c, [&](std::string const&, io::detail::JsonCursor& q) { pattern = q.read_string(); });
      } else if (key == "start") {
        start = static_cast<std::int64_t>(c.read_number().value);
      } else if (key == "stop") {
        stop = static_cast<std::int64_t>(c.read_number().value);
      } else {
        c.skip_value();
      }
    });
    if (type == "Sequence") return;
    if (type == "Replace" && (pattern != detail::kMetaspace || content != " ")) {
      unsupported(source_, "a Replace decoder other than U+2581 -> ' '");
    }
    if (type == "Strip") {
      if (content != " " || stop != 0 || start < 0) {
        unsupported(source_, "a Strip decoder other than of leading spaces");
      }
      strip_start_ = static_cast<std::size_t>(start);
    }
    types.push_back(type);
  }

  /// The post-processor: ByteLevel or null add nothing; TemplateProcessing's "single" template
  /// adds its special tokens around the text.
  void parse_post_processor() {
    auto cur = cursor(post_processor_, source_);
    if (cur.peek() == io::detail::JsonKind::kNull) return;
    std::string type;
    std::vector<std::string> before, after;
    std::unordered_map<std::string, std::vector<std::int32_t>> special;
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "type") {
        type = c.read_string();
      } else if (key == "single") {
        c.begin_array();
        bool first = true, seen_text = false;
        while (c.next_element(first)) {
          for_members(c, [&](std::string const& kind, io::detail::JsonCursor& p) {
            if (kind == "Sequence") {
              seen_text = true;
              p.skip_value();
            } else if (kind == "SpecialToken") {
              for_members(p, [&](std::string const& k, io::detail::JsonCursor& q) {
                if (k == "id") {
                  (seen_text ? after : before).push_back(q.read_string());
                } else {
                  q.skip_value();
                }
              });
            } else {
              p.skip_value();
            }
          });
        }
      } else if (key == "special_tokens") {
        for_members(c, [&](std::string const& name, io::detail::JsonCursor& s) {
          for_members(s, [&](std::string const& k, io::detail::JsonCursor& q) {
            if (k == "ids") {
              q.begin_array();
              bool f = true;
              while (q.next_element(f)) {
                special[name].push_back(static_cast<std::int32_t>(q.read_number().value));
              }
            } else {
              q.skip_value();
            }
          });
        });
      } else {
        c.skip_value();
      }
    });
    if (type == "ByteLevel") return;
    if (type != "TemplateProcessing") {
      unsupported(source_, detail::concat("post-processor ", io::detail::printable_name(type)));
    }
    auto const ids = [&](std::vector<std::string> const& names, std::vector<std::int32_t>& out) {
      for (std::string const& name : names) {
        auto const it = special.find(name);
        if (it == special.end()) {
          moe::detail::fail("text: ", source_, ": the post-processor's template names ",
                            io::detail::printable_name(name), ", which it does not define");
        }
        out.insert(out.end(), it->second.begin(), it->second.end());
      }
    };
    ids(before, prefix_ids_);
    ids(after, suffix_ids_);
  }

  /// tokenizer_config.json: bos_token / eos_token (a string or an AddedToken object) and
  /// add_bos_token (transformers' Llama tokenizers add BOS when the post-processor does not).
  void parse_config(std::string_view json, std::string_view source) {
    auto cur =
        io::detail::JsonCursor(json, detail::concat("text: ", source), "tokenizer_config.json",
                               "pass a Hugging Face tokenizer_config.json");
    auto const token = [](io::detail::JsonCursor& c) { return detail::config_token(c); };
    for_members(cur, [&](std::string const& key, io::detail::JsonCursor& c) {
      if (key == "bos_token") {
        bos_token_ = token(c);
      } else if (key == "eos_token") {
        eos_token_ = token(c);
      } else if (key == "add_bos_token") {
        add_bos_ = c.read_bool();
      } else {
        c.skip_value();
      }
    });
  }

  void finish() {
    std::int32_t max_id = -1;
    vocab_.for_each([&](std::string const&, std::int32_t id) { max_id = std::max(max_id, id); });
    for (AddedToken const& a : added_) max_id = std::max(max_id, a.id);
    auto const n = static_cast<std::size_t>(max_id + 1);
    id_bytes_.assign(n, std::string());
    has_id_.assign(n, false);
    is_special_.assign(n, false);
    // Byte-level tokens back to bytes; a token with a character outside the byte alphabet is
    // its own UTF-8 (tokenizers' ByteLevel decoder does the same).
    std::array<std::int16_t, 512> to_byte;  // code point -> byte, -1 for none
    to_byte.fill(-1);
    auto const& table = detail::byte_to_code_point();
    for (int b = 0; b < 256; ++b) to_byte[table[b]] = static_cast<std::int16_t>(b);
    auto const bytes_of = [&](std::string const& token) {
      if (spm_) return detail::spm_bytes(token);
      std::string out;
      std::size_t i = 0;
      while (i < token.size()) {
        std::uint32_t const cp = detail::next_code_point(token, i);
        if (cp >= to_byte.size() || to_byte[cp] < 0) return token;
        out += static_cast<char>(to_byte[cp]);
      }
      return out;
    };
    vocab_.for_each([&](std::string const& token, std::int32_t id) {
      id_bytes_[id] = bytes_of(token);
      has_id_[id] = true;
    });
    for (AddedToken const& a : added_) {
      id_bytes_[a.id] = spm_ ? a.content : bytes_of(a.content);
      has_id_[a.id] = true;
      is_special_[a.id] = a.special;
    }
    for (int b = 0; b < 256; ++b) {
      std::string s;
      if (spm_) {
        s = detail::byte_token(static_cast<unsigned char>(b));
      } else {
        detail::append_utf8(s, table[b]);
      }
      byte_ids_[b] = vocab_.find(s);
    }
    if (!unk_token_.empty()) {
      if (std::int32_t const id = vocab_.find(unk_token_); id >= 0) unk_id_ = id;
    }
    // Added tokens by first byte, longest first.
    std::vector<std::size_t> order(added_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return added_[a].content.size() > added_[b].content.size();
    });
    for (std::size_t const i : order) {
      added_by_byte_[static_cast<unsigned char>(added_[i].content[0])].push_back(i);
    }
    parse_post_processor();
    if (auto const id = named_id(bos_token_)) bos_id_ = id;
    if (auto const id = named_id(eos_token_)) eos_id_ = id;
    if (add_bos_ && prefix_ids_.empty() && bos_id_) prefix_ids_.push_back(*bos_id_);
  }

  std::optional<std::int32_t> named_id(std::string const& token) const {
    if (token.empty()) return std::nullopt;
    return token_to_id(token);
  }

  // --- encoding ------------------------------------------------------------------------------

  AddedToken const* match_added(std::string_view text, std::size_t i) const {
    for (std::size_t const k : added_by_byte_[static_cast<unsigned char>(text[i])]) {
      AddedToken const& a = added_[k];
      if (text.compare(i, a.content.size(), a.content) == 0) return &a;
    }
    return nullptr;
  }

  void encode_segment(std::string_view text, std::vector<std::int32_t>& ids) const {
    std::string normalized;
    for (Normalizer const& n : normalizers_) {
      if (n.kind == Normalizer::kNfc) {
        normalized = detail::nfc(text);
      } else if (n.kind == Normalizer::kPrepend) {
        if (text.empty()) continue;  // tokenizers' Prepend leaves an empty text empty
        normalized = n.from + std::string(text);
      } else {
        normalized = detail::replace_all(text, n.from, n.to);
      }
      text = normalized;
    }
    std::string prefixed;
    if (add_prefix_space_ && !text.empty() && text[0] != ' ') {
      prefixed.reserve(text.size() + 1);
      prefixed += ' ';
      prefixed += text;
      text = prefixed;
    }
    split_from(0, text, ids);
  }

  /// Applies splits_[level..] to `text`, then BPE to each piece.
  void split_from(std::size_t level, std::string_view text, std::vector<std::int32_t>& ids) const {
    if (level == splits_.size()) return bpe(text, ids);
    splits_[level].regex.split(text, [&](std::size_t b, std::size_t e, bool) {
      split_from(level + 1, text.substr(b, e - b), ids);
    });
  }

  /// Byte-level BPE of one pre-token: merges by rank (leftmost first among equal ranks), as
  /// tokenizers' Word::merge_all does it.
  void bpe(std::string_view piece, std::vector<std::int32_t>& ids) const {
    if (ignore_merges_) {
      std::string token;
      auto const& table = detail::byte_to_code_point();
      for (char const c : piece) detail::append_utf8(token, table[static_cast<unsigned char>(c)]);
      if (std::int32_t const id = vocab_.find(token); id >= 0) {
        ids.push_back(id);
        return;
      }
    }
    struct Symbol {
      std::int32_t id;
      std::int32_t prev;
      std::int32_t next;
      bool alive;
    };
    std::vector<Symbol> sym;
    sym.reserve(piece.size());
    auto const push = [&](std::int32_t id) {
      auto const n = static_cast<std::int32_t>(sym.size());
      sym.push_back(Symbol{id, n - 1, n + 1, true});
    };
    if (spm_) {
      // SentencePiece-style: one symbol per character; a character not in the vocabulary
      // becomes its UTF-8 bytes' <0xNN> tokens (byte_fallback), else the unknown token.
      for (std::size_t i = 0; i < piece.size();) {
        std::size_t const start = i;
        detail::next_code_point(piece, i);
        std::string_view const ch = piece.substr(start, i - start);
        if (std::int32_t const id = vocab_.find(ch); id >= 0) {
          push(id);
          continue;
        }
        bool bytes = byte_fallback_;
        for (char const b : ch) bytes = bytes && byte_ids_[static_cast<unsigned char>(b)] >= 0;
        if (bytes) {
          for (char const b : ch) push(byte_ids_[static_cast<unsigned char>(b)]);
        } else if (unk_id_ && !(fuse_unk_ && !sym.empty() && sym.back().id == *unk_id_)) {
          push(*unk_id_);
        } else if (!unk_id_) {
          moe::detail::fail("text: ", source_, ": no token for the character ",
                            io::detail::printable_name(ch), " and no unknown token");
        }
      }
    }
    for (std::size_t i = 0; !spm_ && i < piece.size(); ++i) {
      std::int32_t const id = byte_ids_[static_cast<unsigned char>(piece[i])];
      if (id < 0) {
        moe::detail::fail("text: ", source_, ": the vocab has no token for byte ",
                          static_cast<int>(static_cast<unsigned char>(piece[i])),
                          "; not a byte-level BPE vocabulary");
      }
      auto const n = static_cast<std::int32_t>(i);
      sym.push_back(Symbol{id, n - 1, n + 1, true});
    }
    if (sym.size() > 1) {
      struct Candidate {
        std::int32_t rank, pos, id;
        bool operator>(Candidate const& o) const noexcept {
          return rank != o.rank ? rank > o.rank : pos > o.pos;
        }
      };
      std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
      auto const n = static_cast<std::int32_t>(sym.size());
      auto const consider = [&](std::int32_t pos) {
        std::int32_t const next = sym[pos].next;
        if (next >= n) return;
        if (auto const* m = merges_.find(pair_key(sym[pos].id, sym[next].id))) {
          queue.push(Candidate{m->rank, pos, m->id});
        }
      };
      for (std::int32_t i = 0; i + 1 < n; ++i) consider(i);
      while (!queue.empty()) {
        Candidate const top = queue.top();
        queue.pop();
        Symbol& left = sym[top.pos];
        if (!left.alive || left.next >= n) continue;
        Symbol& right = sym[left.next];
        auto const* m = merges_.find(pair_key(left.id, right.id));
        if (m == nullptr || m->id != top.id) continue;
        left.id = top.id;
        right.alive = false;
        left.next = right.next;
        if (right.next < n) sym[right.next].prev = top.pos;
        if (left.prev >= 0) consider(left.prev);
        consider(top.pos);
      }
    }
    for (Symbol const& s : sym) {
      if (s.alive) ids.push_back(s.id);
    }
  }

  std::string source_;
  detail::TokenTable vocab_;
  detail::MergeTable merges_;
  std::vector<AddedToken> added_;
  std::array<std::vector<std::size_t>, 256> added_by_byte_{};
  std::array<std::int32_t, 256> byte_ids_{};
  std::vector<Split> splits_;
  std::vector<std::string> id_bytes_;
  std::vector<bool> has_id_, is_special_;
  std::vector<std::int32_t> prefix_ids_, suffix_ids_;
  std::string post_processor_, bos_token_, eos_token_;
  std::optional<std::int32_t> bos_id_, eos_id_, eot_id_, pad_id_;
  bool byte_level_ = false, add_prefix_space_ = false, ignore_merges_ = false;
  /// SentencePiece-style BPE: characters, byte fallback, U+2581 for spaces (llama 2, Mixtral).
  bool spm_ = false, byte_fallback_ = false, fuse_unk_ = false;
  std::string unk_token_;
  std::optional<std::int32_t> unk_id_;
  std::size_t strip_start_ = 0;  ///< leading spaces the decoder strips (SentencePiece: 1)
  struct Normalizer {
    enum Kind { kNfc, kPrepend, kReplace } kind;
    std::string from, to;  ///< kPrepend: from is the prefix
  };
  std::vector<Normalizer> normalizers_;
  bool add_bos_ = false;
};

/// Turns ids into text as they are produced: push() returns the text of the whole UTF-8
/// characters completed so far (a character split over several tokens is held back until its
/// last byte arrives; bytes that can never form a character become U+FFFD), finish() the rest.
class StreamDecoder {
 public:
  explicit StreamDecoder(Tokenizer const& tokenizer, bool skip_special_tokens = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {}

  std::string push(std::int32_t id) {
    tokenizer_->append_bytes(id, skip_special_, pending_);
    if (at_start_ && !pending_.empty()) {  // the decoder's strip of the text's first spaces
      std::size_t const n = tokenizer_->leading_spaces(pending_);
      if (n == pending_.size() && n < tokenizer_->leading_spaces(std::string(8, ' '))) {
        return {};  // only spaces so far, fewer than it strips: wait for more
      }
      pending_.erase(0, n);
      at_start_ = false;
    }
    // Everything up to the start of a trailing incomplete (but still possible) character.
    std::size_t cut = pending_.size();
    std::size_t i = 0;
    while (i < pending_.size()) {
      bool complete = false;
      std::size_t const n = detail::utf8_prefix(pending_, i, complete);
      if (!complete && i + n == pending_.size() && n < 4 &&
          static_cast<unsigned char>(pending_[i]) >= 0xC2 &&
          static_cast<unsigned char>(pending_[i]) <= 0xF4) {
        cut = i;
        break;
      }
      i += n;
    }
    std::string out = detail::utf8_lossy(std::string_view(pending_).substr(0, cut));
    pending_.erase(0, cut);
    return out;
  }

  /// The held-back bytes (U+FFFD for an unfinished character), and a reset.
  std::string finish() {
    if (at_start_) pending_.erase(0, tokenizer_->leading_spaces(pending_));
    std::string out = detail::utf8_lossy(pending_);
    pending_.clear();
    at_start_ = true;
    return out;
  }

 private:
  Tokenizer const* tokenizer_;
  bool skip_special_;
  bool at_start_ = true;
  std::string pending_;
};

}  // namespace moe::text
