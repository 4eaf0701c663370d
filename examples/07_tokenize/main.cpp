// SPDX-License-Identifier: Apache-2.0
// moe_tokenize: the ids a model's tokenizer gives a text, or the text of ids (docs/tokenizer.md).
//
//   moe_tokenize --model DIR|FILE.gguf (--text T | --file F) [--no-bos] [--chat]
//   moe_tokenize --model DIR|FILE.gguf --decode 1,2,3
//
// The tokenizer is the model's (moe::text::load_model_tokenizer): DIR's Hugging Face
// tokenizer.json (and tokenizer_config.json if the model has one), a tokenizer.json file, or a
// GGUF file's tokenizer.ggml.* metadata. --chat wraps the text as one user turn in the model's
// chat format, with the assistant's generation prompt, as moe_generate --chat does (and adds
// nothing around it: the template writes BOS where the model wants it). Encoding prints the ids
// comma-separated on one line, with the special tokens the tokenizer adds around the text (BOS for
// DeepSeek-V3, none for Qwen) unless --no-bos; special tokens written in the text (<|im_start|>)
// are recognised either way. --decode prints the text, special tokens included, and nothing else.
// Errors: one line on stderr, exit status 1; a bad or unknown argument: exit status 2.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../common/cli.hpp"
#include "moe/text/model_tokenizer.hpp"

namespace {

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR|FILE.gguf",
     "the model directory (tokenizer.json inside), a tokenizer.json file or a GGUF file"},
    {"--text T", "encode the text T"},
    {"--file F", "encode the contents of file F (UTF-8)"},
    {"--no-bos", "add no special tokens around the text (BOS); those in the text still count"},
    {"--chat", "wrap the text as one user turn in the model's chat format (as moe_generate)"},
    {"--decode I,J,...", "print the text of these ids instead (special tokens included)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_tokenize",
    "--model DIR|FILE.gguf (--text T | --file F) [--no-bos] [--chat] | --model DIR|FILE.gguf "
    "--decode I,J,...",
    kOptions};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string model, text, file, decode;
  bool have_text = false, have_file = false, have_decode = false, bos = true, chat = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string const f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(f + " needs a value");
      return argv[++i];
    };
    if (moe_cli::is_help(f)) {
      moe_cli::exit_help(kUsage);
    } else if (f == "--model") {
      a.model = value();
    } else if (f == "--text") {
      a.text = value();
      a.have_text = true;
    } else if (f == "--file") {
      a.file = value();
      a.have_file = true;
    } else if (f == "--no-bos") {
      a.bos = false;
    } else if (f == "--chat") {
      a.chat = true;
    } else if (f == "--decode") {
      a.decode = value();
      a.have_decode = true;
    } else {
      moe_cli::exit_unknown_argument(kUsage, f);
    }
  }
  if (a.model.empty()) throw UsageError("--model DIR|FILE.gguf is required");
  if (a.have_text + a.have_file + a.have_decode != 1) {
    throw UsageError("give exactly one of --text, --file and --decode");
  }
  if (a.chat && a.have_decode) throw UsageError("--chat wraps a text to encode, not --decode");
  return a;
}

std::string read_file(std::string const& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw std::runtime_error("--file '" + path + "' is a directory; pass a text file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open --file '" + path + "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "moe_tokenize: %s; moe_tokenize --help lists the options\n", e.what());
    return moe_cli::kExitUsage;
  }
  try {
    moe::text::ModelTokenizer const model = moe::text::load_model_tokenizer(a.model);
    moe::text::Tokenizer const& tokenizer = model.tokenizer;
    if (a.have_decode) {
      std::vector<std::int32_t> ids;
      std::string_view const s = a.decode;
      std::size_t p = 0;
      while (p <= s.size()) {
        std::size_t const q = std::min(s.find(',', p), s.size());
        ids.push_back(
            moe_cli::parse_integer<std::int32_t>("--decode", s.substr(p, q - p), 0, INT32_MAX));
        p = q + 1;
      }
      std::string const text = tokenizer.decode(ids);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fputc('\n', stdout);
      return 0;
    }
    std::string const text = a.have_file ? read_file(a.file) : a.text;
    std::string line;
    if (a.chat && model.chat == moe::text::ChatFormat::kUnknown) {
      throw std::runtime_error("--chat: " + model.source +
                               " has no chat template moe recognises (ChatML, DeepSeek-V3, "
                               "gpt-oss harmony)");
    }
    std::vector<std::int32_t> const ids =
        a.chat ? model.encode_chat(text) : tokenizer.encode(text, a.bos);
    for (std::int32_t const id : ids) {
      if (!line.empty()) line += ',';
      line += std::to_string(id);
    }
    std::printf("%s\n", line.c_str());
    return 0;
  } catch (std::exception const& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "moe_tokenize: %s\n", msg.c_str());
    return 1;
  }
}
