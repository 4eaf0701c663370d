// SPDX-License-Identifier: Apache-2.0
// The names the code blocks of README.md and docs/*.md may use without declaring them (see
// tests/docs/README.md). The blocks are compiled, never linked or run, so these are
// declarations only: a fragment that says `layer.forward(x, y, ws)` compiles against the types
// below, and one that declares its own `layer` hides this one (the test builds with -Wno-shadow).
#pragma once

#include <iostream>
#include <moe/io/hf.hpp>
#include <moe/io/safetensors.hpp>
#include <moe/moe.hpp>
#include <variant>
#include <vector>

namespace docs_prelude {  // every block sees it (using namespace docs_prelude)

// Sizes: T tokens, D d_model, F d_ffn, E routed experts.
inline constexpr moe::Index T = 64, D = 2048, F = 768, E = 128;

// Activations and their gradients, [T, D] row-major views (e.g. moe::view of an
// moe::RowMatrixX<float>).
extern moe::MatrixView<float> x, y, h, h2, dx, dy, dh, dh2;

extern moe::ThreadPool pool;
extern moe::MoeFfnWorkspace ws, fws;    // MoeFfn workspaces
extern moe::MoeAttentionWorkspace aws;  // MoeAttention workspace
extern moe::presets::Qwen3Moe layer;    // a layer whose weights are set
extern moe::optim::AdamW optimizer;

}  // namespace docs_prelude
