// SPDX-License-Identifier: Apache-2.0
// moe_generate and moe_tokenize with text, end to end: a tiny Qwen3-MoE checkpoint whose greedy
// next token depends only on the last one (one-hot embeddings, zero attention output and zero
// experts, an LM head that maps each token to a chosen successor), beside the tiny hand-written
// tokenizer of tiny_tokenizer.hpp. Every id and text below is worked out by hand: --prompt gives
// the ids --prompt-ids gives, the text printed is decode of the ids, EOS stops, --ignore-eos
// does not, --chat wraps the prompt in ChatML, and bad input exits 1 with one line on stderr.
#if defined(MOE_GENERATE) && defined(MOE_TOKENIZE)
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "moe/io/gguf/writer.hpp"
#include "moe/io/hf.hpp"
#include "moe/io/safetensors.hpp"
#include "moe/quant/ggml_type.hpp"
#include "text/tiny_tokenizer.hpp"

namespace {

namespace fs = std::filesystem;
using moe::io::detail::concat;
using namespace tinytok;

constexpr std::int64_t kH = kVocab;  // one-hot embeddings need a width of at least the vocab

/// The greedy successor of each token (the LM head's one 1 in column t).
std::int32_t successor(std::int32_t t) {
  switch (t) {
    case kSpaceWorld:
      return kBang;
    case kBang:
      return kNewline;
    case kNewline:
      return kHello;
    case kHello:
      return kImEnd;
    case kImEnd:
      return kComma;
    default:
      return kA;
  }
}

using TensorMap = std::map<std::string, std::pair<std::vector<std::int64_t>, std::vector<float>>>;

/// A one-layer Qwen3-MoE checkpoint (2 experts, top-1) in `dir`: h = embed[t] = e_t passes the
/// layer unchanged (o_proj and the experts' down_proj are zero), the final norm makes it
/// sqrt(H) e_t, and lm_head[v][t] = 1 for v = successor(t): the next token is successor(last).
/// Returns the tensors (Hugging Face names, row-major shapes).
TensorMap write_model(fs::path const& dir) {
  moe::io::HfMoeConfig c =
      moe::io::parse_hf_config(R"({"model_type": "qwen3_moe", "num_experts_per_tok": 1})");
  c.hidden_size = kH;
  c.expert_intermediate_size = 8;
  c.num_experts = 2;
  c.num_hidden_layers = 1;
  c.norm_topk_prob = true;
  c.defaulted_keys.clear();
  std::string j = moe::io::hf_config_json(c);
  j.resize(j.rfind('}'));
  j += concat(", \"vocab_size\": ", kVocab,
              ", \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 8, "
              "\"rope_theta\": 1000.0, \"rms_norm_eps\": 1e-06, \"tie_word_embeddings\": false, "
              "\"intermediate_size\": 16}");
  tinytok::write(dir / "config.json", j);

  TensorMap t;
  auto add = [&](std::string const& name, std::vector<std::int64_t> shape, float fill) {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    t[name] = {shape, std::vector<float>(static_cast<std::size_t>(n), fill)};
  };
  add("model.embed_tokens.weight", {kVocab, kH}, 0.0f);
  add("lm_head.weight", {kVocab, kH}, 0.0f);
  for (std::int32_t v = 0; v < kVocab; ++v) {
    t["model.embed_tokens.weight"].second[v * kH + v] = 1.0f;
    t["lm_head.weight"].second[successor(v) * kH + v] = 1.0f;
  }
  add("model.norm.weight", {kH}, 1.0f);
  std::string const p = "model.layers.0.";
  add(p + "input_layernorm.weight", {kH}, 1.0f);
  add(p + "post_attention_layernorm.weight", {kH}, 1.0f);
  add(p + "self_attn.q_proj.weight", {16, kH}, 0.1f);
  add(p + "self_attn.k_proj.weight", {8, kH}, 0.1f);
  add(p + "self_attn.v_proj.weight", {8, kH}, 0.1f);
  add(p + "self_attn.o_proj.weight", {kH, 16}, 0.0f);
  add(p + "self_attn.q_norm.weight", {8}, 1.0f);
  add(p + "self_attn.k_norm.weight", {8}, 1.0f);
  for (moe::io::HfTensor const& ht :
       moe::io::hf_layer_tensors(c, moe::io::hf_default_layout(c.family, 0))) {
    add(ht.name, ht.shape, 0.0f);  // router, experts: zero (the experts' output is zero)
  }
  moe::io::SafetensorsWriter w;
  for (auto const& [name, tensor] : t) w.add_f32(name, tensor.first, tensor.second);
  w.save(dir / "model.safetensors");
  return t;
}

/// The same model as a llama.cpp qwen3moe GGUF file (F32 tensors under llama.cpp's names, in
/// ggml order) with the tiny tokenizer in its tokenizer.ggml.* metadata and the chat template.
void write_gguf_model(TensorMap const& t, fs::path const& path) {
  using V = moe::io::GgufMetadataValue;
  auto u32 = [](std::int64_t v) { return V(static_cast<std::uint32_t>(v)); };
  moe::io::GgufWriter w;
  std::string const a = "qwen3moe";
  w.set("general.architecture", a)
      .set(a + ".block_count", u32(1))
      .set(a + ".context_length", u32(256))
      .set(a + ".embedding_length", u32(kH))
      .set(a + ".feed_forward_length", u32(16))
      .set(a + ".expert_feed_forward_length", u32(8))
      .set(a + ".expert_count", u32(2))
      .set(a + ".expert_used_count", u32(1))
      .set(a + ".attention.head_count", u32(2))
      .set(a + ".attention.head_count_kv", u32(1))
      .set(a + ".attention.key_length", u32(8))
      .set(a + ".attention.value_length", u32(8))
      .set(a + ".rope.freq_base", V(1000.0f))
      .set(a + ".attention.layer_norm_rms_epsilon", V(1e-6f))
      .set("tokenizer.ggml.model", "gpt2")
      .set("tokenizer.ggml.pre", "qwen2")
      .set("tokenizer.ggml.tokens", V::array(std::vector<std::string>{"<|endoftext|>",
                                                                      "<|im_start|>",
                                                                      "<|im_end|>",
                                                                      "a",
                                                                      "d",
                                                                      "e",
                                                                      "h",
                                                                      "i",
                                                                      "l",
                                                                      "n",
                                                                      "o",
                                                                      "r",
                                                                      "s",
                                                                      "t",
                                                                      "u",
                                                                      "w",
                                                                      "Ġ",
                                                                      "Ċ",
                                                                      "!",
                                                                      ",",
                                                                      "he",
                                                                      "ll",
                                                                      "hell",
                                                                      "hello",
                                                                      "Ġw",
                                                                      "or",
                                                                      "Ġwor",
                                                                      "Ġworl",
                                                                      "Ġworld",
                                                                      "us",
                                                                      "use",
                                                                      "user"}))
      .set("tokenizer.ggml.token_type",
           V::array(std::vector<std::int32_t>{3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                              1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}))
      .set("tokenizer.ggml.merges",
           V::array(std::vector<std::string>{"h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or",
                                             "Ġwor l", "Ġworl d", "u s", "us e", "use r"}))
      .set("tokenizer.ggml.eos_token_id", u32(kImEnd))
      .set("tokenizer.ggml.padding_token_id", u32(kEndOfText))
      .set("tokenizer.ggml.add_bos_token", false)
      .set("tokenizer.chat_template", std::string(kChatTemplate));
  auto add = [&](std::string const& gguf, std::string const& hf) {
    auto const& [shape, values] = t.at(hf);
    std::vector<std::int64_t> const ne(shape.rbegin(), shape.rend());
    std::vector<std::byte> bytes(values.size() * 4);
    std::memcpy(bytes.data(), values.data(), bytes.size());
    w.add_tensor(gguf, moe::quant::GgmlType::kF32, ne, bytes);
  };
  add("token_embd.weight", "model.embed_tokens.weight");
  add("output_norm.weight", "model.norm.weight");
  add("output.weight", "lm_head.weight");
  std::string const p = "model.layers.0.";
  add("blk.0.attn_norm.weight", p + "input_layernorm.weight");
  add("blk.0.ffn_norm.weight", p + "post_attention_layernorm.weight");
  add("blk.0.attn_q.weight", p + "self_attn.q_proj.weight");
  add("blk.0.attn_k.weight", p + "self_attn.k_proj.weight");
  add("blk.0.attn_v.weight", p + "self_attn.v_proj.weight");
  add("blk.0.attn_output.weight", p + "self_attn.o_proj.weight");
  add("blk.0.attn_q_norm.weight", p + "self_attn.q_norm.weight");
  add("blk.0.attn_k_norm.weight", p + "self_attn.k_norm.weight");
  add("blk.0.ffn_gate_inp.weight", p + "mlp.gate.weight");
  // The experts are zero: one stacked zero tensor each ([E, I, H] and [E, H, I]).
  std::vector<std::byte> const zeros(2 * 8 * kH * 4);
  w.add_tensor("blk.0.ffn_gate_exps.weight", moe::quant::GgmlType::kF32, {kH, 8, 2}, zeros);
  w.add_tensor("blk.0.ffn_up_exps.weight", moe::quant::GgmlType::kF32, {kH, 8, 2}, zeros);
  w.add_tensor("blk.0.ffn_down_exps.weight", moe::quant::GgmlType::kF32, {8, kH, 2}, zeros);
  w.save(path);
}

fs::path scratch(std::string const& name) {
  fs::path const dir = fs::path(MOE_TEXT_TEST_TMP) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string slurp(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Run {
  int status;
  std::string out, err;
};

/// Runs `tool` with `args` (shell words); stdout and stderr are captured through files.
Run run(char const* tool, std::string const& args, fs::path const& dir) {
  std::string const command = concat("'", tool, "' ", args, " >'", (dir / "out.txt").string(),
                                     "' 2>'", (dir / "err.txt").string(), "'");
  int const status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(dir / "out.txt"),
          slurp(dir / "err.txt")};
}

std::size_t lines(std::string const& s) { return std::count(s.begin(), s.end(), '\n'); }

}  // namespace

TEST_CASE("moe_generate --prompt: the tokenized prompt, the text, EOS, --chat, the errors",
          "[text][generate]") {
  fs::path const dir = scratch("generate_text");
  write_model(dir);
  write_files(dir);
  std::string const model = "--model '" + dir.string() + "' ";

  // "hello world" is hello Ġworld (23, 28); then ! \n hello and EOS <|im_end|> (2), which stops
  // generation and is not printed; the ids line (--print-ids) has it.
  Run const text = run(MOE_GENERATE,
                       model +
                           "--prompt 'hello world' --max-new-tokens 10 "
                           "--print-ids --print-prompt-ids",
                       dir);
  INFO(text.err);
  REQUIRE(text.status == 0);
  CHECK(text.out == "!\nhello\n18,17,23,2\n");
  CHECK_THAT(text.err, Catch::Contains("moe_generate: prompt ids (2): 23,28\n"));
  // --prompt-ids of those ids: the same ids, and the output of the ids mode (no text, no stop).
  Run const ids = run(MOE_GENERATE, model + "--prompt-ids 23,28 --max-new-tokens 4", dir);
  REQUIRE(ids.status == 0);
  CHECK(ids.out == "18,17,23,2\n");
  // Without --print-ids: the text only; --prompt-file reads the same prompt.
  tinytok::write(dir / "prompt.txt", "hello world");
  Run const file =
      run(MOE_GENERATE,
          model + "--prompt-file '" + (dir / "prompt.txt").string() + "' --max-new-tokens 10", dir);
  REQUIRE(file.status == 0);
  CHECK(file.out == "!\nhello\n");
  // --ignore-eos goes on: <|im_end|> is printed, then , and a.
  Run const on = run(MOE_GENERATE,
                     model +
                         "--prompt 'hello world' --max-new-tokens 6 "
                         "--ignore-eos --print-ids",
                     dir);
  REQUIRE(on.status == 0);
  CHECK(on.out == "!\nhello<|im_end|>,a\n18,17,23,2,19,3\n");
  // --max-new-tokens before EOS.
  Run const short_run = run(MOE_GENERATE, model + "--prompt 'hello world' --max-new-tokens 2", dir);
  REQUIRE(short_run.status == 0);
  CHECK(short_run.out == "!\n\n");

  // --chat: <|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n; the last token
  // Ċ is followed by hello, then EOS.
  Run const chat = run(MOE_GENERATE,
                       model +
                           "--prompt 'hello world' --chat --max-new-tokens 10 "
                           "--print-prompt-ids --print-ids",
                       dir);
  INFO(chat.err);
  REQUIRE(chat.status == 0);
  CHECK_THAT(chat.err, Catch::Contains("moe_generate: prompt ids (18): "
                                       "1,31,17,23,28,2,17,1,3,12,12,7,12,13,3,9,13,17\n"));
  CHECK(chat.out == "hello\n23,2\n");
  // moe_tokenize --chat gives the same prompt ids.
  Run const tok = run(MOE_TOKENIZE, model + "--text 'hello world' --chat", dir);
  REQUIRE(tok.status == 0);
  CHECK(tok.out == "1,31,17,23,28,2,17,1,3,12,12,7,12,13,3,9,13,17\n");

  // Errors: exit 1 and one line on stderr.
  fs::path const bare = scratch("generate_text_bare");
  write_model(bare);
  std::string const bare_model = "--model '" + bare.string() + "' ";
  for (auto const& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {model + "--prompt hi --prompt-ids 1 --max-new-tokens 1", "mutually exclusive"},
           {model + "--prompt hi --prompt-file x --max-new-tokens 1", "cannot open 'x'"},
           {model + "--prompt-ids 1 --chat --max-new-tokens 1", "--chat wraps a text prompt"},
           {bare_model + "--prompt hi --max-new-tokens 1", "has no tokenizer.json"},
           {model + "--prompt '' --max-new-tokens 1", "the prompt is empty"}}) {
    INFO(args);
    Run const bad = run(MOE_GENERATE, args, dir);
    CHECK(bad.status == 1);
    CHECK(lines(bad.err) == 1);
    CHECK_THAT(bad.err, Catch::StartsWith("moe_generate: ") && Catch::Contains(message));
    CHECK(bad.out.empty());
  }
  // --chat with a template moe does not know.
  tinytok::write(dir / "tokenizer_config.json",
                 R"({"eos_token": "<|im_end|>", "chat_template": "[INST] {{ content }}"})");
  Run const unknown = run(MOE_GENERATE, model + "--prompt hi --chat --max-new-tokens 1", dir);
  CHECK(unknown.status == 1);
  CHECK(lines(unknown.err) == 1);
  CHECK_THAT(unknown.err, Catch::Contains("chat template is not one moe recognises"));
}

TEST_CASE("moe_generate --model FILE.gguf --prompt: the tokenizer from the file's metadata",
          "[text][generate][gguf]") {
  fs::path const dir = scratch("generate_text_gguf");
  TensorMap const t = write_model(dir);
  write_gguf_model(t, dir / "tiny.gguf");
  std::string const model = "--model '" + (dir / "tiny.gguf").string() + "' ";
  Run const text =
      run(MOE_GENERATE, model + "--prompt 'hello world' --max-new-tokens 10 --print-ids", dir);
  INFO(text.err);
  REQUIRE(text.status == 0);
  CHECK(text.out == "!\nhello\n18,17,23,2\n");
  Run const chat = run(MOE_GENERATE,
                       model +
                           "--prompt 'hello world' --chat --max-new-tokens 10 "
                           "--print-prompt-ids",
                       dir);
  REQUIRE(chat.status == 0);
  CHECK_THAT(chat.err, Catch::Contains("moe_generate: prompt ids (18): "
                                       "1,31,17,23,28,2,17,1,3,12,12,7,12,13,3,9,13,17\n"));
  CHECK(chat.out == "hello\n");
}

#ifdef MOE_QUANTIZE
TEST_CASE("moe_quantize --out FILE.gguf carries the directory's tokenizer, as llama.cpp's does",
          "[text][generate][gguf]") {
  fs::path const dir = scratch("quantize_tokenizer");
  write_model(dir);
  write_files(dir);
  // Qwen2's tokenizer.json normalizes to NFC, which tokenizer.ggml.pre "qwen2" says.
  std::string json = slurp(dir / "tokenizer.json");
  std::string const plain = R"("normalizer": null)";
  json.replace(json.find(plain), plain.size(), R"("normalizer": {"type": "NFC"})");
  tinytok::write(dir / "tokenizer.json", json);
  std::string const gguf = (dir / "q.gguf").string();
  Run const q = run(MOE_QUANTIZE, "--model '" + dir.string() + "' --out '" + gguf + "'", dir);
  INFO(q.err);
  REQUIRE(q.status == 0);
  CHECK_THAT(q.err, Catch::Contains("tokenizer written (model gpt2, pre qwen2)"));
  // The file's tokenizer gives the directory's prompt ids, chat prompt and text.
  std::string const args =
      "--prompt 'hello world' --chat --max-new-tokens 10 --print-ids "
      "--print-prompt-ids";
  Run const from_dir = run(MOE_GENERATE, "--model '" + dir.string() + "' " + args, dir);
  Run const from_gguf = run(MOE_GENERATE, "--model '" + gguf + "' " + args, dir);
  INFO(from_gguf.err);
  REQUIRE(from_dir.status == 0);
  REQUIRE(from_gguf.status == 0);
  CHECK(from_gguf.out == from_dir.out);
  CHECK(from_gguf.out == "hello\n23,2\n");
  CHECK_THAT(from_gguf.err, Catch::Contains("moe_generate: prompt ids (18): "
                                            "1,31,17,23,28,2,17,1,3,12,12,7,12,13,3,9,13,17\n"));
  // And from that file to another: the tokenizer goes along as it is.
  std::string const again = (dir / "again.gguf").string();
  REQUIRE(run(MOE_QUANTIZE, "--model '" + gguf + "' --out '" + again + "'", dir).status == 0);
  CHECK(run(MOE_GENERATE, "--model '" + again + "' " + args, dir).out == from_dir.out);
  // A directory without tokenizer.json: the file is written, a warning says it has no tokenizer.
  fs::path const bare = scratch("quantize_tokenizer_bare");
  write_model(bare);
  Run const none =
      run(MOE_QUANTIZE,
          "--model '" + bare.string() + "' --out '" + (bare / "q.gguf").string() + "'", bare);
  CHECK(none.status == 0);
  CHECK_THAT(none.err, Catch::Contains("warning: no tokenizer.json"));
}
#endif

TEST_CASE("moe_tokenize: a GGUF file's tokenizer, encode and decode", "[text][generate]") {
  fs::path const dir = scratch("tokenize_gguf");
  moe::io::GgufWriter w;
  w.set("general.architecture", "qwen3moe")
      .set("tokenizer.ggml.model", "gpt2")
      .set("tokenizer.ggml.pre", "deepseek-v3")
      .set("tokenizer.ggml.tokens", moe::io::GgufMetadataValue::array(std::vector<std::string>{
                                        "<s>", "1", "2", "3", "4", "12", "123", "Ġ"}))
      .set("tokenizer.ggml.token_type",
           moe::io::GgufMetadataValue::array<std::int32_t>({3, 1, 1, 1, 1, 1, 1, 1}))
      .set("tokenizer.ggml.merges",
           moe::io::GgufMetadataValue::array(std::vector<std::string>{"1 2", "12 3"}))
      .set("tokenizer.ggml.bos_token_id", std::uint32_t{0})
      .set("tokenizer.ggml.add_bos_token", true);
  w.save(dir / "t.gguf");
  std::string const model = "--model '" + (dir / "t.gguf").string() + "' ";
  // DeepSeek-V3's digits split in threes: 1234 -> 123 4.
  Run const enc = run(MOE_TOKENIZE, model + "--text 1234", dir);
  REQUIRE(enc.status == 0);
  CHECK(enc.out == "0,6,4\n");
  CHECK(run(MOE_TOKENIZE, model + "--text 1234 --no-bos", dir).out == "6,4\n");
  CHECK(run(MOE_TOKENIZE, model + "--decode 0,6,7,4", dir).out == "<s>123 4\n");
  Run const chat = run(MOE_TOKENIZE, model + "--text 1 --chat", dir);
  CHECK(chat.status == 1);
  CHECK_THAT(chat.err, Catch::Contains("no chat template"));
}
#endif
