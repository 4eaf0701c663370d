// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// set_gguf_tokenizer: the tokenizer.ggml.* metadata llama.cpp's convert_hf_to_gguf.py writes
/// for a Hugging Face tokenizer (tokenizer.json and tokenizer_config.json), for the GGUF files
/// moe writes (models::save_gguf_model, moe_quantize --out FILE.gguf), so that they carry their
/// tokenizer as the files people download do (Tokenizer::from_gguf reads it back).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/gguf/writer.hpp"
#include "moe/text/tokenizer.hpp"

namespace moe::text {

/// Sets on `w` the tokenizer.ggml.* metadata (and tokenizer.chat_template) llama.cpp's
/// convert_hf_to_gguf.py writes for the tokenizer in `tokenizer_json`, with its
/// tokenizer_config.json beside it when there is one (Model.get_vocab_base and gguf-py's
/// SpecialVocab):
/// - byte-level BPE: model "gpt2", pre = Tokenizer::gguf_pre() (the name llama.cpp gives the
///   tokenizer's splits), the merges as "a b";
/// - SentencePiece BPE (Llama 2, Mixtral): model "llama", byte tokens (<0xNN>) of type 6,
///   <unk> of type 2, add_space_prefix, and scores. A tokenizer.json has no scores (those are in
///   tokenizer.model): a piece scores minus (1 + the rank of the first merge making it), the
///   order transformers' converter gave the merges, and -1e9 where no merge makes it;
/// - tokens in id order up to `vocab_size` (the embedding's rows): "[PAD<i>]" of type 5 where no
///   token has id i, type 3 for an added token that is special or looks special ("<|...|>",
///   "<｜...｜>"), 4 for another added token, 1 otherwise;
/// - bos / eos / padding ids from tokenizer_config.json's tokens, add_bos_token and
///   add_eos_token when it has them, and its chat template.
/// Returns the pre name ("" for SentencePiece). Throws moe::Error naming the file when llama.cpp
/// has no name for the tokenizer's pre-tokenizer, when an id is not below `vocab_size`, and for
/// malformed files.
inline std::string set_gguf_tokenizer(io::GgufWriter& w,
                                      std::filesystem::path const& tokenizer_json,
                                      std::size_t vocab_size) {
  using io::GgufMetadataValue;
  Tokenizer const parsed = Tokenizer::from_hf_file(tokenizer_json);
  std::optional<std::string> const pre = parsed.gguf_pre();
  moe::detail::check(pre.has_value(), "text: ", tokenizer_json.string(),
                     ": llama.cpp has no tokenizer.ggml.pre name for this tokenizer's "
                     "pre-tokenizer (its splits are none of ",
                     detail::kGgufPreNames, "'s); the GGUF file cannot carry it");
  std::string const json = detail::read_file(tokenizer_json);
  std::map<std::int32_t, std::string> tokens;
  std::map<std::int32_t, int> types;
  std::vector<std::string> merges;
  std::map<std::int32_t, std::pair<std::string, int>> added;  // after the vocab: they win
  io::detail::JsonCursor c(json, tokenizer_json.string(), "tokenizer.json", "");
  detail::for_members(c, [&](std::string const& key, auto& cur) {
    if (key == "model") {
      detail::for_members(cur, [&](std::string const& k, auto& m) {
        if (k == "vocab") {
          detail::for_members(m, [&](std::string const& token, auto& v) {
            auto const id = static_cast<std::int32_t>(v.read_number().value);
            tokens[id] = token;
            types[id] = 1;
          });
        } else if (k == "merges") {
          m.begin_array();
          bool first = true;
          while (m.next_element(first)) {
            if (m.peek() == io::detail::JsonKind::kString) {
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
        detail::for_members(cur, [&](std::string const& k, auto& a) {
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
  moe::detail::check(
      tokens.empty() || (tokens.begin()->first >= 0 &&
                         static_cast<std::size_t>(tokens.rbegin()->first) < vocab_size),
      "text: ", tokenizer_json.string(), ": token ids run from ",
      tokens.empty() ? 0 : tokens.begin()->first, " to ",
      tokens.empty() ? 0 : tokens.rbegin()->first, ", outside the model's ", vocab_size,
      " embedding rows; the tokenizer belongs to another model");
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
  w.set("tokenizer.ggml.tokens", GgufMetadataValue::array(list));
  if (pre->empty()) {
    std::map<std::string, std::size_t> first_merge;
    for (std::size_t r = 0; r < merges.size(); ++r) {
      std::string joined = merges[r];
      if (std::size_t const sp = joined.find(' '); sp != std::string::npos) joined.erase(sp, 1);
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
        .set("tokenizer.ggml.pre", *pre)
        .set("tokenizer.ggml.token_type", GgufMetadataValue::array(type_list))
        .set("tokenizer.ggml.merges", GgufMetadataValue::array(merges));
  }
  std::filesystem::path const config = tokenizer_json.parent_path() / "tokenizer_config.json";
  if (!std::filesystem::exists(config)) return *pre;
  std::string const config_text = detail::read_file(config);
  io::detail::JsonCursor k(config_text, config.string(), "tokenizer_config.json", "");
  auto const id_of = [&](std::string const& content) -> std::optional<std::uint32_t> {
    for (auto const& [id, t] : tokens) {
      if (t == content && types[id] != 1) return static_cast<std::uint32_t>(id);
    }
    return std::nullopt;
  };
  detail::for_members(k, [&](std::string const& key, auto& cur) {
    std::map<std::string, std::string> const ids = {
        {"bos_token", "tokenizer.ggml.bos_token_id"},
        {"eos_token", "tokenizer.ggml.eos_token_id"},
        {"pad_token", "tokenizer.ggml.padding_token_id"}};
    if (ids.count(key) != 0) {
      if (auto const id = id_of(detail::config_token(cur))) w.set(ids.at(key), *id);
    } else if (key == "add_bos_token" || key == "add_eos_token") {
      w.set("tokenizer.ggml." + key, cur.read_bool());
    } else if (key == "chat_template" && cur.peek() == io::detail::JsonKind::kString) {
      w.set("tokenizer.chat_template", cur.read_string());
    } else {
      cur.skip_value();
    }
  });
  return *pre;
}

}  // namespace moe::text
