// dsx: constrained decoding — see constrain.h for the grammars. Layout of this file:
//   1. the vocabulary as symbol strings (cached per Tokenizer);
//   2. the grammar: immutable nodes plus a pushdown runtime (State = stack of Frames) fed one symbol at a time;
//   3. the builder that compiles DSML calls and JSON schemas into nodes;
//   4. GrammarConstraint: forced runs, the vocabulary scan, commit.
#include "server/constrain.h"

#include <algorithm>
#include <array>
#include <bitset>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>

#include "util/error.h"

namespace dsx::server {
namespace {

using text::Tokenizer;
namespace pyjson = text::pyjson;
using pyjson::Value;

// ---- 1. symbols and the vocabulary ------------------------------------------------------------------------
using Sym = uint16_t;
constexpr Sym kSymDsml = 256, kSymThinkEnd = 257, kSymEos = 258;
constexpr int kNumSyms = 259;
using SymSet = std::bitset<kNumSyms>;
const char* const kMarkerText[3] = {text::tok::kDsml, text::tok::kThinkEnd, text::tok::kEos};

struct Vocab {
  std::string source;
  size_t size = 0;
  std::vector<uint32_t> off;  // token t's symbols: syms[off[t], off[t+1]); empty = never allowed
  std::vector<Sym> syms;
  std::array<std::vector<int32_t>, kNumSyms> by_first;  // tokens by first symbol
  int32_t marker_id[3] = {-1, -1, -1};

  const Sym* begin(int32_t t) const { return syms.data() + off[t]; }
  uint32_t len(int32_t t) const { return off[t + 1] - off[t]; }
};

std::shared_ptr<const Vocab> build_vocab(const Tokenizer& tok) {
  auto v = std::make_shared<Vocab>();
  v->source = tok.source();
  v->size = tok.size();
  for (int k = 0; k < 3; ++k) {
    const auto id = tok.token_to_id(kMarkerText[k]);
    DSX_CHECK(id && tok.is_added(*id), "constrained decoding: the tokenizer has no added token ", kMarkerText[k]);
    v->marker_id[k] = *id;
  }
  v->off.reserve(v->size + 1);
  v->off.push_back(0);
  for (size_t i = 0; i < v->size; ++i) {
    const int32_t id = static_cast<int32_t>(i);
    int marker = -1;
    for (int k = 0; k < 3; ++k)
      if (id == v->marker_id[k]) marker = k;
    if (marker >= 0) {
      v->syms.push_back(static_cast<Sym>(256 + marker));
    } else if (!tok.is_added(id)) {  // other added tokens (BOS, role markers, <think>, …) are never allowed
      std::string bytes;
      try {
        bytes = tok.decode_one(id);
      } catch (const std::exception&) {  // (an id the tokenizer does not define)
      }
      for (unsigned char c : bytes) v->syms.push_back(c);
    }
    v->off.push_back(static_cast<uint32_t>(v->syms.size()));
    if (v->len(id) > 0) v->by_first[v->syms[v->off[i]]].push_back(id);
  }
  return v;
}

std::shared_ptr<const Vocab> vocab_for(const Tokenizer& tok) {
  static std::mutex mu;
  static std::map<const Tokenizer*, std::shared_ptr<const Vocab>> cache;
  std::lock_guard<std::mutex> lk(mu);
  auto& slot = cache[&tok];
  // (a tokenizer destroyed and another built at the same address is caught by source and size)
  if (!slot || slot->source != tok.source() || slot->size != tok.size()) slot = build_vocab(tok);
  return slot;
}

// ---- forbidden byte patterns: KMP automata ------------------------------------------------------------
struct Pattern {
  uint8_t len = 0;
  std::vector<std::array<uint8_t, 256>> dfa;  // dfa[matched][byte] → matched'; == len: the pattern occurred
};

Pattern make_pattern(std::string_view p) {
  DSX_CHECK(!p.empty() && p.size() < 255, "constrained decoding: bad pattern length");
  Pattern r;
  r.len = static_cast<uint8_t>(p.size());
  r.dfa.assign(p.size(), std::array<uint8_t, 256>{});
  r.dfa[0][static_cast<uint8_t>(p[0])] = 1;
  size_t x = 0;
  for (size_t j = 1; j < p.size(); ++j) {
    r.dfa[j] = r.dfa[x];
    r.dfa[j][static_cast<uint8_t>(p[j])] = static_cast<uint8_t>(j + 1);
    x = r.dfa[x][static_cast<uint8_t>(p[j])];
  }
  return r;
}

// UTF-8 well-formedness, one byte at a time. st: 0 = at a character boundary; else (need | range << 2) with
// need the continuation bytes still expected and range the allowed interval of the next one.
bool utf8_step(int32_t& st, uint8_t c) {
  static constexpr uint8_t lo[5] = {0x80, 0xA0, 0x80, 0x90, 0x80}, hi[5] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
  if (st == 0) {
    if (c < 0x80) return true;
    if (c >= 0xC2 && c <= 0xDF) st = 1;
    else if (c == 0xE0) st = 2 | (1 << 2);
    else if (c == 0xED) st = 2 | (2 << 2);
    else if (c >= 0xE1 && c <= 0xEF) st = 2;
    else if (c == 0xF0) st = 3 | (3 << 2);
    else if (c >= 0xF1 && c <= 0xF3) st = 3;
    else if (c == 0xF4) st = 3 | (4 << 2);
    else return false;
    return true;
  }
  const int need = st & 3, range = st >> 2;
  if (c < lo[range] || c > hi[range]) return false;
  st = need - 1;  // (the range constraint applies to the first continuation byte only)
  return true;
}

bool lower_hex(uint8_t c, int& v) {
  if (c >= '0' && c <= '9') v = c - '0';
  else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
  else return false;
  return true;
}

// ---- 2. grammar ---------------------------------------------------------------------------------------
struct TrieNode {
  std::vector<std::pair<Sym, int32_t>> kids;
  int32_t alt = -1;  // an alternative's head ends here
  uint64_t below = 0;  // PObj tries: the alternatives whose heads pass through this node (bit per alternative)
};

enum class K : uint8_t { Seq, Lit, Choice, Text, JStr, Num, Obj, Arr, GObj, Union, PObj };

struct Node {
  K kind = K::Lit;
  // Seq: children; Choice: continuation per alternative (-1: none); Obj: value node per property;
  // Arr: {item}; GObj: {key, value}; Union: alternatives
  std::vector<int32_t> kids;
  std::vector<Sym> lit;          // Lit: the symbols; Text: the terminator
  std::vector<int32_t> tries;    // Obj: trie of the next heads after property j-1 (index j = 0..n)
  std::vector<SymSet> first;     // Union: first symbols of each alternative
  int32_t trie = -1;             // Choice
  int32_t cap = 0;               // Text / JStr: tokens before the forced close; Num: characters; Arr / GObj: items
  int32_t min_items = 0;         // Arr
  int32_t pats = -1;             // Text / JStr: forbidden byte patterns (index into Grammar::patsets)
  int32_t marker_at = 0;         // Text: index of the terminator's first marker
  bool integer = false;          // Num
  // Seq / Choice (lazy tool grammar): the last child / the continuation replaces this frame (a tail call, so
  // that a repetition built by recursion keeps the stack bounded)
  bool tail = false;
  uint32_t req = 0;              // PObj: required properties (bit per property)
};

// Runtime frame. Meaning of a..d per kind:
//   Seq: a = child index; Lit: a = position; Choice: a = trie node, b = 1 once in the continuation;
//   Text: a = UTF-8 state, b = terminator progress, c = pattern states, d = tokens;
//   JStr: a = UTF-8 state, b = phase (0 before '"', 1 in the string, 2 after '\', 3..7 inside \u00XX),
//         c = pattern states, d = tokens;
//   Num: a = state, b = characters, c = exponent digits;
//   Obj: a = next property index (last emitted + 1), b = trie node, c = chosen property, d = 1 in its value;
//   Arr: a = phase (0 '[', 1 after '[', 2 after an item, 3 after ','), b = items;
//   GObj: a = phase (0 '{', 1 after '{', 2 in a key, 3 ':', 4 ' ', 5 in a value, 6 after a value, 7 after ','),
//         b = members;
//   PObj (properties in any order, each at most once): a = emitted properties (bits), b = trie node,
//         c = chosen property, d = 1 in its value.
struct Frame {
  int32_t node, a, b, c, d;
};
constexpr int kMaxDepth = 64;

struct State {
  int n = 0;
  Frame f[kMaxDepth];
  State() = default;
  State(const State& o) : n(o.n) { std::memcpy(f, o.f, sizeof(Frame) * static_cast<size_t>(n)); }
  State& operator=(const State& o) {
    n = o.n;
    std::memcpy(f, o.f, sizeof(Frame) * static_cast<size_t>(n));
    return *this;
  }
};

// kLeave (text nodes only): x was consumed and completes the node; the caller pops it.
enum R { kConsumed, kReject, kRetry, kLeave };

struct Grammar {
  std::vector<Node> nodes;
  std::vector<TrieNode> trie;
  std::vector<Pattern> patterns;
  std::vector<std::vector<int32_t>> patsets;  // at most 3 patterns each (8-bit states packed in a frame word)
  int32_t root = -1;

  void enter(State& s, int32_t node) const {
    DSX_CHECK(s.n < kMaxDepth, "constrained decoding: grammar nested too deeply");
    Frame& f = s.f[s.n++];
    f = Frame{node, 0, 0, 0, 0};
    const Node& g = nodes[static_cast<size_t>(node)];
    if (g.kind == K::Seq) enter(s, g.kids[0]);
    else if (g.kind == K::Choice) f.a = g.trie;
    else if (g.kind == K::Obj || g.kind == K::PObj) f.b = g.tries[0];
  }

  void complete(State& s) const {
    --s.n;
    if (s.n > 0) child_done(s);
  }

  void child_done(State& s) const {
    Frame& f = s.f[s.n - 1];
    const Node& g = nodes[static_cast<size_t>(f.node)];
    switch (g.kind) {
      case K::Seq:
        if (++f.a == static_cast<int32_t>(g.kids.size())) {
          complete(s);
        } else if (g.tail && f.a + 1 == static_cast<int32_t>(g.kids.size())) {
          const int32_t last = g.kids[static_cast<size_t>(f.a)];
          --s.n;
          enter(s, last);
        } else {
          enter(s, g.kids[static_cast<size_t>(f.a)]);
        }
        break;
      case K::Choice: complete(s); break;
      case K::Obj:
        f.a = f.c + 1;
        f.b = g.tries[static_cast<size_t>(f.a)];
        f.d = 0;
        break;
      case K::PObj:
        f.a |= int32_t(1) << f.c;
        f.b = g.tries[1];
        f.d = 0;
        break;
      case K::Arr:
        ++f.b;
        f.a = 2;
        break;
      case K::GObj:
        if (f.a == 2) {
          f.a = 3;
        } else {
          ++f.b;
          f.a = 6;
        }
        break;
      default: break;
    }
  }

  bool pat_step(int32_t set, int32_t& st, uint8_t c) const {
    if (set < 0) return true;
    const auto& ps = patsets[static_cast<size_t>(set)];
    int32_t out = 0;
    for (size_t k = 0; k < ps.size(); ++k) {
      const Pattern& p = patterns[static_cast<size_t>(ps[k])];
      const uint8_t m = p.dfa[(st >> (8 * k)) & 0xFF][c];
      if (m == p.len) return false;
      out |= static_cast<int32_t>(m) << (8 * k);
    }
    st = out;
    return true;
  }

  // -2: reject; -1: advanced inside the trie; >= 0: that alternative is chosen (`used`: x was consumed).
  int trie_step(int32_t& at, Sym x, bool& used) const {
    const TrieNode& t = trie[static_cast<size_t>(at)];
    for (const auto& [sym, child] : t.kids)
      if (sym == x) {
        at = child;
        used = true;
        const TrieNode& c = trie[static_cast<size_t>(child)];
        return c.alt >= 0 && c.kids.empty() ? c.alt : -1;
      }
    used = false;
    return t.alt >= 0 ? t.alt : -2;  // a complete head that others extend: x belongs to what follows
  }

  // trie_step restricted to the alternatives in `allowed` (bits): a step into a subtree without an allowed
  // alternative is rejected, so the restriction never leads into a dead end.
  int trie_step_masked(int32_t& at, Sym x, bool& used, uint64_t allowed) const {
    const TrieNode& t = trie[static_cast<size_t>(at)];
    for (const auto& [sym, child] : t.kids)
      if (sym == x) {
        const TrieNode& c = trie[static_cast<size_t>(child)];
        if (!(c.below & allowed)) return -2;
        at = child;
        used = true;
        return c.alt >= 0 && c.kids.empty() ? c.alt : -1;
      }
    used = false;
    return t.alt >= 0 && ((allowed >> t.alt) & 1) ? t.alt : -2;
  }

  // Text and JStr steps touch only their own frame (so the scan can simulate a token on a frame copy).
  R step_text(Frame& f, const Node& g, Sym x) const {
    const auto& term = g.lit;
    const int32_t m = g.marker_at, T = static_cast<int32_t>(term.size());
    if (x >= 256) {  // markers only as part of the terminator
      if (f.a != 0 || term[static_cast<size_t>(f.b)] != x) return kReject;
      f.c = 0;
      return ++f.b == T ? kLeave : kConsumed;
    }
    if (f.b > m) {  // past the terminator's marker: the rest of it
      if (term[static_cast<size_t>(f.b)] != x) return kReject;
      return ++f.b == T ? kLeave : kConsumed;
    }
    if (f.d >= g.cap && f.a == 0 && term[static_cast<size_t>(f.b)] != x) return kReject;  // closing
    if (!utf8_step(f.a, static_cast<uint8_t>(x)) || !pat_step(g.pats, f.c, static_cast<uint8_t>(x))) return kReject;
    // progress into the terminator's prefix before the marker (border-free, checked when built)
    f.b = (f.b < m && term[static_cast<size_t>(f.b)] == x) ? f.b + 1 : (m > 0 && term[0] == x ? 1 : 0);
    return kConsumed;
  }

  R step_jstr(Frame& f, const Node& g, Sym x) const {
    if (x >= 256) return kReject;
    const uint8_t c = static_cast<uint8_t>(x);
    int v = 0;
    switch (f.b) {
      case 0:
        if (c != '"') return kReject;
        f.b = 1;
        return kConsumed;
      case 1:
        if (f.a == 0) {
          if (c == '"') return kLeave;
          if (f.d >= g.cap || c < 0x20) return kReject;  // closing: only the quote
          if (c == '\\') {
            f.b = 2;
            break;
          }
        }
        if (!utf8_step(f.a, c)) return kReject;
        break;
      case 2:
        if (c == 'u') f.b = 3;
        else if (c == '"' || c == '\\' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') f.b = 1;
        else return kReject;
        break;
      case 3:
      case 4:
        if (c != '0') return kReject;
        ++f.b;
        break;
      case 5:
        if (c == '0') f.b = 6;
        else if (c == '1') f.b = 7;
        else return kReject;
        break;
      case 6:  // \u000X: the C0 controls without a short escape (json.dumps form)
        if (!lower_hex(c, v) || v == 8 || v == 9 || v == 10 || v == 12 || v == 13) return kReject;
        f.b = 1;
        break;
      case 7:
        if (!lower_hex(c, v)) return kReject;
        f.b = 1;
        break;
      default: return kReject;
    }
    return pat_step(g.pats, f.c, c) ? kConsumed : kReject;
  }

  // JSON number: 0 start, 1 '-', 2 int "0", 3 int digits, 4 '.', 5 fraction, 6 'e', 7 exponent sign,
  // 8 exponent digits (at most two), 9 "-0" (needs a fraction or an exponent). Accepting: 2, 3, 5, 8.
  static bool num_accepting(int32_t st) { return st == 2 || st == 3 || st == 5 || st == 8; }

  R step_num(State& s, Frame& f, const Node& g, Sym x) const {
    int32_t ns = -1;
    const bool digit = x >= '0' && x <= '9';
    switch (f.a) {
      case 0:
        if (x == '-') ns = 1;
        else if (x == '0') ns = 2;
        else if (digit) ns = 3;
        break;
      case 1:
        if (x == '0') ns = g.integer ? -1 : 9;  // no bare "-0" (it would not re-serialize as written)
        else if (digit) ns = 3;
        break;
      case 9:
        if (x == '.') ns = 4;
        else if (x == 'e') ns = 6;
        break;
      case 2:
      case 3:
        if (f.a == 3 && digit) ns = 3;
        else if (!g.integer && x == '.') ns = 4;
        else if (!g.integer && x == 'e') ns = 6;
        break;
      case 4:
        if (digit) ns = 5;
        break;
      case 5:
        if (digit) ns = 5;
        else if (x == 'e') ns = 6;
        break;
      case 6:
        if (x == '+' || x == '-') ns = 7;
        else if (digit) ns = 8;
        break;
      case 7:
        if (digit) ns = 8;
        break;
      case 8:
        if (digit && f.c < 2) ns = 8;
        break;
    }
    // a step into a non-accepting state needs room for one more character
    if (ns >= 0 && f.b + 1 + (num_accepting(ns) ? 0 : 1) <= g.cap) {
      if (ns == 8) ++f.c;
      f.a = ns;
      ++f.b;
      return kConsumed;
    }
    if (num_accepting(f.a)) {  // the number ends; x belongs to what follows
      complete(s);
      return kRetry;
    }
    return kReject;
  }

  R step(State& s, Sym x) const {
    Frame& f = s.f[s.n - 1];
    const Node& g = nodes[static_cast<size_t>(f.node)];
    switch (g.kind) {
      case K::Lit:
        if (g.lit[static_cast<size_t>(f.a)] != x) return kReject;
        if (++f.a == static_cast<int32_t>(g.lit.size())) complete(s);
        return kConsumed;
      case K::Choice: {
        bool used = false;
        const int r = trie_step(f.a, x, used);
        if (r == -2) return kReject;
        if (r == -1) return kConsumed;
        const int32_t then = g.kids[static_cast<size_t>(r)];
        if (then < 0) {
          complete(s);
        } else if (g.tail) {
          --s.n;
          enter(s, then);
        } else {
          f.b = 1;
          enter(s, then);
        }
        return used ? kConsumed : kRetry;
      }
      case K::Obj: {
        bool used = false;
        const int r = trie_step(f.b, x, used);
        if (r == -2) return kReject;
        if (r == -1) return kConsumed;
        if (r == static_cast<int>(g.kids.size())) {
          complete(s);
        } else {
          f.c = r;
          f.d = 1;
          enter(s, g.kids[static_cast<size_t>(r)]);
        }
        return used ? kConsumed : kRetry;
      }
      case K::PObj: {
        const int np = static_cast<int>(g.kids.size());
        const uint32_t emitted = static_cast<uint32_t>(f.a);
        uint64_t allowed = (~uint64_t(emitted)) & ((uint64_t(1) << np) - 1);
        if ((emitted & g.req) == g.req) allowed |= uint64_t(1) << np;
        bool used = false;
        const int r = trie_step_masked(f.b, x, used, allowed);
        if (r == -2) return kReject;
        if (r == -1) return kConsumed;
        if (r == np) {
          complete(s);
        } else {
          f.c = r;
          f.d = 1;
          enter(s, g.kids[static_cast<size_t>(r)]);
        }
        return used ? kConsumed : kRetry;
      }
      case K::Text:
      case K::JStr: {
        const R r = g.kind == K::Text ? step_text(f, g, x) : step_jstr(f, g, x);
        if (r != kLeave) return r;
        complete(s);
        return kConsumed;
      }
      case K::Num: return step_num(s, f, g, x);
      case K::Arr:
        switch (f.a) {
          case 0:
            if (x != '[') return kReject;
            f.a = 1;
            return kConsumed;
          case 1:
            if (x == ']' && g.min_items == 0) {
              complete(s);
              return kConsumed;
            }
            if (g.cap == 0) return kReject;
            f.a = 2;
            enter(s, g.kids[0]);
            return kRetry;
          case 2:
            if (x == ',' && f.b < g.cap) {
              f.a = 3;
              return kConsumed;
            }
            if (x == ']' && f.b >= g.min_items) {
              complete(s);
              return kConsumed;
            }
            return kReject;
          case 3:
            if (x != ' ') return kReject;
            f.a = 2;
            enter(s, g.kids[0]);
            return kConsumed;
        }
        return kReject;
      case K::GObj:
        switch (f.a) {
          case 0:
            if (x != '{') return kReject;
            f.a = 1;
            return kConsumed;
          case 1:
            if (x == '}') {
              complete(s);
              return kConsumed;
            }
            if (x != '"' || g.cap == 0) return kReject;
            f.a = 2;
            enter(s, g.kids[0]);
            return kRetry;
          case 3:
            if (x != ':') return kReject;
            f.a = 4;
            return kConsumed;
          case 4:
            if (x != ' ') return kReject;
            f.a = 5;
            enter(s, g.kids[1]);
            return kConsumed;
          case 6:
            if (x == ',' && f.b < g.cap) {
              f.a = 7;
              return kConsumed;
            }
            if (x == '}') {
              complete(s);
              return kConsumed;
            }
            return kReject;
          case 7:
            if (x != ' ') return kReject;
            f.a = 2;
            enter(s, g.kids[0]);
            return kConsumed;
        }
        return kReject;
      case K::Union:
        for (size_t i = 0; i < g.kids.size(); ++i)
          if (g.first[i][x]) {
            --s.n;  // replaced by the alternative
            enter(s, g.kids[i]);
            return kRetry;
          }
        return kReject;
      case K::Seq: return kReject;  // (never on top)
    }
    return kReject;
  }

  // Feeds one symbol; false (and `s` unusable) when it does not continue the language.
  bool feed(State& s, Sym x) const {
    for (int guard = 0; guard < 4 * kMaxDepth; ++guard) {
      if (s.n == 0) return false;
      switch (step(s, x)) {
        case kConsumed: return true;
        case kReject: return false;
        case kRetry: break;
        case kLeave: return false;  // (not returned by step)
      }
    }
    return false;
  }

  SymSet allowed_syms(const State& s) const {
    SymSet r;
    State t;
    for (int x = 0; x < kNumSyms; ++x) {
      t = s;
      if (feed(t, static_cast<Sym>(x))) r.set(static_cast<size_t>(x));
    }
    return r;
  }
};

// ---- 3. builder ---------------------------------------------------------------------------------------
class Builder {
 public:
  Builder(Grammar& g, const Vocab& v, const Tokenizer& tok, const ConstraintLimits& lim)
      : G(g), V(v), tok_(tok), lim_(lim) {
    lim_.max_depth = std::clamp(lim_.max_depth, 0, 12);
    lim_.max_items = std::max(lim_.max_items, 0);
    lim_.max_string_tokens = std::max(lim_.max_string_tokens, 0);
    lim_.max_reasoning_tokens = std::max(lim_.max_reasoning_tokens, 0);
    lim_.max_number_chars = std::max(lim_.max_number_chars, 1);
  }

  // Renderer-written text: added tokens (the DSML marker, </think>, EOS) become marker symbols.
  std::vector<Sym> trusted(const std::string& s) const {
    std::vector<Sym> out;
    for (int32_t id : tok_.encode(s, true)) {
      bool marker = false;
      for (int k = 0; k < 3; ++k)
        if (id == V.marker_id[k]) {
          out.push_back(static_cast<Sym>(256 + k));
          marker = true;
        }
      if (marker) continue;
      DSX_CHECK(!tok_.is_added(id), "constrained decoding: unexpected added token in '", s, "'");
      out.insert(out.end(), V.begin(id), V.begin(id) + V.len(id));
    }
    return out;
  }
  static std::vector<Sym> client(std::string_view s) { return std::vector<Sym>(s.begin(), s.end()); }
  static std::vector<Sym> join(std::vector<Sym> a, const std::vector<Sym>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }

  int32_t add(Node n) {
    DSX_CHECK(G.nodes.size() < (size_t(1) << 20), "constrained decoding: schema too large");
    G.nodes.push_back(std::move(n));
    return static_cast<int32_t>(G.nodes.size() - 1);
  }
  int32_t lit(std::vector<Sym> s) {
    DSX_CHECK(!s.empty(), "constrained decoding: empty literal");
    Node n;
    n.kind = K::Lit;
    n.lit = std::move(s);
    return add(std::move(n));
  }
  int32_t seq(std::vector<int32_t> kids) {
    kids.erase(std::remove(kids.begin(), kids.end(), -1), kids.end());
    DSX_CHECK(!kids.empty(), "constrained decoding: empty sequence");
    if (kids.size() == 1) return kids[0];
    Node n;
    n.kind = K::Seq;
    n.kids = std::move(kids);
    return add(std::move(n));
  }
  int32_t trie_of(const std::vector<std::vector<Sym>>& heads, const std::vector<int32_t>& alts) {
    const int32_t root = static_cast<int32_t>(G.trie.size());
    G.trie.emplace_back();
    for (size_t i = 0; i < heads.size(); ++i) {
      DSX_CHECK(!heads[i].empty(), "constrained decoding: empty alternative");
      int32_t at = root;
      for (Sym x : heads[i]) {
        int32_t next = -1;
        for (const auto& [sym, child] : G.trie[static_cast<size_t>(at)].kids)
          if (sym == x) next = child;
        if (next < 0) {
          next = static_cast<int32_t>(G.trie.size());
          G.trie.emplace_back();
          G.trie[static_cast<size_t>(at)].kids.emplace_back(x, next);
        }
        at = next;
      }
      if (G.trie[static_cast<size_t>(at)].alt < 0) G.trie[static_cast<size_t>(at)].alt = alts[i];  // (dup: first)
    }
    return root;
  }
  // One of the heads, each followed by its continuation (-1: none).
  int32_t choice(const std::vector<std::pair<std::vector<Sym>, int32_t>>& alts) {
    DSX_CHECK(!alts.empty(), "constrained decoding: empty choice");
    std::vector<std::vector<Sym>> heads;
    std::vector<int32_t> ids;
    Node n;
    n.kind = K::Choice;
    for (size_t i = 0; i < alts.size(); ++i) {
      heads.push_back(alts[i].first);
      ids.push_back(static_cast<int32_t>(i));
      n.kids.push_back(alts[i].second);
    }
    n.trie = trie_of(heads, ids);
    return add(std::move(n));
  }
  int32_t literals(const std::vector<std::string>& values) {
    std::vector<std::pair<std::vector<Sym>, int32_t>> alts;
    for (const auto& v : values) alts.emplace_back(client(v), -1);
    return choice(alts);
  }
  int32_t patset(const std::vector<std::string>& pats) {
    DSX_CHECK(pats.size() <= 3, "constrained decoding: too many patterns");
    std::vector<int32_t> set;
    for (const auto& p : pats) {
      G.patterns.push_back(make_pattern(p));
      set.push_back(static_cast<int32_t>(G.patterns.size() - 1));
    }
    G.patsets.push_back(std::move(set));
    return static_cast<int32_t>(G.patsets.size() - 1);
  }
  // Free text up to `term` (which contains a marker, so text can never spell it), forced closed after cap tokens.
  int32_t free_text(std::vector<Sym> term, int32_t pats, int cap) {
    for (int32_t id : text_nodes_) {
      const Node& t = G.nodes[static_cast<size_t>(id)];
      if (t.lit == term && t.pats == pats && t.cap == cap) return id;
    }
    Node n;
    n.kind = K::Text;
    size_t m = 0;
    while (m < term.size() && term[m] < 256) ++m;
    DSX_CHECK(m < term.size(), "constrained decoding: a text terminator needs a marker");
    for (size_t k = 1; k < m; ++k)  // the byte prefix before the marker must have no border
      DSX_CHECK(!std::equal(term.begin(), term.begin() + static_cast<long>(m - k), term.begin() + static_cast<long>(k)),
                "constrained decoding: terminator prefix with a border");
    n.lit = std::move(term);
    n.marker_at = static_cast<int32_t>(m);
    n.pats = pats;
    n.cap = cap;
    text_nodes_.push_back(add(std::move(n)));
    return text_nodes_.back();
  }
  // (Nodes are immutable, so equal ones are shared: the scan's text-mask cache is keyed by node.)
  int32_t jstr() {
    if (jstr_ >= 0) return jstr_;
    Node n;
    n.kind = K::JStr;
    n.pats = str_pats;
    n.cap = lim_.max_string_tokens;
    return jstr_ = add(std::move(n));
  }
  int32_t num(bool integer) {
    if (num_[integer] >= 0) return num_[integer];
    Node n;
    n.kind = K::Num;
    n.integer = integer;
    n.cap = lim_.max_number_chars;
    return num_[integer] = add(std::move(n));
  }
  int32_t arr(int32_t item, int min_items, int max_items) {
    Node n;
    n.kind = K::Arr;
    n.kids = {item};
    n.min_items = min_items;
    n.cap = std::max(min_items, max_items);
    return add(std::move(n));
  }
  int32_t gobj(int32_t key, int32_t value) {
    Node n;
    n.kind = K::GObj;
    n.kids = {key, value};
    n.cap = lim_.max_items;
    return add(std::move(n));
  }
  // Alternatives told apart by their first symbol; one that starts like an earlier one is dropped.
  int32_t uni(const std::vector<int32_t>& alts) {
    Node n;
    n.kind = K::Union;
    SymSet used;
    for (int32_t a : alts) {
      SymSet fs;
      for (int x = 0; x < kNumSyms; ++x) {
        State s;
        G.enter(s, a);
        if (G.feed(s, static_cast<Sym>(x))) fs.set(static_cast<size_t>(x));
      }
      if (fs.none() || (fs & used).any()) continue;
      used |= fs;
      n.kids.push_back(a);
      n.first.push_back(fs);
    }
    DSX_CHECK(!n.kids.empty(), "constrained decoding: empty union");
    if (n.kids.size() == 1) return n.kids[0];
    return add(std::move(n));
  }
  // Object with known properties (schema order). heads0 / heads1: the head of property i as the first / a later
  // one; end0 / end1: the closer with no property / after one.
  int32_t obj(const std::vector<std::vector<Sym>>& heads0, const std::vector<std::vector<Sym>>& heads1,
              const std::vector<Sym>& end0, const std::vector<Sym>& end1, const std::vector<bool>& required,
              std::vector<int32_t> values) {
    Node n;
    n.kind = K::Obj;
    const int np = static_cast<int>(values.size());
    n.kids = std::move(values);
    for (int j = 0; j <= np; ++j) {  // j: index of the next property to consider
      std::vector<std::vector<Sym>> heads;
      std::vector<int32_t> alts;
      bool required_left = false;
      for (int i = j; i < np; ++i) {
        heads.push_back(j == 0 ? heads0[static_cast<size_t>(i)] : heads1[static_cast<size_t>(i)]);
        alts.push_back(i);
        if (required[static_cast<size_t>(i)]) {
          required_left = true;
          break;
        }
      }
      if (!required_left) {
        heads.push_back(j == 0 ? end0 : end1);
        alts.push_back(np);
      }
      n.tries.push_back(trie_of(heads, alts));
    }
    return add(std::move(n));
  }

  int32_t any(int depth) {
    depth = std::min(depth, lim_.max_depth);
    if (any_memo_.size() <= static_cast<size_t>(depth)) any_memo_.resize(static_cast<size_t>(depth) + 1, -1);
    if (any_memo_[static_cast<size_t>(depth)] >= 0) return any_memo_[static_cast<size_t>(depth)];
    std::vector<int32_t> alts = {jstr(), num(false), literals({"true", "false", "null"})};
    if (depth < lim_.max_depth) {
      const int32_t inner = any(depth + 1);
      alts.push_back(gobj(jstr(), inner));
      alts.push_back(arr(inner, 0, lim_.max_items));
    }
    const int32_t u = uni(alts);
    any_memo_[static_cast<size_t>(depth)] = u;
    return u;
  }

  // ---- JSON schema ----
  const Value* pointer(const std::string& ref) const {
    if (!ref_root || ref.empty() || ref[0] != '#') return nullptr;
    if (ref == "#") return ref_root;
    if (ref.size() < 2 || ref[1] != '/') return nullptr;
    const Value* at = ref_root;
    size_t pos = 2;
    for (;;) {
      const size_t e = ref.find('/', pos);
      std::string part = ref.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
      std::string un;
      for (size_t i = 0; i < part.size(); ++i) {
        if (part[i] == '~' && i + 1 < part.size() && (part[i + 1] == '0' || part[i + 1] == '1')) {
          un += part[i + 1] == '0' ? '~' : '/';
          ++i;
        } else {
          un += part[i];
        }
      }
      if (at->is_object()) {
        at = at->get(un);
      } else if (at->is_array()) {
        char* endp = nullptr;
        const unsigned long idx = std::strtoul(un.c_str(), &endp, 10);
        at = (!un.empty() && *endp == 0 && idx < at->items.size()) ? &at->items[idx] : nullptr;
      } else {
        at = nullptr;
      }
      if (!at || e == std::string::npos) return at;
      pos = e + 1;
    }
  }
  const Value* resolve(const Value* s) const {
    for (int i = 0; i < 32 && s && s->is_object(); ++i) {
      const Value* r = s->get("$ref");
      if (!r || !r->is_string()) break;
      const Value* t = pointer(r->text);
      if (!t) break;
      s = t;
    }
    return s;
  }
  static std::vector<std::string> types_of(const Value& s) {
    std::vector<std::string> t;
    const Value* ty = s.get("type");
    if (ty && ty->is_string()) t.push_back(ty->text);
    else if (ty && ty->is_array())
      for (const auto& x : ty->items)
        if (x.is_string() && std::find(t.begin(), t.end(), x.text) == t.end()) t.push_back(x.text);
    if (!ty) {
      if (s.get("properties") || s.get("required") || s.get("additionalProperties")) t.push_back("object");
      else if (s.get("items")) t.push_back("array");
    }
    return t;
  }
  static int int_of(const Value* v, int dflt) {
    if (!v) return dflt;
    if (v->type == pyjson::Type::Int) {
      if (v->text.size() > 9) return v->text[0] == '-' ? 0 : 1 << 30;
      return std::stoi(v->text);
    }
    if (v->type == pyjson::Type::Float && std::isfinite(v->number))
      return static_cast<int>(std::clamp(v->number, -1e9, 1e9));
    return dflt;
  }
  static std::vector<const Value*> enum_values(const Value& s) {
    std::vector<const Value*> vals;
    if (const Value* c = s.get("const")) vals.push_back(c);
    else if (const Value* e = s.get("enum"); e && e->is_array())
      for (const auto& x : e->items) vals.push_back(&x);
    return vals;
  }
  const Value* alternatives(const Value& s) const {
    for (const char* k : {"anyOf", "oneOf"})
      if (const Value* a = s.get(k); a && a->is_array() && !a->items.empty()) return a;
    return nullptr;
  }

  struct Props {
    std::vector<std::string> keys;
    std::vector<const Value*> schemas;
    std::vector<bool> required;
  };
  static Props props_of(const Value* s) {
    Props p;
    if (!s || !s->is_object()) return p;
    if (const Value* pr = s->get("properties"); pr && pr->is_object())
      for (const auto& [k, v] : pr->members) {
        if (std::find(p.keys.begin(), p.keys.end(), k) != p.keys.end()) continue;
        p.keys.push_back(k);
        p.schemas.push_back(&v);
        p.required.push_back(false);
      }
    if (const Value* rq = s->get("required"); rq && rq->is_array())
      for (const auto& r : rq->items) {
        if (!r.is_string()) continue;
        auto it = std::find(p.keys.begin(), p.keys.end(), r.text);
        if (it != p.keys.end()) {
          p.required[static_cast<size_t>(it - p.keys.begin())] = true;
        } else {
          p.keys.push_back(r.text);
          p.schemas.push_back(nullptr);
          p.required.push_back(true);
        }
      }
    return p;
  }

  // Past max_depth a schema is still followed, but minimally (required properties only, the fewest array
  // items), so recursive schemas end; a schema that requires infinite nesting gets scalars eventually.
  int32_t json(const Value* s, int depth) {
    s = resolve(s);
    if (!s || !s->is_object() || depth > lim_.max_depth + 16) return any(depth);
    const auto key = std::make_pair(s, depth);
    if (auto it = json_memo_.find(key); it != json_memo_.end()) return it->second;
    const int32_t n = json_uncached(s, depth);
    json_memo_[key] = n;
    return n;
  }
  int32_t json_uncached(const Value* s, int depth) {
    if (auto vals = enum_values(*s); !vals.empty()) {
      std::vector<std::string> lits;
      for (const Value* v : vals) lits.push_back(pyjson::dumps(*v));
      return literals(lits);
    }
    if (const Value* alts = alternatives(*s)) {
      std::vector<int32_t> nodes;
      for (const auto& a : alts->items) nodes.push_back(json(&a, depth));
      return uni(nodes);
    }
    if (const Value* all = s->get("allOf"); all && all->is_array() && !all->items.empty() && !s->get("type") &&
                                             !s->get("properties"))
      return json(&all->items[0], depth);
    const auto types = types_of(*s);
    if (types.empty()) return any(depth);
    if (types.size() == 1) return typed(*s, types[0], depth);
    std::vector<int32_t> nodes;
    for (const auto& t : types) nodes.push_back(typed(*s, t, depth));
    return uni(nodes);
  }

  int32_t typed(const Value& s, const std::string& t, int depth) {
    if (t == "string") return jstr();
    if (t == "integer") return num(true);
    if (t == "number") return num(false);
    if (t == "boolean") return literals({"true", "false"});
    if (t == "null") return literals({"null"});
    const bool minimal = depth > lim_.max_depth;
    if (t == "array") {
      const Value* items = s.get("items");
      const int mn = std::clamp(int_of(s.get("minItems"), 0), 0, 64);
      const int mx = std::clamp(int_of(s.get("maxItems"), lim_.max_items), 0, lim_.max_items);
      if ((minimal && mn == 0) || std::max(mn, mx) == 0) return lit(client("[]"));
      const int32_t item = items ? json(items, depth + 1) : any(depth + 1);
      return arr(item, mn, minimal ? mn : mx);
    }
    if (t == "object") {
      Props p = props_of(&s);
      if (minimal)
        for (size_t i = p.keys.size(); i-- > 0;)
          if (!p.required[i]) {
            p.keys.erase(p.keys.begin() + static_cast<long>(i));
            p.schemas.erase(p.schemas.begin() + static_cast<long>(i));
            p.required.erase(p.required.begin() + static_cast<long>(i));
          }
      if (p.keys.empty()) {
        const Value* ap = s.get("additionalProperties");
        if (minimal || (ap && ap->type == pyjson::Type::Bool && !ap->boolean)) return lit(client("{}"));
        const int32_t value = ap && ap->is_object() ? json(ap, depth + 1) : any(depth + 1);
        return gobj(jstr(), value);
      }
      std::vector<std::vector<Sym>> h0, h1;
      std::vector<int32_t> values;
      for (size_t i = 0; i < p.keys.size(); ++i) {
        const std::string k = pyjson::quoted(p.keys[i]) + ": ";
        h0.push_back(client("{" + k));
        h1.push_back(client(", " + k));
        values.push_back(json(p.schemas[i], depth + 1));
      }
      return obj(h0, h1, client("{}"), client("}"), p.required, std::move(values));
    }
    return any(depth);
  }

  // ---- DSML ----
  void set_dsml(text::Profile profile) {
    names_ = text::dsml_names(profile);
    const std::string d = text::tok::kDsml;
    closer_text_ = "</" + d + names_.param + ">";
    closer_ = trusted(closer_text_);
    str_pats = patset({closer_text_, "&lt;" + closer_text_.substr(1)});
  }
  void set_json_content() { str_pats = patset({text::tok::kEos}); }

  int32_t reasoning() {
    if (think_pats_ < 0) think_pats_ = patset({text::tok::kThinkEnd});
    return free_text({kSymThinkEnd}, think_pats_, lim_.max_reasoning_tokens);
  }

  // The value of a top-level parameter: from `string="` on to the parameter closer.
  int32_t dsml_value(const Value* s) {
    s = resolve(s);
    if (s && s->is_object()) {
      if (auto vals = enum_values(*s); !vals.empty()) {
        std::vector<std::pair<std::vector<Sym>, int32_t>> alts;
        for (const Value* v : vals) {
          const std::string body = v->is_string() ? v->text : pyjson::dumps(*v);
          if (body.find(closer_text_) != std::string::npos) continue;  // (not representable)
          alts.emplace_back(join(join(trusted(v->is_string() ? "true\">" : "false\">"), client(body)), closer_), -1);
        }
        DSX_CHECK(!alts.empty(), "constrained decoding: no representable enum value");
        return choice(alts);
      }
    }
    std::vector<const Value*> schemas;
    if (const Value* alts = (s && s->is_object()) ? alternatives(*s) : nullptr) {
      for (const auto& a : alts->items) schemas.push_back(resolve(&a));
    } else {
      schemas.push_back(s);
    }
    bool string_branch = false;
    std::vector<int32_t> json_alts;
    for (const Value* a : schemas) {
      const bool obj = a && a->is_object();
      const auto types = obj ? types_of(*a) : std::vector<std::string>{};
      const bool plain_string = obj && enum_values(*a).empty() && !alternatives(*a) &&
                                std::find(types.begin(), types.end(), "string") != types.end();
      if (!plain_string) {
        json_alts.push_back(json(a, 1));
        continue;
      }
      string_branch = true;
      for (const auto& t : types)
        if (t != "string") json_alts.push_back(typed(*a, t, 1));
    }
    std::vector<std::pair<std::vector<Sym>, int32_t>> branches;
    if (string_branch) branches.emplace_back(trusted("true\">"), free_text(closer_, str_pats, lim_.max_string_tokens));
    if (!json_alts.empty()) branches.emplace_back(trusted("false\">"), seq({uni(json_alts), lit(closer_)}));
    return choice(branches);
  }

  // From after `name="NAME">\n` to the invoke closer; any_order: the properties in any order (lazy grammar).
  int32_t params(const text::ToolSpec& tool, bool any_order = false) {
    const Value* p = tool.function.get("parameters");
    ref_root = p;
    const Props pr = props_of(resolve(p));
    const std::string d = text::tok::kDsml;
    std::vector<std::vector<Sym>> h0, h1;
    std::vector<int32_t> values;
    for (size_t i = 0; i < pr.keys.size(); ++i) {
      DSX_CHECK(pr.keys[i].find('"') == std::string::npos, "tool '", tool.name, "': parameter name '", pr.keys[i],
                "' contains '\"'");
      const std::vector<Sym> head = join(join(trusted("<" + d + names_.param + " name=\""), client(pr.keys[i])),
                                        trusted("\" string=\""));
      h0.push_back(head);
      h1.push_back(join(trusted("\n"), head));
      values.push_back(dsml_value(pr.schemas[i]));
    }
    const std::vector<Sym> end = trusted("\n</" + d + names_.invoke + ">");
    if (any_order) return pobj(h0, h1, end, pr.required, std::move(values));
    return obj(h0, h1, end, end, pr.required, std::move(values));
  }

  // Properties in any order, each at most once, the required ones all before `end`.
  int32_t pobj(const std::vector<std::vector<Sym>>& heads0, const std::vector<std::vector<Sym>>& heads1,
               const std::vector<Sym>& end, const std::vector<bool>& required, std::vector<int32_t> values) {
    const int np = static_cast<int>(values.size());
    DSX_CHECK(np <= 30, "constrained decoding: more than 30 parameters in a tool (lazy grammar)");
    Node n;
    n.kind = K::PObj;
    n.kids = std::move(values);
    for (int i = 0; i < np; ++i)
      if (required[static_cast<size_t>(i)]) n.req |= uint32_t(1) << i;
    for (int j = 0; j < 2; ++j) {
      std::vector<std::vector<Sym>> heads = j == 0 ? heads0 : heads1;
      std::vector<int32_t> alts;
      for (int i = 0; i < np; ++i) alts.push_back(i);
      heads.push_back(end);
      alts.push_back(np);
      const size_t first = G.trie.size();
      n.tries.push_back(trie_of(heads, alts));
      for (size_t k = G.trie.size(); k-- > first;) {  // (children come after their parents)
        TrieNode& t = G.trie[k];
        t.below = t.alt >= 0 ? uint64_t(1) << t.alt : 0;
        for (const auto& kc : t.kids) t.below |= G.trie[static_cast<size_t>(kc.second)].below;
      }
    }
    return add(std::move(n));
  }

  // Lazy grammar, from right after the DSML marker of the block opener "<｜DSML｜ calls>" to the block closer:
  // one or more invokes of the tools, parameters in any order.
  int32_t lazy_block(const std::vector<const text::ToolSpec*>& tools) {
    const std::string d = text::tok::kDsml;
    const int32_t more = add(Node{});  // (filled in below: it and the invokes refer to each other)
    std::vector<std::pair<std::vector<Sym>, int32_t>> alts;
    for (const text::ToolSpec* t : tools) {
      Node sq;
      sq.kind = K::Seq;
      sq.tail = true;
      sq.kids = {params(*t, true), more};
      alts.emplace_back(join(client(t->name), trusted("\">\n")), add(std::move(sq)));
    }
    const int32_t names = choice(alts);
    G.nodes[static_cast<size_t>(names)].tail = true;
    const int32_t m = choice({{trusted("\n<" + d + names_.invoke + " name=\""), names},
                              {trusted("\n</" + d + names_.block + ">"), -1}});
    G.nodes[static_cast<size_t>(more)] = G.nodes[static_cast<size_t>(m)];
    G.nodes[static_cast<size_t>(more)].tail = true;
    Node root;
    root.kind = K::Seq;
    root.tail = true;
    root.kids = {lit(trusted(std::string(names_.block) + ">\n<" + d + names_.invoke + " name=\"")), names};
    return add(std::move(root));
  }

  int32_t tool_block(const std::vector<const text::ToolSpec*>& tools, bool thinking) {
    const std::string d = text::tok::kDsml;
    std::vector<int32_t> parts;
    if (thinking) parts.push_back(reasoning());
    parts.push_back(lit(trusted("\n\n<" + d + names_.block + ">\n<" + d + names_.invoke + " name=\"")));
    std::vector<std::pair<std::vector<Sym>, int32_t>> alts;
    for (const text::ToolSpec* t : tools) alts.emplace_back(join(client(t->name), trusted("\">\n")), params(*t));
    parts.push_back(choice(alts));
    parts.push_back(lit(trusted("\n</" + d + names_.block + ">")));
    return seq(parts);
  }

  Grammar& G;
  const Vocab& V;
  int32_t str_pats = -1;  // patterns JSON strings must not contain
  const Value* ref_root = nullptr;

 private:
  const Tokenizer& tok_;
  ConstraintLimits lim_;
  std::vector<int32_t> any_memo_;
  int32_t jstr_ = -1, num_[2] = {-1, -1}, think_pats_ = -1;
  std::vector<int32_t> text_nodes_;
  std::map<std::pair<const Value*, int>, int32_t> json_memo_;
  text::DsmlNames names_{};
  std::string closer_text_;
  std::vector<Sym> closer_;
};

// ---- 4. the constraint --------------------------------------------------------------------------------
class GrammarConstraint final : public Constraint {
 public:
  // natural: only marker symbols are forced; deterministic bytes are left to the model (through the mask, which
  // then allows just the tokens that spell a prefix of them), so that it writes them with the tokens it would
  // choose itself (a token may span a branch point, e.g. ">\n</" before a closer, or "}</" — or not).
  GrammarConstraint(const Tokenizer& tok, std::shared_ptr<const Vocab> v, Grammar g, bool natural = false)
      : tok_(tok), V(std::move(v)), G(std::move(g)), natural_(natural) {
    G.enter(cur_, G.root);
    mask_.assign(V->size, 0);
    plan();
  }

  bool needs_logits() const override { return forced_.empty() && !done(); }
  bool done() const override { return cur_.n == 0; }

  int32_t next(float* logits, int64_t vocab, const std::function<int32_t(const float*, int64_t)>& pick) override {
    DSX_CHECK(!done(), "constrained decoding: next() after the constrained output is complete");
    if (!forced_.empty()) {
      const int32_t t = forced_.front();
      forced_.pop_front();
      commit(t);
      if (forced_.empty()) plan();
      return t;
    }
    DSX_CHECK(logits && vocab > 0, "constrained decoding: this step needs logits");
    scan();
    const int64_t n = std::min<int64_t>(vocab, static_cast<int64_t>(V->size));
    const float ninf = -std::numeric_limits<float>::infinity();
    int32_t best = -1;
    for (int64_t i = 0; i < vocab; ++i) {
      if (i < n && mask_[static_cast<size_t>(i)]) {
        if (best < 0 || logits[i] > logits[best]) best = static_cast<int32_t>(i);
      } else {
        logits[i] = ninf;
      }
    }
    DSX_CHECK(best >= 0, "constrained decoding: no token continues the constrained output");
    int32_t t = pick(logits, vocab);
    if (t < 0 || t >= n || !mask_[static_cast<size_t>(t)]) t = best;
    commit(t);
    plan();
    return t;
  }

  void wrap_up() override {
    if (wrap_) return;
    wrap_ = true;
    cap_texts(cur_);
    forced_.clear();  // (the run was planned from cur_ without the limit: plan it again)
    plan();
  }

 private:
  // The deterministic run from the current state, as forced tokens; else remember the allowed first symbols.
  void plan() {
    have_first_ = false;
    if (done()) return;
    std::vector<Sym> run;
    State s = cur_;
    while (s.n > 0 && run.size() < 4096) {
      const SymSet a = G.allowed_syms(s);
      DSX_CHECK(a.any(), "constrained decoding: dead end in the grammar");
      if (a.count() != 1) {
        if (run.empty()) {
          first_ = a;
          have_first_ = true;
        }
        break;
      }
      Sym x = 0;
      while (!a[x]) ++x;
      run.push_back(x);
      G.feed(s, x);
    }
    if (natural_) {
      size_t keep = 0;
      while (keep < run.size() && run[keep] >= 256) ++keep;
      if (keep < run.size()) {
        run.resize(keep);
        have_first_ = false;
      }
    }
    if (run.empty()) return;
    std::string bytes;
    auto flush = [&]() {
      if (bytes.empty()) return;
      for (int32_t id : tok_.encode(bytes, false)) forced_.push_back(id);
      bytes.clear();
    };
    for (Sym x : run) {
      if (x < 256) {
        bytes.push_back(static_cast<char>(x));
      } else {
        flush();
        forced_.push_back(V->marker_id[x - 256]);
      }
    }
    flush();
    std::vector<Sym> check;
    for (int32_t id : forced_) check.insert(check.end(), V->begin(id), V->begin(id) + V->len(id));
    DSX_CHECK(check == run, "constrained decoding: the forced text does not tokenize to itself");
  }

  void scan() {
    const Frame& top = cur_.f[cur_.n - 1];
    const Node& g = G.nodes[static_cast<size_t>(top.node)];
    if (g.kind == K::Text || g.kind == K::JStr) {
      scan_text(top, g);
      return;
    }
    const SymSet first = have_first_ ? first_ : G.allowed_syms(cur_);
    std::fill(mask_.begin(), mask_.end(), 0);
    State t, after;
    for (int x = 0; x < kNumSyms; ++x) {
      if (!first[static_cast<size_t>(x)]) continue;
      after = cur_;
      G.feed(after, static_cast<Sym>(x));
      for (int32_t id : V->by_first[static_cast<size_t>(x)]) {
        const uint32_t len = V->len(id);
        const Sym* p = V->begin(id);
        bool ok = true;
        if (len > 1) {
          t = after;
          for (uint32_t k = 1; k < len && ok; ++k) ok = G.feed(t, p[k]);
        }
        mask_[static_cast<size_t>(id)] = ok;
      }
    }
  }

  // Inside free text the verdict on a token depends only on the text frame, except for the tokens that leave
  // it (a JSON string's closing quote and what follows): masks are cached per frame state, and only the
  // leaving tokens are simulated on the whole state each step.
  void scan_text(const Frame& top, const Node& g) {
    const bool closing = top.d >= g.cap;
    TextMask* e = nullptr;
    for (auto& m : text_masks_)
      if (m.node == top.node && m.a == top.a && m.b == top.b && m.c == top.c && m.closing == closing) e = &m;
    if (!e) {
      if (text_masks_.size() >= kMaxTextMasks) text_masks_.erase(text_masks_.begin());
      TextMask m{top.node, top.a, top.b, top.c, closing, std::vector<uint8_t>(V->size, 0), {}};
      for (size_t i = 0; i < V->size; ++i) {
        const int32_t id = static_cast<int32_t>(i);
        const uint32_t len = V->len(id);
        const Sym* p = V->begin(id);
        Frame f = top;
        uint8_t verdict = len > 0 ? 1 : 0;
        for (uint32_t k = 0; k < len; ++k) {
          const R r = g.kind == K::Text ? G.step_text(f, g, p[k]) : G.step_jstr(f, g, p[k]);
          if (r == kReject || r == kLeave) {
            verdict = r == kReject ? 0 : 2;
            break;
          }
        }
        m.m[i] = verdict;
        if (verdict == 2) m.leave.push_back(id);
      }
      text_masks_.push_back(std::move(m));
      e = &text_masks_.back();
    }
    std::memcpy(mask_.data(), e->m.data(), V->size);
    State t;
    for (int32_t id : e->leave) {
      t = cur_;
      const Sym* p = V->begin(id);
      bool ok = true;
      for (uint32_t k = 0; k < V->len(id) && ok; ++k) ok = G.feed(t, p[k]);
      mask_[static_cast<size_t>(id)] = ok;
    }
  }

  void commit(int32_t t) {
    DSX_CHECK(t >= 0 && static_cast<size_t>(t) < V->size && V->len(t) > 0, "constrained decoding: token ", t,
              " is not allowed");
    State s = cur_;
    const int top = cur_.n - 1;
    const Frame f0 = cur_.f[top];
    const K kind = G.nodes[static_cast<size_t>(f0.node)].kind;
    const Sym* p = V->begin(t);
    for (uint32_t k = 0; k < V->len(t); ++k)
      DSX_CHECK(G.feed(s, p[k]), "constrained decoding: token ", t, " does not continue the constrained output");
    // a token spent inside a string / the reasoning counts towards its limit
    if ((kind == K::Text || kind == K::JStr) && s.n > top && s.f[top].node == f0.node) ++s.f[top].d;
    if (wrap_) cap_texts(s);
    cur_ = s;
    have_first_ = false;
  }

  // Wrap-up: every string / reasoning frame on the stack at its token limit (closing).
  void cap_texts(State& s) const {
    for (int i = 0; i < s.n; ++i) {
      const Node& g = G.nodes[static_cast<size_t>(s.f[i].node)];
      if (g.kind == K::Text || g.kind == K::JStr) s.f[i].d = std::max(s.f[i].d, g.cap);
    }
  }

  const Tokenizer& tok_;
  std::shared_ptr<const Vocab> V;
  Grammar G;
  State cur_;
  std::deque<int32_t> forced_;
  std::vector<uint8_t> mask_;
  struct TextMask {
    int32_t node, a, b, c;
    bool closing;
    std::vector<uint8_t> m;  // 0 rejected, 1 allowed, 2 leaves the text node (decided on the whole state)
    std::vector<int32_t> leave;
  };
  static constexpr size_t kMaxTextMasks = 16;
  std::vector<TextMask> text_masks_;
  SymSet first_;
  bool have_first_ = false;
  bool natural_ = false;
  bool wrap_ = false;
};

// tool_choice "auto": free decoding (passive) until the trigger, then the lazy tool grammar.
class LazyToolConstraint final : public Constraint {
 public:
  LazyToolConstraint(const Tokenizer& tok, std::shared_ptr<const Vocab> v, Grammar g, bool thinking)
      : tok_(tok), V(v), calls_(tok, std::move(v), std::move(g), true), phase_(thinking ? kReasoning : kContent) {}

  bool passive() const override { return phase_ != kCalls; }
  void observe(int32_t t) override {
    DSX_CHECK(phase_ != kCalls, "constrained decoding: observe() after the tool-call trigger");
    if (t < 0 || static_cast<size_t>(t) >= V->size) return;
    if (phase_ == kReasoning) {
      if (t == V->marker_id[1]) phase_ = kContent;  // </think>
      return;
    }
    if (t == V->marker_id[0] && last_ == "<") {  // "<｜DSML｜": a block opener begins (not "</｜DSML｜")
      phase_ = kCalls;
      return;
    }
    std::string b;
    if (t == V->marker_id[0] || t == V->marker_id[2]) {
      b = kMarkerText[t == V->marker_id[0] ? 0 : 2];
    } else {
      try {
        b = tok_.decode_one(t);
      } catch (const std::exception&) {
      }
    }
    if (!b.empty()) last_ = std::string(1, b.back());  // (after "</" it is '/': a closer is no trigger)
  }
  bool needs_logits() const override { return phase_ != kCalls || calls_.needs_logits(); }
  bool done() const override { return phase_ == kCalls && calls_.done(); }
  void wrap_up() override { calls_.wrap_up(); }  // (before the trigger: for a block opened later)
  int32_t next(float* logits, int64_t vocab, const std::function<int32_t(const float*, int64_t)>& pick) override {
    if (phase_ == kCalls) return calls_.next(logits, vocab, pick);
    DSX_CHECK(logits && vocab > 0, "constrained decoding: this step needs logits");
    int32_t t = pick(logits, vocab);
    observe(t);
    return t;
  }

 private:
  enum Phase { kReasoning, kContent, kCalls };
  const Tokenizer& tok_;
  std::shared_ptr<const Vocab> V;
  GrammarConstraint calls_;
  Phase phase_;
  std::string last_;
};

}  // namespace

std::unique_ptr<Constraint> lazy_tool_constraint(const text::Tokenizer& tok, const std::vector<text::ToolSpec>& tools,
                                                 text::Profile profile, bool thinking, ConstraintLimits lim) {
  std::vector<const text::ToolSpec*> usable;
  for (const auto& t : tools)
    if (!t.name.empty() && t.name.find('"') == std::string::npos) usable.push_back(&t);
  if (usable.empty()) return nullptr;
  auto v = vocab_for(tok);
  Grammar g;
  try {
    Builder b(g, *v, tok, lim);
    b.set_dsml(profile);
    g.root = b.lazy_block(usable);
  } catch (const Error&) {
    return nullptr;  // (a schema the grammar cannot express: decode freely)
  }
  return std::make_unique<LazyToolConstraint>(tok, std::move(v), std::move(g), thinking);
}

std::unique_ptr<Constraint> tool_call_constraint(const text::Tokenizer& tok, const std::vector<text::ToolSpec>& tools,
                                                 const std::string& choice, text::Profile profile, bool thinking,
                                                 ConstraintLimits lim) {
  std::vector<const text::ToolSpec*> chosen;
  if (choice == "required") {
    for (const auto& t : tools) chosen.push_back(&t);
    DSX_CHECK(!chosen.empty(), "tool_choice \"required\" needs at least one tool");
  } else {
    for (const auto& t : tools)
      if (t.name == choice) {
        chosen.push_back(&t);
        break;
      }
    DSX_CHECK(!chosen.empty(), "tool_choice names an unknown tool '", choice, "'");
  }
  for (const auto* t : chosen)
    DSX_CHECK(!t->name.empty() && t->name.find('"') == std::string::npos, "tool name '", t->name,
              "' cannot be written in a DSML invoke");
  auto v = vocab_for(tok);
  Grammar g;
  Builder b(g, *v, tok, lim);
  b.set_dsml(profile);
  g.root = b.tool_block(chosen, thinking);
  return std::make_unique<GrammarConstraint>(tok, std::move(v), std::move(g));
}

std::unique_ptr<Constraint> json_constraint(const text::Tokenizer& tok, const text::pyjson::Value& response_format,
                                            bool thinking, ConstraintLimits lim) {
  const Value* type = response_format.get("type");
  DSX_CHECK(type && type->is_string() && (type->text == "json_schema" || type->text == "json_object"),
            "response_format: type must be \"json_schema\" or \"json_object\"");
  const Value* schema = nullptr;
  if (type->text == "json_schema") {
    const Value* js = response_format.get("json_schema");
    schema = js ? js->get("schema") : response_format.get("schema");
    if (schema)
      DSX_CHECK(schema->is_object() || (schema->type == pyjson::Type::Bool && schema->boolean),
                "response_format: json_schema.schema must be a JSON schema object");
  }
  auto v = vocab_for(tok);
  Grammar g;
  Builder b(g, *v, tok, lim);
  b.set_json_content();
  std::vector<int32_t> parts;
  if (thinking) parts.push_back(b.reasoning());
  if (schema) {  // (true: any value)
    b.ref_root = schema;
    parts.push_back(b.json(schema, 0));
  } else {  // json_object: any object
    parts.push_back(b.gobj(b.jstr(), b.any(1)));
  }
  parts.push_back(b.lit({kSymEos}));
  g.root = b.seq(parts);
  return std::make_unique<GrammarConstraint>(tok, std::move(v), std::move(g));
}

}  // namespace dsx::server
