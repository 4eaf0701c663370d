// SPDX-License-Identifier: Apache-2.0
// Writes the oracle for the moe tokenizer test: for each model package, the path of the
// tokenizer.json it ships and the ids @lenml/tokenizers (a port of transformers.js' tokenizers)
// gives each corpus string, without special tokens added around the text (special tokens written
// in the text are still recognised) and with them.
// usage: node make_oracle.mjs CORPUS.json OUT_DIR   (run from the directory holding node_modules)
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import path from "node:path";

const require = createRequire(path.join(process.cwd(), "package.json"));
const [corpusPath, outDir] = process.argv.slice(2);
const corpus = JSON.parse(readFileSync(corpusPath, "utf8"));
for (const model of ["qwen3", "deepseek_v3", "gptoss", "llama2"]) {
  const pkg = `@lenml/tokenizer-${model}`;
  const tokenizer = require(pkg).fromPreTrained();
  const json = require.resolve(`${pkg}/models/tokenizer.json`);
  const cases = corpus.map((text) => ({
    text,
    ids: Array.from(tokenizer.encode(text, { add_special_tokens: false })),
    ids_special: Array.from(tokenizer.encode(text, { add_special_tokens: true })),
  }));
  // The chat template of one user message with the generation prompt, where the bundled Jinja
  // renders the model's template (DeepSeek-V3's; Qwen3's is beyond it, gpt-oss ships none).
  let chat = [];
  try {
    chat = corpus.slice(0, 60).map((text) => {
      const messages = [{ role: "user", content: text }];
      const options = { add_generation_prompt: true, return_tensor: false };
      return {
        text,
        chat: tokenizer.apply_chat_template(messages, { ...options, tokenize: false }),
        ids: Array.from(tokenizer.apply_chat_template(messages, { ...options, tokenize: true })),
      };
    });
  } catch (e) {
    console.log(`${model}: no chat oracle (${String(e.message).slice(0, 80)})`);
  }
  const out = path.join(outDir, `oracle_${model}.json`);
  writeFileSync(out, JSON.stringify({ model, tokenizer: json, cases, chat }));
  console.log(`${out}: ${cases.length} strings`);
}
