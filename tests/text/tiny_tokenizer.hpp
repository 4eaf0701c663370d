// SPDX-License-Identifier: Apache-2.0
// A tiny hand-written Qwen-style tokenizer (byte-level BPE, Qwen2's split, ChatML special
// tokens and chat template) whose ids the tests work out by hand: the unit tests of
// load_model_tokenizer and the moe_generate command-line test share it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace tinytok {

// Ids: the three special tokens, the characters, then the merged tokens in merge order.
enum : std::int32_t {
  kEndOfText = 0,  // <|endoftext|>
  kImStart = 1,    // <|im_start|>
  kImEnd = 2,      // <|im_end|>
  kA = 3,
  kD,
  kE,
  kH,
  kI,
  kL,
  kN,
  kO,
  kR,
  kS,
  kT,
  kU,
  kW,             // a d e h i l n o r s t u w
  kSpace = 16,    // Ġ
  kNewline = 17,  // Ċ
  kBang = 18,     // !
  kComma = 19,    // ,
  kHe = 20,
  kLl,
  kHell,
  kHello,
  kSpaceW,
  kOr,
  kSpaceWor,
  kSpaceWorl,
  kSpaceWorld,
  kUs,
  kUse,
  kUser,
  kVocab = 32
};

inline constexpr char kTokenizerJson[] = R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 0, "content": "<|endoftext|>", "special": true, "lstrip": false, "rstrip": false},
    {"id": 1, "content": "<|im_start|>", "special": true, "lstrip": false, "rstrip": false},
    {"id": 2, "content": "<|im_end|>", "special": true, "lstrip": false, "rstrip": false}],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
  "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false},
  "decoder": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false},
  "model": {"type": "BPE", "dropout": null, "unk_token": null,
    "vocab": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2,
      "a": 3, "d": 4, "e": 5, "h": 6, "i": 7, "l": 8, "n": 9, "o": 10, "r": 11, "s": 12,
      "t": 13, "u": 14, "w": 15, "Ġ": 16, "Ċ": 17, "!": 18, ",": 19,
      "he": 20, "ll": 21, "hell": 22, "hello": 23, "Ġw": 24, "or": 25, "Ġwor": 26, "Ġworl": 27,
      "Ġworld": 28, "us": 29, "use": 30, "user": 31},
    "merges": ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
               "u s", "us e", "use r"]}
})";

inline constexpr char kChatTemplate[] =
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- endif %}";

inline void write(std::filesystem::path const& p, std::string_view text) {
  std::ofstream out(p, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

/// Writes tokenizer.json, tokenizer_config.json (EOS <|im_end|>, no BOS, the ChatML template)
/// and generation_config.json (eos_token_id [2, 0]) into `dir`.
inline void write_files(std::filesystem::path const& dir) {
  write(dir / "tokenizer.json", kTokenizerJson);
  write(dir / "tokenizer_config.json",
        std::string(R"({"add_bos_token": false, "bos_token": null, "eos_token": "<|im_end|>", )") +
            R"("pad_token": "<|endoftext|>", "chat_template": ")" + kChatTemplate + "\"}");
  write(dir / "generation_config.json", R"({"eos_token_id": [2, 0], "do_sample": false})");
}

}  // namespace tinytok
