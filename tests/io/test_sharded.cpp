// SPDX-License-Identifier: Apache-2.0
// Sharded checkpoints: model.safetensors.index.json + shards, open_checkpoint(dir), and the
// index errors (missing tensor, missing shard, duplicates, path escapes).
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "io/io_test_support.hpp"
#include "moe/io/safetensors.hpp"

namespace {

using Catch::Contains;
using moe::io::ShardedCheckpoint;
namespace fs = std::filesystem;

constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";

std::vector<float> iota(std::size_t n, float start) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

// Two shards as transformers writes them for a tiny MoE layer.
void write_shards(fs::path const& dir) {
  moe::io::SafetensorsWriter s1;
  s1.add_f32("model.layers.0.mlp.gate.weight", {4, 8}, iota(32, 0.0f))
      .add_bf16("model.embed_tokens.weight", {2, 8}, iota(16, 100.0f))
      .set_metadata("format", "pt");
  s1.save(dir / kShard1);
  moe::io::SafetensorsWriter s2;
  s2.add_f32("model.layers.0.mlp.experts.0.w1.weight", {3, 8}, iota(24, -5.0f))
      .add_f16("model.layers.0.mlp.experts.0.w2.weight", {8, 3}, iota(24, 0.5f))
      .set_metadata("format", "pt");
  s2.save(dir / kShard2);
}

std::string weight_map_entries() {
  return std::string(R"("model.layers.0.mlp.gate.weight": ")") + kShard1 + R"(",
    "model.embed_tokens.weight": ")" +
         kShard1 + R"(",
    "model.layers.0.mlp.experts.0.w1.weight": ")" +
         kShard2 + R"(",
    "model.layers.0.mlp.experts.0.w2.weight": ")" +
         kShard2 + R"(")";
}

void write_index(fs::path const& dir, std::string const& weight_map) {
  iotest::write_text(dir / "model.safetensors.index.json",
                     R"({
  "metadata": {"total_size": 400, "format": ["anything", {"goes": null}], "x": 1.5e3},
  "weight_map": {
    )" + weight_map + R"(
  }
})");
}

std::string error_of_index(fs::path const& dir) {
  try {
    ShardedCheckpoint const c = ShardedCheckpoint::open_index(dir / "model.safetensors.index.json");
    c.verify();  // shards are opened on first use; verify() opens them all
  } catch (moe::Error const& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("a sharded checkpoint finds every tensor by name across its shards", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_ok");
  write_shards(dir);
  write_index(dir, weight_map_entries());

  ShardedCheckpoint const ckpt =
      ShardedCheckpoint::open_index(dir / "model.safetensors.index.json");
  CHECK(ckpt.num_shards() == 2);
  CHECK(ckpt.size() == 4);
  CHECK(ckpt.shard(0).display_name() == (dir / kShard1).string());
  CHECK(ckpt.names() == std::vector<std::string>{"model.embed_tokens.weight",
                                                 "model.layers.0.mlp.experts.0.w1.weight",
                                                 "model.layers.0.mlp.experts.0.w2.weight",
                                                 "model.layers.0.mlp.gate.weight"});
  CHECK(moe::io::to_float(ckpt.tensor("model.layers.0.mlp.gate.weight")) == iota(32, 0.0f));
  CHECK(moe::io::to_float(ckpt.tensor("model.layers.0.mlp.experts.0.w1.weight")) ==
        iota(24, -5.0f));
  CHECK(moe::io::to_float(ckpt.tensor("model.layers.0.mlp.experts.0.w2.weight")) ==
        iota(24, 0.5f));  // exact in F16
  CHECK(moe::io::to_float(ckpt.tensor("model.embed_tokens.weight")) == iota(16, 100.0f));
  CHECK(ckpt.tensor("model.layers.0.mlp.experts.0.w2.weight").dtype == moe::io::Dtype::kF16);
  CHECK(ckpt.find("lm_head.weight") == nullptr);
  CHECK_THROWS_WITH(ckpt.tensor("lm_head.weight"),
                    Contains("no tensor named 'lm_head.weight' in the checkpoint (4 tensors)"));

  // open_checkpoint(dir) takes the index when there is no model.safetensors ...
  ShardedCheckpoint const by_dir = moe::io::open_checkpoint(dir);
  CHECK(by_dir.num_shards() == 2);
  CHECK(by_dir.contains("model.embed_tokens.weight"));
  // ... and model.safetensors when there is one.
  moe::io::SafetensorsWriter single;
  single.add_f32("only", {1}, std::vector<float>{7.0f});
  single.save(dir / "model.safetensors");
  ShardedCheckpoint const single_ckpt = moe::io::open_checkpoint(dir);
  CHECK(single_ckpt.num_shards() == 1);
  CHECK(single_ckpt.names() == std::vector<std::string>{"only"});
  CHECK(moe::io::open_checkpoint(dir / kShard2).size() == 2);
  CHECK(moe::io::open_checkpoint(dir / "model.safetensors.index.json").size() == 4);
}

TEST_CASE("a moved sharded checkpoint keeps its views", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_move");
  write_shards(dir);
  write_index(dir, weight_map_entries());
  ShardedCheckpoint a = moe::io::open_checkpoint(dir);
  moe::io::TensorView const* view = a.find("model.layers.0.mlp.gate.weight");
  ShardedCheckpoint const b = std::move(a);
  CHECK(b.find("model.layers.0.mlp.gate.weight") == view);
  CHECK(moe::io::to_float(*view) == iota(32, 0.0f));
}

TEST_CASE("index errors: a listed tensor missing from its shard", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_missing_tensor");
  write_shards(dir);
  write_index(dir, weight_map_entries() + R"(, "lm_head.weight": ")" + kShard2 + "\"");
  CHECK_THAT(error_of_index(dir),
             Contains("tensor 'lm_head.weight' is listed in shard "
                      "'model-00002-of-00002.safetensors' but that file does not contain it"));
  // A tensor with an empty name (found by the index fuzzer: it was taken for "no index").
  write_index(dir, std::string(R"("": ")") + kShard1 + "\"");
  ShardedCheckpoint const c = moe::io::open_checkpoint(dir);
  CHECK_THROWS_WITH(c.find(""), Contains("tensor '' is listed in shard "
                                         "'model-00001-of-00002.safetensors' but that file does "
                                         "not contain it"));
}

TEST_CASE("index errors: a shard file missing", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_missing_shard");
  write_shards(dir);
  fs::remove(dir / kShard2);
  write_index(dir, weight_map_entries());
  CHECK_THAT(error_of_index(dir),
             Contains("shard 'model-00002-of-00002.safetensors' (holding tensor "
                      "'model.layers.0.mlp.experts.0.w1.weight') does not exist"));
}

TEST_CASE("shards are opened only when a tensor they hold is needed", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_lazy");
  write_shards(dir);
  fs::remove(dir / kShard2);  // not downloaded: only the tensors of shard 1 are needed
  write_index(dir, weight_map_entries());
  ShardedCheckpoint const ckpt = moe::io::open_checkpoint(dir);
  CHECK(ckpt.size() == 4);
  CHECK(ckpt.contains("model.layers.0.mlp.experts.0.w1.weight"));  // from the index
  CHECK_FALSE(ckpt.shard_opened(0));
  CHECK_FALSE(ckpt.shard_opened(1));
  CHECK(moe::io::to_float(ckpt.tensor("model.layers.0.mlp.gate.weight")) == iota(32, 0.0f));
  CHECK(ckpt.shard_opened(0));
  CHECK_FALSE(ckpt.shard_opened(1));
  CHECK(ckpt.shard_path(1) == dir / kShard2);
  CHECK_THROWS_WITH(ckpt.find("model.layers.0.mlp.experts.0.w2.weight"),
                    Contains("shard 'model-00002-of-00002.safetensors' (holding tensor "
                             "'model.layers.0.mlp.experts.0.w1.weight') does not exist"));
  CHECK_FALSE(ckpt.shard_opened(1));
  // Once it is there, the same checkpoint object opens it.
  write_shards(dir);
  CHECK(moe::io::to_float(ckpt.tensor("model.layers.0.mlp.experts.0.w1.weight")) ==
        iota(24, -5.0f));
  CHECK(ckpt.shard_opened(1));
}

TEST_CASE("index errors: a name in two shards", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_duplicate");
  write_shards(dir);
  SECTION("listed twice in the weight map") {
    write_index(dir, weight_map_entries() + R"(, "model.embed_tokens.weight": ")" + kShard2 + "\"");
    CHECK_THAT(error_of_index(dir),
               Contains("tensor 'model.embed_tokens.weight' is listed twice in \"weight_map\" "
                        "(shards 'model-00001-of-00002.safetensors' and "
                        "'model-00002-of-00002.safetensors')"));
  }
  SECTION("stored in two shard files") {
    moe::io::SafetensorsWriter s2;
    s2.add_f32("model.layers.0.mlp.experts.0.w1.weight", {3, 8}, iota(24, -5.0f))
        .add_f32("model.embed_tokens.weight", {1}, std::vector<float>{1.0f});
    s2.save(dir / kShard2);
    write_index(dir, std::string(R"("model.embed_tokens.weight": ")") + kShard1 + R"(",
      "model.layers.0.mlp.experts.0.w1.weight": ")" +
                         kShard2 + "\"");
    CHECK_THAT(error_of_index(dir), Contains("tensor 'model.embed_tokens.weight' is stored in two "
                                             "shards"));
  }
}

TEST_CASE("index errors: shard paths must stay inside the directory", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_escape");
  write_shards(dir);
  fs::copy_file(dir / kShard1, dir.parent_path() / "outside.safetensors",
                fs::copy_options::overwrite_existing);
  write_index(dir, R"("w": "../outside.safetensors")");
  CHECK_THAT(error_of_index(dir),
             Contains("tensor 'w' is mapped to shard '../outside.safetensors', which tries to "
                      "leave the directory with \"..\""));
  write_index(dir, R"("w": "sub/../../outside.safetensors")");
  CHECK_THAT(error_of_index(dir), Contains("tries to leave the directory"));
  write_index(dir, R"("w": "/etc/passwd")");
  CHECK_THAT(error_of_index(dir), Contains("which is an absolute path"));
  write_index(dir, R"("w": "")");
  CHECK_THAT(error_of_index(dir), Contains("which is empty"));
  write_index(dir, R"("w": "a\u0000b")");
  CHECK_THAT(error_of_index(dir), Contains("contains a NUL character"));
}

TEST_CASE("index errors: malformed index files", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_malformed");
  fs::path const index = dir / "model.safetensors.index.json";
  iotest::write_text(index, R"({"metadata": {}})");
  CHECK_THAT(error_of_index(dir), Contains("the index has no \"weight_map\""));
  iotest::write_text(index, R"({"weight_map": {"w": 3}})");
  CHECK_THAT(error_of_index(dir),
             Contains("\"weight_map\" entry of tensor 'w' is a number, but must be a shard file "
                      "name"));
  iotest::write_text(index, R"({"weight_map": []})");
  CHECK_THAT(error_of_index(dir), Contains("\"weight_map\" must be an object"));
  iotest::write_text(index, R"({"weight_map": {"w": "a.safetensors",}})");
  CHECK_THAT(error_of_index(dir),
             Contains(index.string() + ": the index is not valid JSON: trailing comma"));
  iotest::write_text(index, "[1]");
  CHECK_THAT(error_of_index(dir), Contains("the index must be a JSON object"));
  fs::remove(index);
  CHECK_THAT(error_of_index(dir), Contains("cannot open"));
  CHECK_THROWS_WITH(moe::io::open_checkpoint(dir),
                    Contains("has neither model.safetensors nor model.safetensors.index.json"));
}

TEST_CASE("a corrupt shard is reported with the shard's path", "[io][sharded]") {
  fs::path const dir = iotest::scratch_dir("sharded_corrupt");
  write_shards(dir);
  std::vector<std::byte> bytes = iotest::read_file(dir / kShard2);
  bytes.pop_back();  // truncated download
  iotest::write_file(dir / kShard2, bytes);
  write_index(dir, weight_map_entries());
  CHECK_THAT(error_of_index(dir), Contains((dir / kShard2).string() + ": the tensors need"));
}
