#include "server/byte_prefix.h"

#include <algorithm>
#include <string>

namespace dsx::server {

BytePrefix byte_prefix(const text::Tokenizer& tok, const std::vector<int32_t>& live,
                       const std::vector<int32_t>& prompt, int64_t common, int64_t limit) {
  const int64_t nl = static_cast<int64_t>(live.size());
  const int64_t np = std::min<int64_t>(limit, static_cast<int64_t>(prompt.size()));
  BytePrefix best{common, common};
  if (common > nl || common > np) return best;
  // a and b: the tails' bytes consumed so far; their common length was compared already
  std::string a, b;
  size_t checked = 0;
  int64_t i = common, q = common;
  for (;;) {
    if (a.size() == b.size()) {  // both at a token boundary with equal bytes: a candidate
      best = BytePrefix{i, q};
      if (i >= nl || q >= np) break;
      const bool al = tok.is_added(live[static_cast<size_t>(i)]), ap = tok.is_added(prompt[static_cast<size_t>(q)]);
      if (al || ap) {  // control tokens only opposite the same control token
        if (live[static_cast<size_t>(i)] != prompt[static_cast<size_t>(q)]) break;
        const std::string t = tok.decode_one(live[static_cast<size_t>(i)]);
        a += t, b += t, checked = a.size();
        ++i, ++q;
        continue;
      }
      a += tok.decode_one(live[static_cast<size_t>(i++)]);
    } else if (a.size() < b.size()) {
      if (i >= nl || tok.is_added(live[static_cast<size_t>(i)])) break;
      a += tok.decode_one(live[static_cast<size_t>(i++)]);
    } else {
      if (q >= np || tok.is_added(prompt[static_cast<size_t>(q)])) break;
      b += tok.decode_one(prompt[static_cast<size_t>(q++)]);
    }
    const size_t m = std::min(a.size(), b.size());
    if (a.compare(checked, m - checked, b, checked, m - checked) != 0) break;
    checked = m;
  }
  return best;
}

std::vector<int32_t> rebased_prompt(const std::vector<int32_t>& live, const std::vector<int32_t>& prompt,
                                    const BytePrefix& m) {
  std::vector<int32_t> out(live.begin(), live.begin() + m.live);
  out.insert(out.end(), prompt.begin() + m.prompt, prompt.end());
  return out;
}

}  // namespace dsx::server
