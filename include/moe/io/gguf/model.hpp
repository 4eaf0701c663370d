// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// GgufModel: a GGUF model that is one file or split into shards (llama.cpp's gguf-split:
/// name-00001-of-00003.gguf, ...), with one tensor lookup over all of them.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/io/detail/json.hpp"
#include "moe/io/gguf/file.hpp"
#include "moe/io/gguf/value.hpp"

namespace moe::io {

namespace detail {

/// The parts of a split file name "PREFIX-NNNNN-of-MMMMM.gguf" (five or more digits each, as
/// llama_split_path's %05d writes them): PREFIX, N (from 1) and M; nullopt for another name.
struct GgufSplitName {
  std::string prefix;
  std::uint32_t number = 0;
  std::uint32_t count = 0;
};

inline std::optional<GgufSplitName> parse_gguf_split_name(std::string_view file_name) {
  static constexpr std::string_view kSuffix = ".gguf";
  if (file_name.size() < kSuffix.size() || !file_name.ends_with(kSuffix)) return std::nullopt;
  std::string_view s = file_name.substr(0, file_name.size() - kSuffix.size());
  auto const take_number = [&](std::uint32_t& out) {
    std::size_t digits = 0;
    while (digits < s.size() && s[s.size() - 1 - digits] >= '0' && s[s.size() - 1 - digits] <= '9')
      ++digits;
    if (digits < 5) return false;
    std::string_view const text = s.substr(s.size() - digits);
    auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
    if (ec != std::errc() || end != text.data() + text.size()) return false;
    s.remove_suffix(digits);
    return true;
  };
  GgufSplitName name;
  if (!take_number(name.count) || !s.ends_with("-of-")) return std::nullopt;
  s.remove_suffix(4);
  if (!take_number(name.number) || !s.ends_with("-")) return std::nullopt;
  s.remove_suffix(1);
  name.prefix = std::string(s);
  return name;
}

}  // namespace detail

/// "model-00002-of-00003.gguf" for ("model", 1, 3): llama.cpp's split file name
/// (llama_split_path), whose number counts from 1 while "split.no" counts from 0.
inline std::string gguf_split_path(std::string const& prefix, std::uint64_t split_no,
                                   std::uint64_t split_count) {
  std::string a = std::to_string(split_no + 1), b = std::to_string(split_count);
  if (a.size() < 5) a.insert(0, 5 - a.size(), '0');
  if (b.size() < 5) b.insert(0, 5 - b.size(), '0');
  return prefix + "-" + a + "-of-" + b + ".gguf";
}

/// A GGUF model: one file, or all shards of a split one, opened and validated (each shard is a
/// GgufFile), with tensors looked up by name across the shards.
///
/// Split models follow llama.cpp's gguf-split: shard i (from 0) of N is named
/// PREFIX-<i+1, 5 digits>-of-<N, 5 digits>.gguf and holds "split.no" = i, "split.count" = N
/// and "split.tensors.count" = the model's tensor count; the model's metadata is in the first
/// shard. Opening any shard opens all of them, and checks: every shard exists; each says the
/// same split.count and its own split.no; split.tensors.count (when present) agrees across
/// shards and equals the number of tensors found; no tensor name is in two shards. A file
/// without split.count (or with 0 or 1, as gguf-split --merge leaves it) is a model of one
/// shard, whatever its name. Every error is a moe::Error naming the file.
///
/// Thread-safety: const member functions may be called concurrently. Move-only; tensor views
/// stay valid until the object is destroyed.
class GgufModel {
 public:
  /// Opens `path` and, when it is a shard of a split model, its siblings in the same directory.
  explicit GgufModel(std::filesystem::path const& path) {
    GgufFile first(path);
    std::uint64_t const count = split_key(first, "split.count", 0);
    if (count <= 1) {
      shards_.push_back(std::move(first));
      index_tensors(std::nullopt);
      return;
    }
    std::uint64_t const no = split_key(first, "split.no", 0);
    std::string const file_name = path.filename().string();
    std::optional<detail::GgufSplitName> const parsed = detail::parse_gguf_split_name(file_name);
    if (!parsed) {
      moe::detail::fail("gguf: ", path.string(), ": the file is shard ", no + 1, " of ", count,
                        " (split.no = ", no, ", split.count = ", count,
                        ") but its name does not end in -NNNNN-of-NNNNN.gguf, so the other shards "
                        "cannot be found; give the shards their gguf-split names");
    }
    if (parsed->count != count || parsed->number != no + 1) {
      moe::detail::fail("gguf: ", path.string(), ": the name says shard ", parsed->number, " of ",
                        parsed->count, " but the metadata says shard ", no + 1, " of ", count,
                        " (split.no = ", no, ", split.count = ", count,
                        "); the file was renamed or the shards are mixed up");
    }
    std::filesystem::path const dir = path.parent_path();
    std::optional<std::uint64_t> total;
    for (std::uint64_t i = 0; i < count; ++i) {
      if (i == no) {
        shards_.push_back(std::move(first));
      } else {
        std::filesystem::path const sibling = dir / gguf_split_path(parsed->prefix, i, count);
        std::error_code ec;
        if (!std::filesystem::exists(sibling, ec)) {
          moe::detail::fail("gguf: ", sibling.string(), ": shard ", i + 1, " of ", count,
                            " of the model is missing (opened from '", path.string(),
                            "'); download or copy every shard into the same directory");
        }
        shards_.emplace_back(sibling);
      }
      GgufFile const& shard = shards_.back();
      std::uint64_t const shard_count = split_key(shard, "split.count", 0);
      std::uint64_t const shard_no = split_key(shard, "split.no", 0);
      if (shard_count != count || shard_no != i) {
        moe::detail::fail("gguf: ", shard.display_name(), ": shard ", i + 1, " of ", count,
                          " says split.no = ", shard_no, ", split.count = ", shard_count,
                          " (expected ", i, " and ", count,
                          "); the shards belong to different models or splits, download them "
                          "again");
      }
      if (shard.has("split.tensors.count")) {
        std::uint64_t const t = split_key(shard, "split.tensors.count", 0);
        if (total && *total != t) {
          moe::detail::fail("gguf: ", shard.display_name(), ": split.tensors.count is ", t,
                            " but shard 1 says ", *total,
                            "; the shards belong to different models or splits");
        }
        total = t;
      }
    }
    index_tensors(total);
  }

  /// The model of one file already open (e.g. a GgufFile over bytes in memory); throws
  /// moe::Error when the file is a shard of a split model (open those by path).
  explicit GgufModel(GgufFile file) {
    std::uint64_t const count = split_key(file, "split.count", 0);
    moe::detail::check(count <= 1, "gguf: ", file.display_name(), ": the file is shard ",
                       split_key(file, "split.no", 0) + 1, " of ", count,
                       " of a split model; open it by path, with its sibling shards beside it");
    shards_.push_back(std::move(file));
    index_tensors(std::nullopt);
  }

  GgufModel(GgufModel&&) noexcept = default;
  GgufModel& operator=(GgufModel&&) noexcept = default;
  GgufModel(GgufModel const&) = delete;
  GgufModel& operator=(GgufModel const&) = delete;
  ~GgufModel() = default;

  std::size_t num_shards() const noexcept { return shards_.size(); }
  /// Shard `i` (from 0).
  GgufFile const& shard(std::size_t i) const { return shards_.at(i); }
  /// The first shard, which holds the model's metadata.
  GgufFile const& metadata() const noexcept { return shards_.front(); }

  /// The number of tensors over all shards.
  std::size_t size() const noexcept { return index_.size(); }
  /// The tensor named `name` in whichever shard holds it, or nullptr. Its `data` points into
  /// that shard's mapping.
  GgufTensorInfo const* find_tensor(std::string_view name) const {
    auto const it = index_.find(name);
    return it == index_.end() ? nullptr : it->second.second;
  }
  bool has_tensor(std::string_view name) const { return find_tensor(name) != nullptr; }
  /// The shard (from 0) holding `name`; throws moe::Error when no shard does.
  std::size_t shard_of(std::string_view name) const {
    auto const it = index_.find(name);
    if (it == index_.end()) missing(name);
    return it->second.first;
  }
  /// The tensor named `name`; throws moe::Error when no shard holds it.
  GgufTensorInfo const& tensor(std::string_view name) const {
    if (GgufTensorInfo const* t = find_tensor(name)) return *t;
    missing(name);
  }
  /// Every tensor name, sorted.
  std::vector<std::string_view> names() const {
    std::vector<std::string_view> out;
    out.reserve(index_.size());
    for (auto const& [name, where] : index_) out.push_back(name);
    return out;
  }

 private:
  static std::uint64_t split_key(GgufFile const& f, std::string_view key, std::uint64_t fallback) {
    return f.integer_or(key, fallback);
  }

  [[noreturn]] void missing(std::string_view name) const {
    moe::detail::fail("gguf: ", shards_.front().display_name(), ": no tensor named ",
                      detail::printable_name(name), " in the model's ", shards_.size(),
                      " shard(s) (", index_.size(), " tensors); check the name against names()");
  }

  void index_tensors(std::optional<std::uint64_t> total) {
    for (std::size_t s = 0; s < shards_.size(); ++s) {
      for (GgufTensorInfo const& t : shards_[s].tensors()) {
        auto const [it, inserted] = index_.emplace(t.name, std::make_pair(s, &t));
        if (!inserted) {
          moe::detail::fail("gguf: ", shards_[s].display_name(), ": tensor ",
                            detail::printable_name(t.name), " is also in shard ",
                            it->second.first + 1, " ('", shards_[it->second.first].display_name(),
                            "'); a tensor belongs to one shard, the shards are mixed up");
        }
      }
    }
    if (total && *total != index_.size()) {
      moe::detail::fail("gguf: ", shards_.front().display_name(), ": split.tensors.count says ",
                        *total, " tensors but the ", shards_.size(), " shards hold ", index_.size(),
                        "; a shard is from another split or was rewritten");
    }
  }

  std::vector<GgufFile> shards_;
  // Tensor name (a view of the GgufTensorInfo's name) -> (shard, info).
  std::map<std::string_view, std::pair<std::size_t, GgufTensorInfo const*>, std::less<>> index_;
};

/// Whether `path` names a GGUF file (by its magic, not its name); false for a directory.
inline bool is_gguf_file(std::filesystem::path const& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  char magic[4] = {};
  bool const ok = std::fread(magic, 1, 4, f) == 4;
  std::fclose(f);
  return ok && magic[0] == 'G' && magic[1] == 'G' && magic[2] == 'U' && magic[3] == 'F';
}

}  // namespace moe::io
