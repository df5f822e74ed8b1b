// Byte-level BPE tokenizer reading a Hugging Face tokenizer.json (DeepSeek V3 / V4 /
// V4.1 layout), bit-compatible with the `tokenizers` library's plain encode
// (add_special_tokens=False) and raw decode. Spec: chat-and-serving.md §1.
//
// Encoding (§1.3): added-token extraction (leftmost-longest; first the tokens with
// normalized=false, then those with normalized=true in the remaining text, as HF
// does), the pre-tokenizer's regex splits, the GPT-2 byte map, BPE merges by rank.
//
// Invalid UTF-8 in the input (outside HF's domain, which only takes valid strings):
// the text is cut at every ill-formed byte; the valid runs are pre-tokenized
// normally and every ill-formed byte becomes its own piece, i.e. its single-byte
// token. Hence decode(encode(s)) == s for any byte string s.
//
// Decoding (§1.4) works on bytes: a token's bytes are its byte-level string mapped
// back through the byte map (for added tokens: their content, mapped the same way
// when every character is in the map, as HF's ByteLevel decoder does, else the
// content's UTF-8 bytes). decode() never replaces anything; ids outside [0, size())
// throw dsx::Error.
//
// Thread safety: a Tokenizer may be used from several threads at once (the BPE
// piece cache is guarded by a mutex).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsx::text {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;
};

class Tokenizer {
 public:
  static Tokenizer from_file(const std::string& tokenizer_json_path);  // HF tokenizer.json
  static Tokenizer from_model_dir(const std::string& dir);             // dir/tokenizer.json
  // `source` names the origin in error messages.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // allow_added=true: added tokens written in the text are recognised (HF plain encode,
  // add_special_tokens=False). allow_added=false: the text is pure client text;
  // added-token strings are encoded as ordinary text via BPE.
  std::vector<int32_t> encode(std::string_view text, bool allow_added = true) const;
  // Appends to `out` instead of returning a new vector.
  void encode_into(std::string_view text, bool allow_added, std::vector<int32_t>& out) const;

  std::string decode(const std::vector<int32_t>& ids) const;  // raw bytes, special tokens kept
  std::string decode_one(int32_t id) const;                    // bytes of one token (may be partial UTF-8)
  std::optional<int32_t> token_to_id(std::string_view token) const;  // vocab or added token string -> id
  std::string id_to_token(int32_t id) const;  // vocab string (byte-level form) or added content
  bool is_added(int32_t id) const;
  bool is_special(int32_t id) const;  // added token with "special": true
  size_t size() const;                // len(tokenizer) in HF terms: max id + 1 over vocab and added tokens

  size_t vocab_size() const;  // entries of the BPE model's vocab
  const std::vector<AddedToken>& added_tokens() const;
  const std::string& source() const;  // file the tokenizer was read from

  // For tests and benchmarks.
  void clear_cache() const;
  void set_cache_enabled(bool on);
  void set_fast_paths_enabled(bool on);  // pre-tokenizer ASCII fast paths (else PCRE2 only)
  bool has_fast_paths() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Streaming detokenizer (chat-and-serving.md §1.6): feed ids, get only complete
// UTF-8 text. An ill-formed sequence is replaced by U+FFFD (one per maximal
// subpart, as Rust's from_utf8_lossy) as soon as it is known to be ill-formed; an
// incomplete sequence is held back until it completes or flush() is called.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok);
  std::string push(int32_t id);  // returns newly completed UTF-8 text (may be empty)
  std::string flush();           // end of stream: incomplete tail -> U+FFFD
  // Appends raw bytes (what push does with the token's bytes).
  std::string push_bytes(std::string_view bytes);
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tok_;
  std::string pending_;  // at most 3 bytes: an incomplete sequence
};

}  // namespace dsx::text
