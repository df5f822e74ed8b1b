// Engram compressed token map of DeepSeek V4.1 (model-v41.md §3.2.1): raw token id ->
// compressed id, derived from the tokenizer exactly as the reference does with the
// Python `tokenizers` normalizers.
//
// For every id 0 .. size()-1 in order: text = the raw decode of that single id
// (special tokens kept; bytes made valid UTF-8 as Rust's from_utf8_lossy does). If
// text contains U+FFFD the key is the token's vocab string; otherwise the key is
// N(text), or text itself when N(text) is empty, where N = NFKC -> NFD -> strip
// accents (drop General_Category M: Mn, Mc, Me, as HF StripAccents does) ->
// lowercase (per character, full mapping, as HF Lowercase: char::to_lowercase) ->
// every run of [ \t\r\n]+ to one space -> a text that is exactly " " becomes the
// sentinel U+E000 -> strip White_Space on both sides -> every U+E000 becomes " ".
// Compressed ids are given in order of first appearance of each key.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace dsx::text {

// The normaliser N above (input must be valid UTF-8).
std::string engram_normalize(std::string_view text);

// The key of one token id (see above).
std::string engram_key(const Tokenizer& tok, int32_t id);

// cmap over ids 0 .. tok.size()-1; *n_keys = number of distinct keys.
std::vector<int32_t> build_engram_token_map(const Tokenizer& tok, int32_t* n_keys);

// (Building the map takes ~0.2 s for the release tokenizer, so it is not cached:
// model directories are never written to.)

// Lower-case hex SHA-256 of a file's bytes (throws dsx::Error naming the file).
std::string sha256_file_hex(const std::string& path);

}  // namespace dsx::text
