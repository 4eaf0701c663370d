// SPDX-License-Identifier: Apache-2.0
// Replays a fuzz corpus through one fuzz target with the normal compiler (g++; under the asan
// preset with ASan + UBSan), plus seeded random mutations of every file: a cheap,
// deterministic stand-in for libFuzzer where clang is not available. Linked with any of the
// targets of tests/fuzz/: each defines moe_fuzz_one() besides LLVMFuzzerTestOneInput.
//
// Usage: moe_fuzz_replay_<target> [--mutations N] [--seed S] [--dict FILE] [--length-prefix]
//                                 <file or directory>...
// --dict: a libFuzzer dictionary whose tokens the mutations insert and overwrite with.
// --length-prefix: inputs start with a little-endian u64 length (safetensors), which one kind
// of mutation rewrites.
// Files named valid-* must be accepted and invalid-* rejected; exit status 1 otherwise.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

/// The target: returns 1 if it accepted the input, 0 if it rejected it (with moe::Error); aborts
/// on a bug.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size);

namespace {

// The input being run, written to ./moe_fuzz_replay-crash when the target aborts (a mutation
// exists nowhere else), for replaying it with this binary or the libFuzzer one.
std::vector<std::uint8_t> const* g_current = nullptr;

extern "C" void save_current(int sig) {
  if (g_current != nullptr) {
    int const fd = ::open("moe_fuzz_replay-crash", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ssize_t const n = ::write(fd, g_current->data(), g_current->size());
      (void)n;
      ::close(fd);
      static constexpr char kMsg[] = "moe_fuzz_replay: input saved to ./moe_fuzz_replay-crash\n";
      ssize_t const m = ::write(2, kMsg, sizeof kMsg - 1);
      (void)m;
    }
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(next() % n); }
};

std::vector<std::uint8_t> read_all(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

using Token = std::vector<std::uint8_t>;

// The tokens of a libFuzzer dictionary: one `name="value"` or `"value"` a line, `#` comments,
// escapes \\ \" and \xAB. Exits on a malformed line.
std::vector<Token> read_dict(std::filesystem::path const& path) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "moe_fuzz_replay: cannot read dictionary %s\n", path.string().c_str());
    std::exit(1);
  }
  std::vector<Token> tokens;
  std::string line;
  auto hex = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c - 'A' + 10;
  };
  while (std::getline(in, line)) {
    std::size_t const open = line.find('"');
    std::size_t const first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    std::size_t const close = line.rfind('"');
    if (open == std::string::npos || close <= open) {
      std::fprintf(stderr, "moe_fuzz_replay: %s: bad line: %s\n", path.string().c_str(),
                   line.c_str());
      std::exit(1);
    }
    Token token;
    for (std::size_t i = open + 1; i < close; ++i) {
      if (line[i] != '\\' || i + 1 >= close) {
        token.push_back(static_cast<std::uint8_t>(line[i]));
      } else if (line[i + 1] == 'x' && i + 3 < close) {
        token.push_back(static_cast<std::uint8_t>(hex(line[i + 2]) * 16 + hex(line[i + 3])));
        i += 3;
      } else {
        token.push_back(static_cast<std::uint8_t>(line[++i]));
      }
    }
    if (!token.empty()) tokens.push_back(std::move(token));
  }
  return tokens;
}

// One to four random edits, biased towards what matters in these formats: JSON punctuation and
// digits, dictionary tokens and (with length_prefix) the length field.
void mutate(std::vector<std::uint8_t>& v, SplitMix64& rng, std::vector<Token> const& dict,
            bool length_prefix) {
  static constexpr char kInteresting[] = "{}[]\",:0123456789-.e \\u";
  std::size_t const edits = 1 + rng.below(4);
  for (std::size_t e = 0; e < edits; ++e) {
    switch (rng.below(10)) {
      case 0:
        if (!v.empty()) v[rng.below(v.size())] ^= static_cast<std::uint8_t>(1u << rng.below(8));
        break;
      case 1:
        if (!v.empty()) v[rng.below(v.size())] = static_cast<std::uint8_t>(rng.next());
        break;
      case 2:
        if (!v.empty()) {
          v[rng.below(v.size())] =
              static_cast<std::uint8_t>(kInteresting[rng.below(sizeof(kInteresting) - 1)]);
        }
        break;
      case 3:
        v.resize(rng.below(v.size() + 1));
        break;
      case 4:
        v.insert(v.begin() + static_cast<std::ptrdiff_t>(rng.below(v.size() + 1)),
                 static_cast<std::uint8_t>(kInteresting[rng.below(sizeof(kInteresting) - 1)]));
        break;
      case 5:
        if (!v.empty()) {
          std::size_t const at = rng.below(v.size());
          std::size_t const n = std::min<std::size_t>(1 + rng.below(16), v.size() - at);
          v.erase(v.begin() + static_cast<std::ptrdiff_t>(at),
                  v.begin() + static_cast<std::ptrdiff_t>(at + n));
        }
        break;
      case 6:
        if (!v.empty()) {
          std::size_t const at = rng.below(v.size());
          std::size_t const n = std::min<std::size_t>(1 + rng.below(32), v.size() - at);
          std::vector<std::uint8_t> const chunk(v.begin() + static_cast<std::ptrdiff_t>(at),
                                                v.begin() + static_cast<std::ptrdiff_t>(at + n));
          v.insert(v.begin() + static_cast<std::ptrdiff_t>(rng.below(v.size() + 1)), chunk.begin(),
                   chunk.end());
        }
        break;
      case 7:
      case 8:
        // Insert a dictionary token, or overwrite bytes with it.
        if (!dict.empty()) {
          Token const& token = dict[rng.below(dict.size())];
          std::size_t const at = rng.below(v.size() + 1);
          if (rng.below(2) == 0 || at + token.size() > v.size()) {
            v.insert(v.begin() + static_cast<std::ptrdiff_t>(at), token.begin(), token.end());
          } else {
            std::copy(token.begin(), token.end(), v.begin() + static_cast<std::ptrdiff_t>(at));
          }
        }
        break;
      default:
        // Rewrite the header length field to a nearby or arbitrary value.
        if (length_prefix && v.size() >= 8) {
          std::uint64_t n = 0;
          for (int i = 0; i < 8; ++i)
            n |= static_cast<std::uint64_t>(v[static_cast<std::size_t>(i)]) << (8 * i);
          n = rng.below(2) == 0 ? n + rng.below(17) - 8 : rng.next() >> rng.below(64);
          for (int i = 0; i < 8; ++i)
            v[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
        }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mutations = 0;
  std::uint64_t seed = 1;
  std::vector<std::filesystem::path> files;
  std::vector<Token> dict;
  bool length_prefix = false;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    if (arg == "--dict" && i + 1 < argc) {
      dict = read_dict(argv[++i]);
    } else if (arg == "--length-prefix") {
      length_prefix = true;
    } else if (arg == "--mutations" && i + 1 < argc) {
      mutations = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::filesystem::is_directory(arg)) {
      for (auto const& entry : std::filesystem::recursive_directory_iterator(arg)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
    } else {
      files.emplace_back(arg);
    }
  }
  std::sort(files.begin(), files.end());
  std::signal(SIGABRT, save_current);
  std::signal(SIGSEGV, save_current);
  if (files.empty()) {
    std::fprintf(stderr, "moe_fuzz_replay: no input files\n");
    return 1;
  }
  std::size_t accepted = 0, mutated_accepted = 0, wrong = 0;
  for (std::filesystem::path const& path : files) {
    std::vector<std::uint8_t> const bytes = read_all(path);
    g_current = &bytes;
    bool const ok = moe_fuzz_one(bytes.data(), bytes.size()) != 0;
    accepted += ok ? 1 : 0;
    std::string const name = path.filename().string();
    if ((name.rfind("valid-", 0) == 0 && !ok) || (name.rfind("invalid-", 0) == 0 && ok)) {
      std::fprintf(stderr, "moe_fuzz_replay: %s was %s\n", path.string().c_str(),
                   ok ? "accepted" : "rejected");
      ++wrong;
    }
    SplitMix64 rng{seed ^ std::hash<std::string>{}(name)};
    for (std::size_t m = 0; m < mutations; ++m) {
      std::vector<std::uint8_t> copy = bytes;
      mutate(copy, rng, dict, length_prefix);
      g_current = &copy;
      mutated_accepted += moe_fuzz_one(copy.data(), copy.size()) != 0 ? 1 : 0;
    }
  }
  std::printf(
      "moe_fuzz_replay: %zu corpus files (%zu accepted), %zu mutated inputs (%zu accepted)\n",
      files.size(), accepted, files.size() * mutations, mutated_accepted);
  return wrong == 0 ? 0 : 1;
}
