// SPDX-License-Identifier: Apache-2.0
// Two of AnyDecoder's decoders compiled once for moe::precompiled and our tests and tools
// (MOE_EXTERN_DECODERS, models/decoder.hpp). This header first: its own includes must be enough for
// them.
#include "moe/models/decoder.hpp"

MOE_DECODER_INSTANTIATION(, ::moe::presets::MixtralMoe)
MOE_DECODER_INSTANTIATION(, ::moe::presets::Llama4Moe)
