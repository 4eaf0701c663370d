// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// ShardedCheckpoint: tensors found by name across the shards of a model.safetensors.index.json.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/detail/mapped_file.hpp"
#include "moe/io/safetensors/file.hpp"
#include "moe/io/safetensors/tensor_view.hpp"

namespace moe::io {

/// A checkpoint split into several .safetensors shards, as Hugging Face writes models above
/// 5 GB: `model.safetensors.index.json` = {"metadata": {...}, "weight_map": {"<tensor>":
/// "<shard file>", ...}}, next to `model-00001-of-0000N.safetensors` and so on. A checkpoint
/// of a single file (no index) can be opened the same way (open_single()).
///
/// Construction reads the index only, and checks:
///   - the index is JSON with a "weight_map" object of string values ("metadata" and other
///     keys are not validated: tools put different things there);
///   - no tensor is listed twice in "weight_map";
///   - every shard name is a relative path inside the index's directory (no "..", no
///     absolute path, no NUL).
/// A shard is opened (mapped and validated) the first time a tensor it holds is asked for
/// (find, tensor, shard_metadata), so only the shards a caller needs must be on disk: loading one
/// layer of a 160-shard DeepSeek-V3 reads the one or two shards that hold it. Opening a shard
/// checks that the file exists, that it holds every tensor the index lists in it, and that it
/// holds no tensor the index places in another shard (stored twice). verify() opens every shard
/// and runs the same checks for the whole checkpoint. Tensors that a shard holds but the index
/// does not list are ignored, as transformers does. Every violation throws moe::Error naming the
/// index, the shard and the tensor.
///
/// Thread-safety: const member functions may be called concurrently (each shard is opened once).
/// Move-only; views stay valid until the object is destroyed.
class ShardedCheckpoint {
 public:
  /// Reads `index_path` (a model.safetensors.index.json); shards are opened when needed.
  static ShardedCheckpoint open_index(std::filesystem::path const& index_path) {
    ShardedCheckpoint checkpoint;
    checkpoint.load_index(index_path);
    return checkpoint;
  }

  /// A one-file checkpoint (model.safetensors): every tensor of the file (opened at once).
  static ShardedCheckpoint open_single(std::filesystem::path const& path) {
    ShardedCheckpoint checkpoint;
    checkpoint.source_ = path.string();
    auto shard = std::make_unique<Shard>();
    shard->name = path.filename().string();
    shard->path = path;
    checkpoint.shards_.push_back(std::move(shard));
    SafetensorsFile const& file = checkpoint.open_shard(0);
    for (TensorView const& t : file.tensors()) checkpoint.by_name_.emplace(t.name, 0);
    return checkpoint;
  }

  /// A checkpoint of one already open file (e.g. SafetensorsFile::from_views()); `source`
  /// names it in messages.
  static ShardedCheckpoint from_file(SafetensorsFile file, std::string source) {
    ShardedCheckpoint checkpoint;
    checkpoint.source_ = std::move(source);
    auto shard = std::make_unique<Shard>();
    shard->name = checkpoint.source_;
    shard->path = checkpoint.source_;
    shard->file = std::make_unique<SafetensorsFile>(std::move(file));
    std::call_once(shard->once, [] {});
    shard->opened.store(true, std::memory_order_release);
    checkpoint.shards_.push_back(std::move(shard));
    for (TensorView const& t : checkpoint.shards_[0]->file->tensors()) {
      checkpoint.by_name_.emplace(t.name, 0);
    }
    return checkpoint;
  }

  ShardedCheckpoint(ShardedCheckpoint&&) noexcept = default;
  ShardedCheckpoint& operator=(ShardedCheckpoint&&) noexcept = default;
  ShardedCheckpoint(ShardedCheckpoint const&) = delete;
  ShardedCheckpoint& operator=(ShardedCheckpoint const&) = delete;
  ~ShardedCheckpoint() = default;

  /// The tensor named `name`, or nullptr (opens its shard on first use; throws moe::Error if
  /// that shard is missing or does not match the index).
  TensorView const* find(std::string_view name) const {
    auto const it = by_name_.find(name);
    if (it == by_name_.end()) return nullptr;
    return open_shard(it->second).find(name);
  }
  /// Whether the index (or single file) lists `name`; opens nothing.
  bool contains(std::string_view name) const { return by_name_.find(name) != by_name_.end(); }

  /// The tensor named `name`; throws moe::Error when the checkpoint has none.
  TensorView const& tensor(std::string_view name) const {
    if (TensorView const* t = find(name)) return *t;
    moe::detail::fail("safetensors: ", source_, ": no tensor named ", detail::printable_name(name),
                      " in the checkpoint (", by_name_.size(),
                      " tensors); check the name against names()");
  }

  /// Every tensor name, sorted (from the index; opens nothing).
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(by_name_.size());
    for (auto const& [name, shard] : by_name_) out.push_back(name);
    return out;
  }
  std::size_t size() const noexcept { return by_name_.size(); }

  /// The shards, in the order of their first appearance in the index.
  std::size_t num_shards() const noexcept { return shards_.size(); }
  /// Shard i, opened if it was not yet.
  SafetensorsFile const& shard(std::size_t i) const {
    moe::detail::check(i < shards_.size(), "safetensors: ", source_, ": shard index ", i,
                       " is out of range; the checkpoint has ", shards_.size(), " shards");
    return open_shard(i);
  }
  /// The path of shard i (opens nothing).
  std::filesystem::path const& shard_path(std::size_t i) const {
    moe::detail::check(i < shards_.size(), "safetensors: ", source_, ": shard index ", i,
                       " is out of range; the checkpoint has ", shards_.size(), " shards");
    return shards_[i]->path;
  }
  /// Whether shard i has been opened.
  bool shard_opened(std::size_t i) const {
    return i < shards_.size() && shards_[i]->opened.load(std::memory_order_acquire);
  }

  /// The "__metadata__" value `key` of the shard that holds tensor `tensor`, or null (no such
  /// tensor or key).
  std::string const* shard_metadata(std::string_view tensor, std::string const& key) const {
    auto const it = by_name_.find(tensor);
    if (it == by_name_.end()) return nullptr;
    SafetensorsFile const& f = open_shard(it->second);
    auto const m = f.metadata().find(key);
    return m == f.metadata().end() ? nullptr : &m->second;
  }

  /// Opens every shard and checks the whole checkpoint against its index (what construction
  /// did before shards were opened lazily); throws moe::Error on the first problem.
  void verify() const {
    for (std::size_t i = 0; i < shards_.size(); ++i) open_shard(i);
  }

  /// The index (or single file) this checkpoint was opened from.
  std::string const& source() const noexcept { return source_; }

 private:
  struct Shard {
    std::string name;             // as the index spells it
    std::filesystem::path path;   // index directory / name
    std::string first_tensor;     // the first tensor the index lists in it
    bool indexed = false;         // listed by an index (false: open_single)
    mutable std::once_flag once;  // opened exactly once, even from several threads
    mutable std::atomic<bool> opened{false};
    mutable std::unique_ptr<SafetensorsFile> file;
  };

  ShardedCheckpoint() = default;

  SafetensorsFile const& open_shard(std::size_t i) const {
    Shard const& shard = *shards_[i];
    std::call_once(shard.once, [&] {
      shard.file = load_shard(i);
      shard.opened.store(true, std::memory_order_release);
    });
    return *shard.file;
  }

  // Opens shard i and checks it against the index.
  std::unique_ptr<SafetensorsFile> load_shard(std::size_t i) const {
    Shard const& shard = *shards_[i];
    std::error_code ec;
    if (shard.indexed && !std::filesystem::exists(shard.path, ec)) {
      moe::detail::fail("safetensors: ", source_, ": shard ", detail::printable_name(shard.name),
                        " (holding tensor ", detail::printable_name(shard.first_tensor),
                        ") does not exist at '", shard.path.string(),
                        "'; download it (every shard that holds a tensor you load must be on "
                        "disk)");
    }
    auto file = std::make_unique<SafetensorsFile>(shard.path);
    if (!shard.indexed) return file;  // open_single: no index to check against
    for (auto const& [tensor, s] : by_name_) {
      if (s == i && file->find(tensor) == nullptr) {
        moe::detail::fail("safetensors: ", source_, ": tensor ", detail::printable_name(tensor),
                          " is listed in shard ", detail::printable_name(shard.name),
                          " but that file does not contain it; the index and the shards come "
                          "from different saves, re-download the checkpoint");
      }
    }
    for (TensorView const& t : file->tensors()) {
      auto const it = by_name_.find(t.name);
      if (it != by_name_.end() && it->second != i) {
        moe::detail::fail("safetensors: ", source_, ": tensor ", detail::printable_name(t.name),
                          " is stored in two shards: the index places it in ",
                          detail::printable_name(shards_[it->second]->name), " but ",
                          detail::printable_name(file->display_name()),
                          " holds it too; the shards come from different saves, re-download "
                          "the checkpoint");
      }
    }
    return file;
  }

  // A shard file name from the index must stay inside the index's directory.
  void check_shard_name(std::string const& shard, std::string const& tensor) const {
    auto const bad = [&](char const* why) {
      moe::detail::fail("safetensors: ", source_, ": tensor ", detail::printable_name(tensor),
                        " is mapped to shard ", detail::printable_name(shard), ", which ", why,
                        "; shard names must be file names relative to the index's directory");
    };
    if (shard.empty()) bad("is empty");
    if (shard.find('\0') != std::string::npos) bad("contains a NUL character");
    std::filesystem::path const p(shard);
    if (p.is_absolute() || p.has_root_path()) bad("is an absolute path");
    for (auto const& part : p) {
      if (part == "..") bad("tries to leave the directory with \"..\"");
    }
    if (!p.has_filename() || p.filename() == ".") bad("does not name a file");
  }

  void load_index(std::filesystem::path const& index_path) {
    source_ = index_path.string();
    detail::MappedFile const file(index_path, "safetensors",
                                  "the path of a model.safetensors.index.json file");
    std::span<std::byte const> const bytes = file.bytes();
    if (bytes.size() > kMaxHeaderSize) {
      moe::detail::fail("safetensors: ", source_, ": the index is ", bytes.size(),
                        " bytes, more than the ", kMaxHeaderSize,
                        "-byte limit; it is not a model.safetensors.index.json");
    }
    std::string_view const text(reinterpret_cast<char const*>(bytes.data()), bytes.size());
    if (std::size_t const bad = detail::find_invalid_utf8(text); bad != std::string_view::npos) {
      moe::detail::fail("safetensors: ", source_, ": the index is not valid UTF-8 (at byte ", bad,
                        "); it is corrupt or not a model.safetensors.index.json");
    }
    std::string const hint = "it is corrupt or not a model.safetensors.index.json";
    detail::JsonCursor cur(text, detail::concat("safetensors: ", source_), "the index", hint);
    if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kObject) {
      moe::detail::fail("safetensors: ", source_, ": the index must be a JSON object, but it is ",
                        detail::json_kind_name(kind), "; ", hint);
    }
    // weight_map in index order: (tensor, shard).
    std::vector<std::pair<std::string, std::string>> weight_map;
    std::map<std::string, std::string, std::less<>> shard_of;
    bool seen_weight_map = false;
    std::string key;
    bool first = true;
    cur.begin_object();
    while (cur.next_member(key, first)) {
      if (key != "weight_map") {
        cur.skip_value();  // "metadata" (total_size, ...) and anything else: not validated
        continue;
      }
      if (seen_weight_map) {
        moe::detail::fail("safetensors: ", source_, ": the index has two \"weight_map\" keys; ",
                          hint);
      }
      seen_weight_map = true;
      if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kObject) {
        moe::detail::fail("safetensors: ", source_,
                          ": \"weight_map\" must be an object of tensor name -> shard file, but "
                          "it is ",
                          detail::json_kind_name(kind), "; ", hint);
      }
      std::string tensor;
      bool first_entry = true;
      cur.begin_object();
      while (cur.next_member(tensor, first_entry)) {
        if (detail::JsonKind const kind = cur.peek(); kind != detail::JsonKind::kString) {
          moe::detail::fail("safetensors: ", source_, ": \"weight_map\" entry of tensor ",
                            detail::printable_name(tensor), " is ", detail::json_kind_name(kind),
                            ", but must be a shard file name; ", hint);
        }
        std::string shard = cur.read_string();
        auto const [it, inserted] = shard_of.emplace(tensor, shard);
        if (!inserted) {
          moe::detail::fail("safetensors: ", source_, ": tensor ", detail::printable_name(tensor),
                            " is listed twice in \"weight_map\" (shards ",
                            detail::printable_name(it->second), " and ",
                            detail::printable_name(shard),
                            "); a tensor lives in exactly one shard, fix the index");
        }
        check_shard_name(shard, tensor);
        weight_map.emplace_back(tensor, std::move(shard));
      }
    }
    cur.finish();
    if (!seen_weight_map) {
      moe::detail::fail("safetensors: ", source_, ": the index has no \"weight_map\"; ", hint);
    }

    // Shards in order of first appearance; opened on first use (open_shard).
    std::filesystem::path const dir = index_path.parent_path();
    std::map<std::string, std::size_t, std::less<>> shard_index;
    for (auto const& [tensor, shard] : weight_map) {
      auto const [it, inserted] = shard_index.emplace(shard, shards_.size());
      if (inserted) {
        auto s = std::make_unique<Shard>();
        s->name = shard;
        s->path = dir / shard;
        s->first_tensor = tensor;
        s->indexed = true;
        shards_.push_back(std::move(s));
      }
      by_name_.emplace(tensor, it->second);
    }
  }

  std::string source_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::map<std::string, std::size_t, std::less<>> by_name_;  // tensor -> shard
};

/// Opens a Hugging Face model directory: `model.safetensors` when it exists, otherwise
/// `model.safetensors.index.json` and its shards. A path to a .safetensors file or to an
/// index .json file is opened directly.
inline ShardedCheckpoint open_checkpoint(std::filesystem::path const& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::filesystem::path const single = path / "model.safetensors";
    if (std::filesystem::exists(single, ec)) return ShardedCheckpoint::open_single(single);
    std::filesystem::path const index = path / "model.safetensors.index.json";
    if (std::filesystem::exists(index, ec)) return ShardedCheckpoint::open_index(index);
    moe::detail::fail("safetensors: '", path.string(),
                      "' has neither model.safetensors nor model.safetensors.index.json; pass "
                      "the directory of a Hugging Face checkpoint that has safetensors weights");
  }
  if (path.extension() == ".json") return ShardedCheckpoint::open_index(path);
  return ShardedCheckpoint::open_single(path);
}

}  // namespace moe::io
