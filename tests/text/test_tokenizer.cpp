// SPDX-License-Identifier: Apache-2.0
// moe::text::Tokenizer on tiny hand-written tokenizer.json documents whose ids are worked out by
// hand: BPE by merge rank, both merge forms, the GPT-2 and a Qwen-style Split pre-tokenizer,
// added tokens (longest first, lstrip/rstrip), the post-processor's BOS, decode and the
// streaming decoder, and one-line errors for what is not supported.
#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "moe/text/tokenizer.hpp"

namespace {

using Catch::Contains;
using moe::text::StreamDecoder;
using moe::text::Tokenizer;
using Ids = std::vector<std::int32_t>;

// Byte-level forms: ' ' is "Ġ" (U+0120), 0xC3 is "Ã" and 0xA9 is "©" (the two bytes of é).
constexpr char kVocab[] = R"("vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "abc": 5,
    "Ġa": 6, "1": 11, "2": 12, "Ã": 13, "©": 14, "Ã©": 15, "<|x|>": 7, "<|x|>y": 8, "y": 9})";

std::string document(std::string const& merges, std::string const& pre_tokenizer,
                     std::string const& extra = "") {
  return R"({"version": "1.0", "added_tokens": [
      {"id": 7, "content": "<|x|>", "special": true, "lstrip": false, "rstrip": false},
      {"id": 8, "content": "<|x|>y", "special": true, "lstrip": false, "rstrip": false}],
    "normalizer": null, "pre_tokenizer": )" +
         pre_tokenizer + R"(, "decoder": {"type": "ByteLevel"}, )" + extra +
         R"( "model": {"type": "BPE", "dropout": null, "unk_token": null, )" + kVocab +
         R"(, "merges": )" + merges + "}}";
}

constexpr char kStringMerges[] = R"(["a b", "ab c", "Ġ a", "Ã ©"])";
constexpr char kArrayMerges[] = R"([["a", "b"], ["ab", "c"], ["Ġ", "a"], ["Ã", "©"]])";
constexpr char kGpt2[] = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
constexpr char kQwen[] = R"({"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})";

}  // namespace

TEST_CASE("tokenizer: BPE merges by rank, string and array merges alike", "[text]") {
  for (char const* merges : {kStringMerges, kArrayMerges}) {
    Tokenizer const t = Tokenizer::from_hf_json(document(merges, kGpt2));
    // "abc" -> a b c -> ab c (rank 0) -> abc (rank 1); " ab" -> Ġ a b: (a,b) rank 0 beats
    // (Ġ,a) rank 2, then (Ġ,ab) has no merge.
    CHECK(t.encode("abc ab") == Ids{5, 3, 4});
    CHECK(t.encode(" a") == Ids{6});
    CHECK(t.encode("ba") == Ids{1, 0});
    CHECK(t.encode("é") == Ids{15});
    CHECK(t.encode("") == Ids{});
    CHECK(t.decode(Ids{5, 3, 4}) == "abc ab");
    CHECK(t.vocab_size() == 16);
    CHECK(t.token_to_id("Ġa") == 6);
    CHECK_FALSE(t.token_to_id("zz").has_value());
  }
}

TEST_CASE("tokenizer: added tokens are matched first, longest first", "[text]") {
  Tokenizer const t = Tokenizer::from_hf_json(document(kStringMerges, kGpt2));
  CHECK(t.encode("ab<|x|>c") == Ids{4, 7, 2});
  CHECK(t.encode("<|x|>y") == Ids{8});
  CHECK(t.encode("<|x|>yy") == Ids{8, 9});
  CHECK_THROWS_WITH(t.encode("<|x|"), Contains("no token for byte 60"));  // '<' not in the vocab
  CHECK(t.decode(Ids{4, 7, 2}) == "ab<|x|>c");
  CHECK(t.decode(Ids{4, 7, 2}, /*skip_special_tokens=*/true) == "abc");
  CHECK(t.is_special(7));
  CHECK_FALSE(t.is_special(4));
}

TEST_CASE("tokenizer: lstrip and rstrip added tokens absorb the whitespace around them", "[text]") {
  std::string doc = document(kStringMerges, kGpt2);
  std::string const plain = R"("lstrip": false, "rstrip": false}],)";
  doc.replace(doc.find(plain), plain.size(), R"("lstrip": true, "rstrip": true}],)");
  Tokenizer const t = Tokenizer::from_hf_json(doc);
  CHECK(t.encode("a  <|x|>y  b") == Ids{0, 8, 1});
}

TEST_CASE("tokenizer: a Qwen-style Split regex with Unicode classes, then ByteLevel", "[text]") {
  Tokenizer const t = Tokenizer::from_hf_json(document(kStringMerges, kQwen));
  // \p{N} takes one digit at a time; "ab" is one letter run; " a" a space-led letter run.
  CHECK(t.encode("ab12 a") == Ids{4, 11, 12, 6});
  CHECK(t.decode(t.encode("ab12 a")) == "ab12 a");
}

TEST_CASE("tokenizer: ignore_merges takes a whole pre-token found in the vocab", "[text]") {
  std::string doc = document(R"(["a b"])", kGpt2);
  CHECK(Tokenizer::from_hf_json(doc).encode("abc") == Ids{4, 2});
  doc.replace(doc.find(R"("dropout": null)"), 15, R"("ignore_merges": true)");
  CHECK(Tokenizer::from_hf_json(doc).encode("abc") == Ids{5});
}

TEST_CASE("tokenizer: a TemplateProcessing post-processor adds BOS unless asked not to", "[text]") {
  Tokenizer const t = Tokenizer::from_hf_json(
      document(kStringMerges, kGpt2,
               R"("post_processor": {"type": "TemplateProcessing", "single": [
           {"SpecialToken": {"id": "<|x|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "special_tokens": {"<|x|>": {"id": "<|x|>", "ids": [7], "tokens": ["<|x|>"]}}},)"));
  CHECK(t.encode("ab") == Ids{7, 4});
  CHECK(t.encode("ab", /*add_special_tokens=*/false) == Ids{4});
  // tokenizer_config.json's add_bos_token with a ByteLevel post-processor (DeepSeek-V3).
  Tokenizer const c = Tokenizer::from_hf_json(
      document(kStringMerges, kGpt2), R"({"add_bos_token": true, "bos_token": {"content": "<|x|>"},
      "eos_token": "y"})");
  CHECK(c.encode("ab") == Ids{7, 4});
  CHECK(c.bos_id() == 7);
  CHECK(c.eos_id() == 9);
}

TEST_CASE("tokenizer: the stream decoder emits whole UTF-8 characters only", "[text]") {
  Tokenizer const t = Tokenizer::from_hf_json(document(kStringMerges, kGpt2));
  StreamDecoder d(t);
  CHECK(d.push(4) == "ab");
  CHECK(d.push(13).empty());  // 0xC3: the first byte of é
  CHECK(d.push(14) == "\xC3\xA9");
  CHECK(d.push(13).empty());
  CHECK(d.push(0) ==
        "\xEF\xBF\xBD"
        "a");  // 0xC3 then 'a': never a character
  CHECK(d.push(13).empty());
  CHECK(d.finish() == "\xEF\xBF\xBD");
  CHECK(t.decode(Ids{14, 0}) ==
        "\xEF\xBF\xBD"
        "a");  // a lone continuation byte
}

TEST_CASE("tokenizer: errors are one line naming what is wrong", "[text]") {
  auto const load = [](std::string const& doc) {
    return Tokenizer::from_hf_json(doc, {}, "t.json");
  };
  CHECK_THROWS_WITH(load("{"), Contains("t.json") && Contains("not valid JSON"));
  CHECK_THROWS_WITH(load("{}"), Contains("no \"model\""));
  std::string doc = document(kStringMerges, kGpt2);
  CHECK_THROWS_WITH(load(std::string(doc).replace(doc.find("\"BPE\""), 5, "\"WordPiece\"")),
                    Contains("model type 'WordPiece' is not supported yet"));
  CHECK_THROWS_WITH(load(std::string(doc).replace(doc.find("\"normalizer\": null"), 18,
                                                  R"("normalizer": {"type": "Lowercase"})")),
                    Contains("normalizer 'Lowercase' is not supported yet"));
  CHECK_THROWS_WITH(load(document(kStringMerges, R"({"type": "Whitespace"})")),
                    Contains("pre-tokenizer 'Whitespace' is not supported yet"));
  CHECK_THROWS_WITH(load(document(R"(["a q"])", kGpt2)),
                    Contains("merge 0 ('a q') names a token that is not in the vocab"));
  CHECK_THROWS_WITH(load(document(kStringMerges, R"({"type": "Split", "pattern": {"Regex": "(("},
                                                    "behavior": "Isolated", "invert": false})")),
                    Contains("does not compile with PCRE2"));
  Tokenizer const t = load(doc);
  CHECK_THROWS_WITH(t.encode("a\xFF"), Contains("not well-formed UTF-8 at byte 1"));
  CHECK_THROWS_WITH(t.decode(Ids{99}), Contains("token id 99 is not in the vocabulary"));
}

TEST_CASE("tokenizer: SentencePiece-style BPE (llama 2): U+2581, byte fallback, BOS, strip",
          "[text]") {
  // llama 2's tokenizer.json parts: Prepend + Replace normalizers, no pre-tokenizer, BPE over
  // characters with byte_fallback and fuse_unk, <s> from the post-processor, and the decoder
  // Replace(U+2581 -> ' '), ByteFallback, Fuse, Strip(1 leading space).
  std::string const json = R"({"version": "1.0", "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true, "lstrip": false, "rstrip": false},
      {"id": 1, "content": "<s>", "special": true, "lstrip": false, "rstrip": false},
      {"id": 2, "content": "</s>", "special": true, "lstrip": false, "rstrip": false}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
      {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true,
      "byte_fallback": true,
      "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "▁": 5, "a": 6,
                "b": 7, "▁a": 8, "ab": 9, "▁ab": 10},
      "merges": ["▁ a", "a b", "▁a b"]}})";
  Tokenizer const t = Tokenizer::from_hf_json(json);
  // "ab" -> "▁ab": (▁,a) rank 0 before (a,b) rank 1, then (▁a,b) rank 2.
  CHECK(t.encode("ab") == Ids{1, 10});
  CHECK(t.encode("ab", false) == Ids{10});
  CHECK(t.encode("a b", false) == Ids{8, 5, 7});
  // é is not in the vocabulary: its two UTF-8 bytes' tokens.
  CHECK(t.encode("é", false) == Ids{5, 3, 4});
  // c has no token and no byte token: one <unk> for the run (fuse_unk).
  CHECK(t.encode("cc", false) == Ids{5, 0});
  CHECK(t.encode("", false) == Ids{});
  // After an added token the next text gets its own U+2581 (per segment, as transformers).
  CHECK(t.encode("</s>ab", false) == Ids{2, 10});
  CHECK(t.decode(Ids{10}) == "ab");  // the prepended space is stripped
  CHECK(t.decode(Ids{8, 5, 7}) == "a b");
  CHECK(t.decode(Ids{5, 3, 4}) == "é");
  CHECK(t.decode(Ids{1, 10}) == "<s> ab");
  CHECK(t.decode(Ids{1, 10}, /*skip_special_tokens=*/true) == "ab");
  StreamDecoder stream(t);
  std::string text;
  for (std::int32_t const id : Ids{8, 5, 3, 4}) text += stream.push(id);
  text += stream.finish();
  CHECK(text == "a é");
}
