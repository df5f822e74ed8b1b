// dsx: byte-prefix matching of a prompt against a session's exact tokens (spec
// chat-and-serving.md §5.1). A client replays the model's answer as text, and the server's
// canonical tokenization of that text often differs from the tokens the model sampled (BPE
// merges across the answer's boundary; a sampled split that is not the canonical one), so a
// token-prefix match stops at the previous prompt's end and the answer is prefilled again.
// Matching the decoded bytes instead keeps the session's exact tokens (the KV was computed
// for them) and continues the canonical prompt from a token boundary where both byte streams
// meet, so nothing is tokenized again.
#pragma once
#include <cstdint>
#include <vector>

#include "text/tokenizer.h"

namespace dsx::server {

struct BytePrefix {
  int64_t live = 0;    // tokens of the session kept: live[0, live)
  int64_t prompt = 0;  // the prompt continues from prompt[prompt, ...)
};

// The longest (k, j) with live[0, k) and prompt[0, j) spelling the same bytes, both token
// lists equal up to `common` (their common token prefix), k <= live.size(), j <= limit, and
// every added (control) token of either tail matched by the same token at the same byte
// offset of the other, so that client text never stands where the session has a control
// token or the reverse. (common, common) when the tails' bytes diverge at once.
BytePrefix byte_prefix(const text::Tokenizer& tok, const std::vector<int32_t>& live,
                       const std::vector<int32_t>& prompt, int64_t common, int64_t limit);

// live[0, k) followed by prompt[j, ...).
std::vector<int32_t> rebased_prompt(const std::vector<int32_t>& live, const std::vector<int32_t>& prompt,
                                    const BytePrefix& m);

}  // namespace dsx::server
