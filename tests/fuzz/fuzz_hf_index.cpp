// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the sharded-checkpoint index (model.safetensors.index.json, read by
// moe::io::ShardedCheckpoint::open_index). The reader only takes a path, so each input is
// written as the index of a scratch directory that holds a few shards (see make_shards()):
// some valid, one sharing a tensor with another, a corrupt one, an empty one, one in a
// subdirectory and a directory named like a shard. The input must either be rejected with
// moe::Error or give a checkpoint in which every tensor of "weight_map" (as an independent
// tree parse of the same text lists it) is found, in the shard the index names. Any other
// outcome (a crash, a sanitizer report, another exception, a broken invariant) is a bug. Built
// with clang -fsanitize=fuzzer,address,undefined by the "fuzz: hf_index libFuzzer" test, and
// with the normal compiler into moe_fuzz_replay_hf_index (tests/fuzz/replay_main.cpp).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/hf/config.hpp"  // detail::parse_json_value, the tree parser
#include "moe/io/safetensors.hpp"

namespace {

namespace fs = std::filesystem;

// A broken invariant: abort, so that libFuzzer and the sanitizers record the input.
void require(bool ok) {
  if (!ok) std::abort();
}

// In memory when it can be: rewriting a file on ext4 flushes it to disk each time
// (auto_da_alloc), which made the replay 100 times slower. $TMPDIR wins when it is set.
fs::path temp_dir() {
  std::error_code ec;
  if (std::getenv("TMPDIR") == nullptr && fs::is_directory("/dev/shm", ec)) return "/dev/shm";
  return fs::temp_directory_path();
}

fs::path scratch_dir() {
  static fs::path const dir = [] {
    fs::path d = temp_dir() / ("moe_fuzz_hf_index." + std::to_string(getpid()));
    fs::remove_all(d);
    fs::create_directories(d / "sub");
    fs::create_directories(d / "dir.safetensors");
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(temp_dir() / ("moe_fuzz_hf_index." + std::to_string(getpid())), ec);
    });
    return d;
  }();
  return dir;
}

void save(fs::path const& path, std::vector<std::string> const& names) {
  static std::vector<std::byte> const data(16, std::byte{0x3f});
  std::vector<moe::io::TensorView> tensors;
  for (std::string const& name : names) {
    tensors.push_back({name, moe::io::Dtype::kF32, {2, 2}, std::span<std::byte const>(data)});
  }
  moe::io::save_safetensors(path, tensors, {{"format", "pt"}});
}

// The shards the corpus's indexes refer to.
fs::path make_shards() {
  fs::path const dir = scratch_dir();
  save(dir / "model-00001-of-00002.safetensors",
       {"model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"});
  save(dir / "model-00002-of-00002.safetensors",
       {"model.layers.0.mlp.experts.0.up_proj.weight", "lm_head.weight"});
  save(dir / "sub" / "a.safetensors", {"x"});
  save(dir / "again.safetensors", {"lm_head.weight"});  // also in model-00002-of-00002
  save(dir / "empty.safetensors", {});
  std::ofstream(dir / "broken.safetensors", std::ios::binary) << "\x10\0\0\0\0\0\0\0{\"a\":";
  return dir;
}

}  // namespace

/// Opens `data` as the index of the scratch directory; returns 1 if it was accepted, 0 if it
/// was rejected.
extern "C" int moe_fuzz_one(std::uint8_t const* data, std::size_t size) {
  static fs::path const dir = make_shards();
  fs::path const index = dir / "model.safetensors.index.json";
  {
    std::ofstream out(index, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<char const*>(data), static_cast<std::streamsize>(size));
    require(static_cast<bool>(out));
  }
  std::vector<std::string> names;
  try {
    moe::io::ShardedCheckpoint const checkpoint = moe::io::ShardedCheckpoint::open_index(index);
    names = checkpoint.names();
    require(names.size() == checkpoint.size());
    require(std::set<std::string>(names.begin(), names.end()).size() == names.size());
    for (std::string const& name : names) {
      moe::io::TensorView const* t = checkpoint.find(name);
      require(t != nullptr && t->name == name && &checkpoint.tensor(name) == t);
      (void)checkpoint.shard_metadata(name, "format");
    }
    require(!checkpoint.contains("not a tensor of any shard"));

    // The same text through the tree parser: "weight_map" lists exactly the checkpoint's
    // tensors, each in the shard it names.
    std::string_view const text(reinterpret_cast<char const*>(data), size);
    moe::io::detail::JsonCursor cur(text, "fuzz", "the index", "-");
    moe::io::detail::JsonValue const root = moe::io::detail::parse_json_value(cur);
    cur.finish();
    moe::io::detail::JsonValue const* map = root.member("weight_map");
    require(map != nullptr && map->kind == moe::io::detail::JsonKind::kObject);
    require(map->members.size() == names.size());
    std::set<std::string> shards;
    for (moe::io::detail::JsonMember const& m : map->members) {
      moe::io::TensorView const* t = checkpoint.find(m.key);
      require(t != nullptr && m.value.kind == moe::io::detail::JsonKind::kString);
      shards.insert(m.value.text);
      bool in_named_shard = false;
      for (std::size_t s = 0; s < checkpoint.num_shards(); ++s) {
        for (moe::io::TensorView const& v : checkpoint.shard(s).tensors()) {
          if (&v == t)
            in_named_shard = checkpoint.shard(s).display_name() == (dir / m.value.text).string();
        }
      }
      require(in_named_shard);
    }
    require(checkpoint.num_shards() <= shards.size());
  } catch (moe::Error const&) {
    return 0;
  }
  return 1;
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  (void)moe_fuzz_one(data, size);
  return 0;
}
