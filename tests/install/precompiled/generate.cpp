// SPDX-License-Identifier: Apache-2.0
// A whole model loaded and run through moe::precompiled's decoders: `generate DIR` loads the
// Hugging Face directory DIR and generates 4 tokens greedily after the prompt 1, 2, 3, twice
// (1 and 2 threads), and checks both give the same ids; without DIR it only links (the decoders
// must come from the library).
#include <cstdio>
#include <moe/models/decoder.hpp>
#include <moe/models/generate.hpp>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) return 0;
  std::vector<std::int64_t> const prompt = {1, 2, 3};
  std::vector<std::int64_t> ids[2];
  for (int threads : {1, 2}) {
    moe::ThreadPool pool(threads);
    moe::models::AnyDecoder const model = moe::models::load_hf_decoder(argv[1], &pool);
    moe::models::GenerateOptions o;
    o.max_new_tokens = 4;
    o.pool = &pool;
    ids[threads - 1] = moe::models::generate(model, prompt, o).ids;
  }
  std::printf("generate: %zu ids:", ids[0].size());
  for (std::int64_t id : ids[0]) std::printf(" %lld", static_cast<long long>(id));
  std::printf("\n");
  return ids[0].size() == 4 && ids[0] == ids[1] ? 0 : 1;
}
