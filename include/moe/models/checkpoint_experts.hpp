// SPDX-License-Identifier: Apache-2.0
// This file is part of moe, a header-only library of sparse Mixture-of-Experts layers.
/// \file
/// CheckpointExperts: a model's routed experts streamed straight from its own file (a GGUF file
/// or a Hugging Face safetensors checkpoint), with no expert store written first: on a miss,
/// the expert's record is packed from the file (stored blocks re-packed as they are, fp32 / bf16
/// / F16 weights converted), into the buffer the kernels multiply from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moe/core/error.hpp"
#include "moe/core/types.hpp"
#include "moe/experts/expert_bank.hpp"
#include "moe/experts/weight_format.hpp"
#include "moe/io/hf/layer.hpp"
#include "moe/io/safetensors/sharded.hpp"
#include "moe/offload/store.hpp"

namespace moe::models {

/// An offload::RecordSource over a checkpoint: MoE layer i's routed experts (in the order
/// add_layer was called) in the formats given there, each record made on demand by
/// ExpertBank::pack_record from the file. A quantized format must be the format the file stores
/// that projection in (re-packing blocks costs about what reading them does; quantizing on every
/// miss would cost a second per expert): for another one, write an expert store
/// (moe/offload/store.hpp) once. `Bank` is the layer type's ExpertBank. Thread-safe reads; the
/// checkpoint stays mapped while the source lives.
template <class Bank>
class CheckpointExperts final : public offload::RecordSource {
 public:
  CheckpointExperts(std::shared_ptr<io::ShardedCheckpoint const> checkpoint, io::HfMoeConfig config)
      : ckpt_(std::move(checkpoint)), config_(std::move(config)) {
    moe::detail::check(ckpt_ != nullptr, "models::CheckpointExperts: no checkpoint");
    shape_ = {0, config_.num_experts, config_.hidden_size, config_.expert_intermediate_size,
              Bank::Expert::gated};
  }

  /// Adds MoE layer `layer` of the checkpoint (read with `options`' prefix) as the next MoE
  /// layer, its experts streamed in the formats `choose(stored)` returns (one per expert), given
  /// the formats the file stores them in (io::detail::StoredExperts::routed: empty for float
  /// tensors). Reads headers only. Throws
  /// moe::Error (naming the file, layer and expert) for a quantized format the file does not
  /// store that projection in, and as ExpertBank::stream_records for formats that cannot hold
  /// the shapes.
  template <class Choose>
  void add_layer(Index layer, io::HfLoadOptions const& options, Choose&& choose) {
    auto l = std::make_unique<Layer>();
    auto [layout, tensors] = io::detail::checked_hf_layer_tensors(config_, *ckpt_, layer, options);
    l->index = layer;
    l->prefix = layout.prefix;
    l->tensors = std::move(tensors);
    l->stored = io::detail::scan_stored_experts(config_, *ckpt_, l->tensors, true);
    std::vector<experts::ExpertFormat> const formats = choose(l->stored.routed);
    experts::StoredBlocks const blocks = l->stored.blocks.routed();
    Index const E = config_.num_experts;
    moe::detail::check(static_cast<Index>(formats.size()) == E,
                       "models::CheckpointExperts: ", formats.size(), " formats for ", E,
                       " experts");
    for (Index e = 0; e < E; ++e) {
      experts::ExpertFormat const& f = formats[static_cast<std::size_t>(e)];
      auto stored_as = [&](experts::Projection p, experts::WeightFormat w) {
        return !experts::is_quantized(w) || blocks(e, p, w) != nullptr;
      };
      bool const in_ok = stored_as(experts::Projection::kUp, f.in) &&
                         (!Bank::Expert::gated || stored_as(experts::Projection::kGate, f.in));
      bool const down_ok = stored_as(experts::Projection::kDown, f.down);
      if (in_ok && down_ok) continue;
      experts::ExpertFormat const s = l->stored.routed.empty()
                                          ? experts::ExpertFormat{}
                                          : l->stored.routed[static_cast<std::size_t>(e)];
      moe::detail::fail(
          "models: ", ckpt_->source(), ": expert ", e, " of layer ", layer, " would stream its ",
          in_ok ? "down" : "gate/up", " projection as ", experts::name(in_ok ? f.down : f.in),
          ", but the file stores it as ",
          l->stored.routed.empty() ? "floats" : experts::name(in_ok ? s.down : s.in),
          "; streaming from the model's file re-packs stored blocks and never quantizes (that "
          "would cost seconds per miss): keep the stored formats, or write an expert store in "
          "this format once (moe_generate --write-expert-store) and stream from it");
    }
    {
      experts::EmptyWeights const scope;
      l->bank = Bank(E, config_.hidden_size, config_.expert_intermediate_size);
    }
    l->table.assign(static_cast<std::size_t>(E), nullptr);  // never read: only the layout
    l->bank.stream_records(formats, l->table.data());
    for (Index e = 0; e < E; ++e) {
      std::uint64_t const bytes = static_cast<std::uint64_t>(l->bank.packed_record_bytes(e));
      l->buffer_bytes.push_back(offload::detail::round_up(bytes, offload::kStoreAlign));
    }
    Layer const* const raw = l.get();
    l->source = experts::ExpertSource{
        blocks, [this, raw](Index e, float* in, float* down) {
          io::detail::read_one_expert(
              *ckpt_, config_, raw->index, raw->prefix, raw->tensors, e, false,
              {in, down, config_.hidden_size, config_.expert_intermediate_size, Bank::kInFactor});
        }};
    layers_.push_back(std::move(l));
    shape_.num_layers = static_cast<Index>(layers_.size());
  }

  offload::StoreShape const& shape() const override { return shape_; }
  std::vector<experts::ExpertFormat> layer_formats(Index layer) const override {
    std::span<experts::ExpertFormat const> const f = at(layer).bank.packed_formats();
    return {f.begin(), f.end()};
  }
  std::uint64_t buffer_bytes(Index layer, Index expert) const override {
    return at(layer).buffer_bytes.at(static_cast<std::size_t>(expert));
  }
  void read(Index layer, Index expert, std::byte* dst) const override {
    Layer const& l = at(layer);
    l.bank.pack_record(expert, l.source, dst);
  }
  std::string const& path() const override { return ckpt_->source(); }

 private:
  struct Layer {
    Index index = 0;
    std::string prefix;
    std::vector<io::HfTensor> tensors;
    io::detail::StoredExperts stored;
    Bank bank;                            // no weights: the records' layout and formats
    std::vector<std::byte const*> table;  // its (unused) record table
    std::vector<std::uint64_t> buffer_bytes;
    experts::ExpertSource source;
  };
  Layer const& at(Index layer) const {
    moe::detail::check(layer >= 0 && layer < shape_.num_layers, "models::CheckpointExperts: MoE ",
                       "layer ", layer, " is outside the ", shape_.num_layers, " added");
    return *layers_[static_cast<std::size_t>(layer)];
  }

  std::shared_ptr<io::ShardedCheckpoint const> ckpt_;
  io::HfMoeConfig config_;
  offload::StoreShape shape_;
  std::vector<std::unique_ptr<Layer>> layers_;
};

}  // namespace moe::models
