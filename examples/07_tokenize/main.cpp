// SPDX-License-Identifier: Apache-2.0
// moe_tokenize: the ids a model's tokenizer gives a text, or the text of ids (docs/tokenizer.md).
//
//   moe_tokenize --model DIR (--text T | --file F) [--no-bos]
//   moe_tokenize --model DIR --decode 1,2,3
//
// DIR holds the Hugging Face tokenizer.json (and tokenizer_config.json if the model has one).
// Encoding prints the ids comma-separated on one line, with the special tokens the tokenizer adds
// around the text (BOS for DeepSeek-V3, none for Qwen) unless --no-bos; special tokens written in
// the text (<|im_start|>) are recognised either way. --decode prints the text, special tokens
// included, and nothing else. Errors: one line on stderr, exit status 1; a bad or unknown
// argument: exit status 2.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "../common/cli.hpp"
#include "moe/text/tokenizer.hpp"

namespace {

constexpr moe_cli::Option kOptions[] = {
    {"--model DIR", "the model directory (tokenizer.json inside) or a tokenizer.json file"},
    {"--text T", "encode the text T"},
    {"--file F", "encode the contents of file F (UTF-8)"},
    {"--no-bos", "add no special tokens around the text (BOS); those in the text still count"},
    {"--decode I,J,...", "print the text of these ids instead (special tokens included)"},
    {"-h, --help", "print this help and exit"},
};
constexpr moe_cli::Usage kUsage = {
    "moe_tokenize", "--model DIR (--text T | --file F) [--no-bos] | --model DIR --decode I,J,...",
    kOptions};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string model, text, file, decode;
  bool have_text = false, have_file = false, have_decode = false, bos = true;
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
    } else if (f == "--decode") {
      a.decode = value();
      a.have_decode = true;
    } else {
      moe_cli::exit_unknown_argument(kUsage, f);
    }
  }
  if (a.model.empty()) throw UsageError("--model DIR is required");
  if (a.have_text + a.have_file + a.have_decode != 1) {
    throw UsageError("give exactly one of --text, --file and --decode");
  }
  return a;
}

std::string read_file(std::string const& path) {
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
    auto const tokenizer = moe::text::Tokenizer::from_hf_file(a.model);
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
    for (std::int32_t const id : tokenizer.encode(text, a.bos)) {
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
