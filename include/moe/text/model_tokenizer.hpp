// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// moe::text::load_model_tokenizer: the tokenizer of a model path (a Hugging Face model
/// directory or a GGUF file) with what generation needs besides it: whether BOS is added, the
/// ids that end generation, and the chat format its template is recognised as (ChatML,
/// DeepSeek-V3, gpt-oss harmony), with the one-user-turn prompt of each format.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/gguf/model.hpp"
#include "moe/text/tokenizer.hpp"

namespace moe::text {

/// The chat formats moe can wrap a prompt in, recognised from a model's chat template.
enum class ChatFormat {
  kUnknown,     ///< no template, or one moe does not recognise
  kChatMl,      ///< <|im_start|>role\n...<|im_end|> (Qwen2, Qwen3, Qwen3-MoE)
  kDeepSeekV3,  ///< {bos}<｜User｜>...<｜Assistant｜> (DeepSeek-V3)
  kHarmony,     ///< gpt-oss's harmony: <|start|>role<|message|>...<|end|>
};

/// "ChatML", "DeepSeek-V3", "gpt-oss harmony" or "unknown".
inline std::string_view name(ChatFormat f) noexcept {
  switch (f) {
    case ChatFormat::kChatMl:
      return "ChatML";
    case ChatFormat::kDeepSeekV3:
      return "DeepSeek-V3";
    case ChatFormat::kHarmony:
      return "gpt-oss harmony";
    case ChatFormat::kUnknown:
      break;
  }
  return "unknown";
}

/// The format a Jinja chat template writes, recognised by the markers it emits: harmony's
/// <|start|>, <|message|> and <|channel|>; ChatML's <|im_start|>; DeepSeek-V3's <｜User｜> and
/// <｜Assistant｜>. kUnknown for anything else (an empty template included).
inline ChatFormat detect_chat_format(std::string_view chat_template) noexcept {
  auto const has = [&](std::string_view s) { return chat_template.find(s) != std::string::npos; };
  if (has("<|start|>") && has("<|message|>") && has("<|channel|>")) return ChatFormat::kHarmony;
  if (has("<|im_start|>")) return ChatFormat::kChatMl;
  if (has("<\xEF\xBD\x9CUser\xEF\xBD\x9C>") && has("<\xEF\xBD\x9C"
                                                   "Assistant\xEF\xBD\x9C>")) {
    return ChatFormat::kDeepSeekV3;
  }
  return ChatFormat::kUnknown;
}

/// Today's date as YYYY-MM-DD in local time (what the harmony template's strftime_now gives).
inline std::string today() {
  std::time_t const now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[16] = {};
  std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
  return buf;
}

/// `user` as the one user message of a conversation, followed by the prompt that asks for the
/// assistant's reply: what the family's chat template renders for
/// messages = [{"role": "user", "content": user}] with add_generation_prompt = true and no other
/// variables set.
///   ChatML:      <|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n
///   DeepSeek-V3: {bos}<｜User｜>{user}<｜Assistant｜>
///   harmony:     <|start|>system<|message|>You are ChatGPT, a large language model trained by
///                OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium
///                \n\n# Valid channels: analysis, commentary, final. Channel must be included for
///                every message.<|end|><|start|>user<|message|>{user}<|end|><|start|>assistant
/// `bos` is the BOS token's text (DeepSeek-V3's template writes it), `date` YYYY-MM-DD (harmony).
/// Throws moe::Error for kUnknown.
inline std::string chat_prompt(ChatFormat format, std::string_view user, std::string_view bos,
                               std::string_view date) {
  std::string out;
  switch (format) {
    case ChatFormat::kChatMl:
      out.append("<|im_start|>user\n").append(user).append("<|im_end|>\n<|im_start|>assistant\n");
      return out;
    case ChatFormat::kDeepSeekV3:
      out.append(bos)
          .append("<\xEF\xBD\x9CUser\xEF\xBD\x9C>")
          .append(user)
          .append(
              "<\xEF\xBD\x9C"
              "Assistant\xEF\xBD\x9C>");
      return out;
    case ChatFormat::kHarmony:
      out.append(
             "<|start|>system<|message|>You are ChatGPT, a large language model trained by "
             "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ")
          .append(date)
          .append(
              "\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel "
              "must be included for every message.<|end|><|start|>user<|message|>")
          .append(user)
          .append("<|end|><|start|>assistant");
      return out;
    case ChatFormat::kUnknown:
      break;
  }
  moe::detail::fail(
      "text: chat_prompt: the model's chat template is not one moe recognises (ChatML, "
      "DeepSeek-V3, gpt-oss harmony); wrap the prompt yourself and pass it as plain text");
}

/// A model's tokenizer and what generation needs besides it (load_model_tokenizer).
struct ModelTokenizer {
  Tokenizer tokenizer;
  /// What was read: the tokenizer.json or the .gguf file.
  std::string source;
  /// The ids that end generation, ascending, without repeats: the tokenizer's EOS, a GGUF
  /// file's EOT, generation_config.json's eos_token_id (a number or a list) next to a
  /// tokenizer.json, and the end-of-turn tokens of the chat format (ChatML <|im_end|>, harmony
  /// <|return|> and <|call|>) when the vocabulary has them.
  std::vector<std::int32_t> end_ids;
  /// The Jinja chat template (tokenizer_config.json's chat_template, chat_template.jinja, or
  /// GGUF tokenizer.chat_template); empty when the model has none.
  std::string chat_template;
  /// What chat_template was recognised as.
  ChatFormat chat = ChatFormat::kUnknown;

  /// Whether encode_prompt() puts BOS first (the model's own choice: tokenizer_config.json's
  /// add_bos_token, the post-processor, GGUF add_bos_token).
  bool adds_bos() const noexcept { return tokenizer.adds_bos(); }
  /// Whether generation stops at `id`.
  bool is_end(std::int32_t id) const noexcept {
    return std::binary_search(end_ids.begin(), end_ids.end(), id);
  }
  /// The ids of a plain-text prompt, with the special tokens the model adds (BOS or not).
  std::vector<std::int32_t> encode_prompt(std::string_view text) const {
    return tokenizer.encode(text, /*add_special_tokens=*/true);
  }
  /// chat_prompt() of `user` in this model's format (the BOS text and `date` filled in).
  std::string chat_text(std::string_view user, std::string_view date = {}) const {
    std::string bos;
    if (std::optional<std::int32_t> const b = tokenizer.bos_id()) {
      bos = tokenizer.decode(std::vector<std::int32_t>{*b});
    }
    std::string const day = date.empty() ? today() : std::string(date);
    return chat_prompt(chat, user, bos, day);
  }
  /// The ids of chat_text(user): tokenized as transformers' apply_chat_template does, with no
  /// special tokens added around it (the template writes BOS where the model wants it).
  std::vector<std::int32_t> encode_chat(std::string_view user, std::string_view date = {}) const {
    return tokenizer.encode(chat_text(user, date), /*add_special_tokens=*/false);
  }
};

namespace detail {

inline std::string read_text_file(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) moe::detail::fail("text: cannot open ", path.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (the
/// one named "default", else the first).
inline std::string config_chat_template(std::string_view json, std::string const& source) {
  io::detail::JsonCursor cur(json, concat("text: ", source), "tokenizer_config.json",
                             "pass a Hugging Face tokenizer_config.json");
  std::string out;
  if (cur.peek() != io::detail::JsonKind::kObject) return out;
  cur.begin_object();
  std::string key;
  bool first = true;
  while (cur.next_member(key, first)) {
    if (key != "chat_template") {
      cur.skip_value();
      continue;
    }
    if (cur.peek() == io::detail::JsonKind::kString) {
      out = cur.read_string();
    } else if (cur.peek() == io::detail::JsonKind::kArray) {
      cur.begin_array();
      bool f = true;
      bool have_default = false;
      while (cur.next_element(f)) {
        std::string name, text;
        cur.begin_object();
        std::string k;
        bool ff = true;
        while (cur.next_member(k, ff)) {
          if (k == "name") {
            name = cur.read_string();
          } else if (k == "template") {
            text = cur.read_string();
          } else {
            cur.skip_value();
          }
        }
        if (!have_default && (out.empty() || name == "default")) out = text;
        have_default = have_default || name == "default";
      }
    } else {
      cur.skip_value();
    }
  }
  return out;
}

/// generation_config.json's eos_token_id: a number or a list of numbers.
inline std::vector<std::int32_t> generation_eos_ids(std::string_view json,
                                                    std::string const& source) {
  io::detail::JsonCursor cur(json, concat("text: ", source), "generation_config.json",
                             "pass a Hugging Face generation_config.json");
  std::vector<std::int32_t> ids;
  auto const number = [&] {
    io::detail::JsonNumber const n = cur.read_number();
    if (!n.is_u64 || n.value > 0x7FFFFFFF) {
      moe::detail::fail("text: ", source, ": eos_token_id is not a token id in [0, 2^31)");
    }
    ids.push_back(static_cast<std::int32_t>(n.value));
  };
  if (cur.peek() != io::detail::JsonKind::kObject) return ids;
  cur.begin_object();
  std::string key;
  bool first = true;
  while (cur.next_member(key, first)) {
    if (key != "eos_token_id") {
      cur.skip_value();
    } else if (cur.peek() == io::detail::JsonKind::kArray) {
      cur.begin_array();
      bool f = true;
      while (cur.next_element(f)) number();
    } else if (cur.peek() == io::detail::JsonKind::kNull) {
      cur.read_null();
    } else {
      number();
    }
  }
  return ids;
}

/// The end ids of ModelTokenizer::end_ids from `ids` plus the chat format's end-of-turn tokens.
inline void finish_end_ids(ModelTokenizer& m, std::vector<std::int32_t> ids) {
  if (m.tokenizer.eos_id()) ids.push_back(*m.tokenizer.eos_id());
  if (m.tokenizer.eot_id()) ids.push_back(*m.tokenizer.eot_id());
  std::vector<std::string_view> turn_ends;
  if (m.chat == ChatFormat::kChatMl) turn_ends = {"<|im_end|>"};
  if (m.chat == ChatFormat::kHarmony) turn_ends = {"<|return|>", "<|call|>"};
  for (std::string_view const t : turn_ends) {
    if (std::optional<std::int32_t> const id = m.tokenizer.token_to_id(t)) ids.push_back(*id);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  m.end_ids = std::move(ids);
}

}  // namespace detail

/// The tokenizer of the model at `path`, and what generation needs besides it:
///   - a GGUF file (any shard of a split model): Tokenizer::from_gguf of its metadata, the chat
///     template tokenizer.chat_template;
///   - a Hugging Face model directory: its tokenizer.json and tokenizer_config.json
///     (Tokenizer::from_hf_file), the chat template from tokenizer_config.json's chat_template
///     or chat_template.jinja, end ids also from generation_config.json's eos_token_id;
///   - a tokenizer.json file: the same, with the files beside it.
/// Throws moe::Error in one line naming what is missing and how to get it (a directory without
/// tokenizer.json, a GGUF file without tokenizer metadata), or what is not supported.
inline ModelTokenizer load_model_tokenizer(std::filesystem::path const& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    moe::detail::fail("text: ", path.string(),
                      " does not exist; pass a model directory (with tokenizer.json) or a .gguf "
                      "file");
  }
  ModelTokenizer m;
  if (io::is_gguf_file(path)) {
    io::GgufModel const model(path);
    io::GgufFile const& meta = model.metadata();
    m.tokenizer = Tokenizer::from_gguf(meta);
    m.source = path.string();
    m.chat_template = std::string(meta.string_or("tokenizer.chat_template", ""));
    m.chat = detect_chat_format(m.chat_template);
    detail::finish_end_ids(m, {});
    return m;
  }
  fs::path const dir = fs::is_directory(path, ec) ? path : path.parent_path();
  fs::path const json = fs::is_directory(path, ec) ? path / "tokenizer.json" : path;
  if (!fs::exists(json, ec)) {
    bool const spm = fs::exists(dir / "tokenizer.model", ec);
    moe::detail::fail(
        "text: ", dir.string(), " has no tokenizer.json",
        spm ? " (only a SentencePiece tokenizer.model, which moe does not read yet)" : "",
        "; put the model's tokenizer.json and tokenizer_config.json there (e.g. "
        "huggingface-cli download ORG/MODEL tokenizer.json tokenizer_config.json --local-dir "
        "DIR), or pass a .gguf file");
  }
  m.tokenizer = Tokenizer::from_hf_file(json);
  m.source = json.string();
  std::vector<std::int32_t> ends;
  if (fs::path const config = dir / "tokenizer_config.json"; fs::exists(config, ec)) {
    m.chat_template = detail::config_chat_template(detail::read_text_file(config), config.string());
  }
  if (fs::path const jinja = dir / "chat_template.jinja";
      m.chat_template.empty() && fs::exists(jinja, ec)) {
    m.chat_template = detail::read_text_file(jinja);
  }
  if (fs::path const gen = dir / "generation_config.json"; fs::exists(gen, ec)) {
    ends = detail::generation_eos_ids(detail::read_text_file(gen), gen.string());
  }
  m.chat = detect_chat_format(m.chat_template);
  detail::finish_end_ids(m, std::move(ends));
  return m;
}

}  // namespace moe::text
