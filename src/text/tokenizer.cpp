#include "text/tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "text/bpe.h"
#include "text/bpe_pretokenizer.h"
#include "text/unicode.h"
#include "util/error.h"

namespace dsx::text {

namespace {

using json = nlohmann::json;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Byte trie over added-token contents; finds leftmost-longest matches (the
// semantics of HF's Aho-Corasick automaton with MatchKind::LeftmostLongest).
class AddedMatcher {
 public:
  struct Match {
    size_t begin, end;
    int32_t id;
  };

  void add(std::string_view content, int32_t id) {
    if (nodes_.empty()) nodes_.push_back(-1);
    uint32_t node = 0;
    for (unsigned char b : content) {
      const uint64_t key = (uint64_t{node} << 8) | b;
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        nodes_.push_back(-1);
        it = edges_.emplace(key, static_cast<uint32_t>(nodes_.size() - 1)).first;
      }
      node = it->second;
    }
    nodes_[node] = id;
    first_[static_cast<unsigned char>(content[0])] = true;
  }

  bool empty() const { return nodes_.empty(); }

  // Appends the matches in s (non-overlapping, left to right).
  void find_all(std::string_view s, std::vector<Match>& out) const {
    if (nodes_.empty()) return;
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    size_t i = 0;
    while (i < s.size()) {
      if (!first_[p[i]]) {
        ++i;
        continue;
      }
      uint32_t node = 0;
      int32_t best = -1;
      size_t best_len = 0;
      for (size_t j = i; j < s.size(); ++j) {
        const auto it = edges_.find((uint64_t{node} << 8) | p[j]);
        if (it == edges_.end()) break;
        node = it->second;
        if (nodes_[node] >= 0) {
          best = nodes_[node];
          best_len = j + 1 - i;
        }
      }
      if (best >= 0) {
        out.push_back({i, i + best_len, best});
        i += best_len;
      } else {
        ++i;
      }
    }
  }

 private:
  std::vector<int32_t> nodes_;  // token id ending at each node, or -1
  std::unordered_map<uint64_t, uint32_t> edges_;
  bool first_[256] = {};
};

// string -> id over the strings of `vocab_r` (open addressing; the keys are not copied).
class VocabIndex {
 public:
  explicit VocabIndex(const std::vector<std::string>* strings) : strings_(strings) {}
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
  }
  // Indexes (*strings_)[id]; false when that string is already present.
  bool insert(int32_t id) {
    const std::string& key = (*strings_)[id];
    const uint64_t h = PieceCache::hash(key);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.id < 0) {
        s = Slot{h, id};
        return true;
      }
      if (s.hash == h && (*strings_)[s.id] == key) return false;
    }
  }
  int32_t find(std::string_view key) const {
    if (slots_.empty()) return -1;
    const uint64_t h = PieceCache::hash(key);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.hash == h && (*strings_)[s.id] == key) return s.id;
    }
  }
 private:
  struct Slot {
    uint64_t hash = 0;
    int32_t id = -1;
  };
  const std::vector<std::string>* strings_;
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

// tokenizer.json parsed with a SAX handler: model.vocab and model.merges (the bulk of
// the file) go straight into vectors, everything else into a small DOM.
struct ParsedJson {
  json rest;
  bool has_vocab = false, has_merges = false;
  std::vector<std::pair<std::string, int64_t>> vocab;  // id -1: not an integer in range
  struct Merge {
    std::string a, b;
    bool ok;  // a string "a b" with one space or a pair of strings
  };
  std::vector<Merge> merges;
};

class TokenizerSax {
 public:
  TokenizerSax(ParsedJson& out, const std::string& source) : out_(out), source_(source) {}
  const std::string& error() const { return error_; }

  bool null() { return value(json()); }
  bool boolean(bool v) { return value(json(v)); }
  bool number_integer(json::number_integer_t v) { return value(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return value(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return value(json(v)); }
  bool string(json::string_t& v) {
    if (mode_ == kMerges) {
      out_.merges.push_back(split_merge(v));
      return true;
    }
    if (mode_ == kMergePair) {
      pair_.push_back(std::move(v));
      return true;
    }
    return value(json(std::move(v)));
  }
  bool binary(json::binary_t&) { return false; }
  bool key(json::string_t& k) {
    if (mode_ == kVocab)
      vocab_key_ = std::move(k);
    else
      keys_.back() = std::move(k);
    return true;
  }
  bool start_object(std::size_t) {
    if (mode_ == kNormal && in_model() && keys_.back() == "vocab") {
      mode_ = kVocab;
      out_.has_vocab = true;
      ++depth_;
      return true;
    }
    if (mode_ != kNormal) return bad_bulk();
    open(json::object());
    keys_.emplace_back();
    return true;
  }
  bool end_object() {
    if (mode_ == kVocab) {
      mode_ = kNormal;
      --depth_;
      return true;
    }
    keys_.pop_back();
    stack_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) {
    if (mode_ == kNormal && in_model() && keys_.back() == "merges") {
      mode_ = kMerges;
      out_.has_merges = true;
      ++depth_;
      return true;
    }
    if (mode_ == kMerges) {
      mode_ = kMergePair;
      pair_.clear();
      pair_bad_ = false;
      return true;
    }
    if (mode_ != kNormal) return bad_bulk();
    open(json::array());
    keys_.emplace_back();
    return true;
  }
  bool end_array() {
    if (mode_ == kMergePair) {
      const bool ok = pair_.size() == 2 && !pair_bad_;
      out_.merges.push_back({ok ? pair_[0] : std::string(), ok ? pair_[1] : std::string(), ok});
      mode_ = kMerges;
      return true;
    }
    if (mode_ == kMerges) {
      mode_ = kNormal;
      --depth_;
      return true;
    }
    keys_.pop_back();
    stack_.pop_back();
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error_ = e.what();
    return false;
  }

 private:
  enum Mode { kNormal, kVocab, kMerges, kMergePair };

  // Directly inside the top-level "model" object?
  bool in_model() const { return depth_ == 2 && keys_.size() == 2 && keys_[0] == "model" && stack_.back()->is_object(); }

  static ParsedJson::Merge split_merge(const std::string& s) {
    const size_t sp = s.find(' ');
    if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) return {s, std::string(), false};
    return {s.substr(0, sp), s.substr(sp + 1), true};
  }

  // A nested container inside an entry of model.vocab / model.merges.
  [[noreturn]] bool bad_bulk() {
    if (mode_ == kVocab) fail(source_, ": model.vocab['", vocab_key_, "'] is not a valid token id");
    fail(source_, ": model.merges[", out_.merges.size(), "] must be a string \"a b\" or a pair of strings");
  }

  bool value(json v) {
    switch (mode_) {
      case kVocab: {
        int64_t id = -1;
        if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX) id = v.get<int64_t>();
        out_.vocab.emplace_back(std::move(vocab_key_), id);
        return true;
      }
      case kMerges:
        out_.merges.push_back({std::string(), std::string(), false});
        return true;
      case kMergePair:
        pair_bad_ = true;  // a non-string member
        return true;
      case kNormal:
        break;
    }
    if (stack_.empty()) {
      out_.rest = std::move(v);
      return true;
    }
    json& top = *stack_.back();
    if (top.is_object())
      top[keys_.back()] = std::move(v);
    else
      top.push_back(std::move(v));
    return true;
  }

  void open(json container) {
    ++depth_;
    if (stack_.empty()) {
      out_.rest = std::move(container);
      stack_.push_back(&out_.rest);
      return;
    }
    json& top = *stack_.back();
    json* child;
    if (top.is_object()) {
      child = &(top[keys_.back()] = std::move(container));
    } else {
      top.push_back(std::move(container));
      child = &top.back();
    }
    stack_.push_back(child);
  }

  ParsedJson& out_;
  const std::string& source_;
  std::string error_;
  bool pair_bad_ = false;
  Mode mode_ = kNormal;
  int depth_ = 0;
  std::vector<json*> stack_;
  std::vector<std::string> keys_;  // current member name per open container
  std::string vocab_key_;
  std::vector<std::string> pair_;
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open tokenizer file ", path, ": ", std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail("cannot read tokenizer file ", path);
  return std::move(ss).str();
}

constexpr size_t kMaxCachedPiece = 256;      // bytes
constexpr size_t kMaxCacheEntries = 1 << 18;  // then the cache is cleared

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  // BPE model
  std::vector<std::string> vocab_r;  // id -> byte-level string ("" when the id is not in the vocab)
  VocabIndex vocab{&vocab_r};        // byte-level string -> id
  size_t vocab_count = 0;
  MergeTable merges;
  std::array<int32_t, 256> byte_id{};
  bool ignore_merges = false;
  PreTokenizer pre;
  // added tokens
  std::vector<AddedToken> added;
  StringMap<int32_t> added_by_content;
  AddedMatcher match_raw;   // normalized=false: matched first, on the raw text
  AddedMatcher match_norm;  // normalized=true: matched in the remaining text
  // per id (0 .. size-1)
  std::vector<std::string> bytes;  // what decode produces for the id
  std::vector<uint8_t> flags;      // kInVocab | kAdded | kSpecial
  std::vector<int32_t> added_pos;  // index into `added`, or -1
  static constexpr uint8_t kInVocab = 1, kAdded = 2, kSpecial = 4;
  // piece cache
  mutable std::mutex cache_mu;
  mutable PieceCache cache{kMaxCacheEntries};
  bool cache_enabled = true;

  void load(ParsedJson& p);
  void encode_segment(std::string_view seg, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
};

// ---- loading -------------------------------------------------------------------------

namespace {

bool is_null_or(const json& j, const char* key, auto pred) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() || pred(*it);
}

}  // namespace

void Tokenizer::Impl::load(ParsedJson& p) {
  const std::string& W = source;
  const json& j = p.rest;
  if (!j.is_object()) fail(W, ": tokenizer.json must be a JSON object");

  // -- normalizer: none (null or an empty Sequence) --
  if (const auto it = j.find("normalizer"); it != j.end() && !it->is_null()) {
    const bool empty_seq = it->is_object() && it->value("type", "") == "Sequence" && it->contains("normalizers") &&
                           (*it)["normalizers"].is_array() && (*it)["normalizers"].empty();
    if (!empty_seq) fail(W, ": normalizer ", it->dump().substr(0, 200), " is not supported (only none)");
  }

  // -- model --
  const auto mit = j.find("model");
  if (mit == j.end() || !mit->is_object()) fail(W, ": missing object 'model'");
  const json& m = *mit;
  if (m.contains("type") && (!m["type"].is_string() || m["type"].get<std::string>() != "BPE"))
    fail(W, ": model.type ", m["type"].dump(), " is not supported (only BPE)");
  if (!p.has_vocab) fail(W, ": missing object 'model.vocab'");
  if (!p.has_merges) fail(W, ": missing array 'model.merges'");
  if (!is_null_or(m, "dropout", [](const json& v) { return v.is_number() && v.get<double>() == 0.0; }))
    fail(W, ": model.dropout is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!is_null_or(m, k, [](const json& v) { return v.is_string() && v.get<std::string>().empty(); }))
      fail(W, ": model.", k, " is not supported");
  if (const auto it = m.find("ignore_merges"); it != m.end()) {
    if (!it->is_boolean()) fail(W, ": model.ignore_merges must be a boolean");
    ignore_merges = it->get<bool>();
  }

  int32_t max_id = -1;
  for (const auto& [tok, id] : p.vocab) {
    if (id < 0) fail(W, ": model.vocab['", tok, "'] is not a valid token id");
    max_id = std::max(max_id, static_cast<int32_t>(id));
  }
  vocab_r.assign(static_cast<size_t>(max_id + 1), std::string());
  std::vector<uint8_t> seen(static_cast<size_t>(max_id + 1), 0);
  vocab.reserve(p.vocab.size());
  for (auto& [tok, id64] : p.vocab) {
    const auto id = static_cast<int32_t>(id64);
    if (seen[id]) fail(W, ": model.vocab has two tokens with id ", id, " ('", vocab_r[id], "', '", tok, "')");
    seen[id] = 1;
    vocab_r[id] = std::move(tok);
    if (!vocab.insert(id)) fail(W, ": model.vocab lists '", vocab_r[id], "' twice");
  }
  vocab_count = p.vocab.size();
  p.vocab.clear();
  p.vocab.shrink_to_fit();
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    utf8::append(sym, byte_level::byte_to_char(static_cast<uint8_t>(b)));
    const int32_t id = vocab.find(sym);
    if (id < 0) fail(W, ": model.vocab lacks the byte-level symbol '", sym, "' of byte ", b);
    byte_id[b] = id;
  }

  merges.reserve(p.merges.size());
  std::string ab;
  for (size_t r = 0; r < p.merges.size(); ++r) {
    const ParsedJson::Merge& mg = p.merges[r];
    if (!mg.ok)
      fail(W, ": model.merges[", r, "] must be a string \"a b\" (two tokens, one space) or a pair of strings");
    ab.assign(mg.a).append(mg.b);
    const int32_t ia = vocab.find(mg.a), ib = vocab.find(mg.b), im = vocab.find(ab);
    if (ia < 0) fail(W, ": model.merges[", r, "]: token '", mg.a, "' is not in the vocab");
    if (ib < 0) fail(W, ": model.merges[", r, "]: token '", mg.b, "' is not in the vocab");
    if (im < 0) fail(W, ": model.merges[", r, "]: merged token '", ab, "' is not in the vocab");
    merges.set(ia, ib, static_cast<int32_t>(r), im);
  }
  p.merges.clear();
  p.merges.shrink_to_fit();

  // -- pre-tokenizer / decoder --
  pre = PreTokenizer::from_json(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(), W);
  const auto dit = j.find("decoder");
  if (dit == j.end() || !dit->is_object() || dit->value("type", "") != "ByteLevel")
    fail(W, ": decoder must be ByteLevel (found ", dit == j.end() ? std::string("none") : dit->dump().substr(0, 200), ")");

  // -- added tokens --
  if (const auto ait = j.find("added_tokens"); ait != j.end() && !ait->is_null()) {
    if (!ait->is_array()) fail(W, ": added_tokens must be an array");
    for (size_t i = 0; i < ait->size(); ++i) {
      const json& t = (*ait)[i];
      const std::string F = cat(W, ": added_tokens[", i, "]");
      if (!t.is_object()) fail(F, " must be an object");
      AddedToken a;
      const auto idit = t.find("id");
      if (idit == t.end() || !idit->is_number_integer() || idit->get<int64_t>() < 0 || idit->get<int64_t>() > INT32_MAX)
        fail(F, ".id missing or not a valid token id");
      a.id = static_cast<int32_t>(idit->get<int64_t>());
      const auto cit = t.find("content");
      if (cit == t.end() || !cit->is_string() || cit->get_ref<const std::string&>().empty())
        fail(F, ".content missing or empty");
      a.content = cit->get<std::string>();
      auto flag = [&](const char* key, bool def) {
        const auto it = t.find(key);
        if (it == t.end()) return def;
        if (!it->is_boolean()) fail(F, ".", key, " must be a boolean");
        return it->get<bool>();
      };
      a.special = flag("special", false);
      a.normalized = flag("normalized", true);
      for (const char* k : {"single_word", "lstrip", "rstrip"})
        if (flag(k, false)) fail(F, " ('", a.content, "'): ", k, "=true is not supported");
      if (added_by_content.count(a.content)) fail(F, ": duplicate content '", a.content, "'");
      for (const auto& o : added)
        if (o.id == a.id) fail(F, ": id ", a.id, " is used by '", o.content, "' and '", a.content, "'");
      added_by_content.emplace(a.content, a.id);
      (a.normalized ? match_norm : match_raw).add(a.content, a.id);
      max_id = std::max(max_id, a.id);
      added.push_back(std::move(a));
    }
  }

  // -- per-id decode table --
  const size_t n = static_cast<size_t>(max_id + 1);
  bytes.assign(n, std::string());
  flags.assign(n, 0);
  auto to_bytes = [](const std::string& s) {
    std::string out;
    return byte_level::decode(s, &out) ? out : s;  // HF: a token with a character outside the map stays as is
  };
  for (size_t id = 0; id < vocab_r.size(); ++id)
    if (seen[id]) {
      flags[id] |= kInVocab;
      bytes[id] = to_bytes(vocab_r[id]);
    }
  added_pos.assign(n, -1);
  for (size_t k = 0; k < added.size(); ++k) {
    const AddedToken& a = added[k];
    flags[a.id] |= kAdded | (a.special ? kSpecial : 0);
    bytes[a.id] = to_bytes(a.content);
    added_pos[a.id] = static_cast<int32_t>(k);
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json_text(std::string_view text, const std::string& source) {
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  ParsedJson parsed;
  try {
    TokenizerSax sax(parsed, source);
    if (!json::sax_parse(text.begin(), text.end(), &sax)) fail(source, ": malformed JSON: ", sax.error());
  } catch (const json::exception& e) {
    fail(source, ": malformed JSON: ", e.what());
  }
  try {
    impl->load(parsed);
  } catch (const json::exception& e) {
    fail(source, ": invalid tokenizer.json: ", e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& path) { return from_json_text(read_file(path), path); }

Tokenizer Tokenizer::from_model_dir(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir) / "tokenizer.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(p, ec)) fail("model directory ", dir, " has no tokenizer.json");
  return from_file(p.string());
}

// ---- encoding ------------------------------------------------------------------------

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const auto* p = reinterpret_cast<const unsigned char*>(piece.data());
  if (piece.size() == 1) {
    out.push_back(byte_id[p[0]]);
    return;
  }
  const bool cacheable = cache_enabled && piece.size() <= kMaxCachedPiece;
  uint64_t h = 0;
  if (cacheable) {
    h = PieceCache::hash(piece);
    std::lock_guard<std::mutex> lock(cache_mu);
    if (cache.lookup(piece, h, out)) return;
  }
  thread_local std::vector<int32_t> syms;
  syms.clear();
  if (ignore_merges) {
    if (const int32_t id = vocab.find(byte_level::encode(piece)); id >= 0) syms.push_back(id);
  }
  if (syms.empty()) {
    syms.resize(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) syms[i] = byte_id[p[i]];
    bpe_merge(merges, syms);
  }
  out.insert(out.end(), syms.begin(), syms.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    cache.insert(piece, h, syms.data(), syms.size());
  }
}

void Tokenizer::Impl::encode_segment(std::string_view seg, std::vector<int32_t>& out) const {
  std::vector<Span> pieces;
  auto run = [&](std::string_view valid) {
    pieces.clear();
    pre.split(valid, pieces);
    for (const Span& s : pieces) encode_piece(valid.substr(s.begin, s.end - s.begin), out);
  };
  // Cut at ill-formed bytes: each one becomes its own single-byte piece.
  size_t i = 0;
  while (i < seg.size()) {
    const size_t end = utf8::valid_run_end(seg, i);
    if (end > i) run(seg.substr(i, end - i));
    if (end >= seg.size()) break;
    const utf8::Decoded d = utf8::decode(seg, end);
    for (size_t k = 0; k < d.len; ++k) out.push_back(byte_id[static_cast<unsigned char>(seg[end + k])]);
    i = end + d.len;
  }
}

void Tokenizer::encode_into(std::string_view text, bool allow_added, std::vector<int32_t>& out) const {
  const Impl& m = *impl_;
  if (!allow_added || (m.match_raw.empty() && m.match_norm.empty())) {
    m.encode_segment(text, out);
    return;
  }
  // Pass 1: non-normalized added tokens on the raw text; pass 2: normalized ones in
  // the gaps (the normalizer is the identity).
  std::vector<AddedMatcher::Match> raw, norm;
  m.match_raw.find_all(text, raw);
  size_t pos = 0;
  auto gap = [&](size_t end) {
    if (end <= pos) return;
    const std::string_view g = text.substr(pos, end - pos);
    norm.clear();
    m.match_norm.find_all(g, norm);
    size_t q = 0;
    for (const auto& mm : norm) {
      if (mm.begin > q) m.encode_segment(g.substr(q, mm.begin - q), out);
      out.push_back(mm.id);
      q = mm.end;
    }
    if (g.size() > q) m.encode_segment(g.substr(q), out);
  };
  for (const auto& mm : raw) {
    gap(mm.begin);
    out.push_back(mm.id);
    pos = mm.end;
  }
  gap(text.size());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_added) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode_into(text, allow_added, out);
  return out;
}

// ---- decoding and lookups ------------------------------------------------------------------

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= impl_->bytes.size())
      fail("decode: token id ", id, " out of range [0, ", impl_->bytes.size(), ") of ", impl_->source);
    out += impl_->bytes[id];
  }
  return out;
}

std::string Tokenizer::decode_one(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->bytes.size())
    fail("decode: token id ", id, " out of range [0, ", impl_->bytes.size(), ") of ", impl_->source);
  return impl_->bytes[id];
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (const int32_t id = impl_->vocab.find(token); id >= 0) return id;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->flags.size())
    fail("id_to_token: token id ", id, " out of range [0, ", impl_->flags.size(), ") of ", impl_->source);
  if (const int32_t k = impl_->added_pos[id]; k >= 0) return impl_->added[k].content;
  if (static_cast<size_t>(id) < impl_->vocab_r.size()) return impl_->vocab_r[id];
  return std::string();
}

bool Tokenizer::is_added(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->flags.size() && (impl_->flags[id] & Impl::kAdded);
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->flags.size() && (impl_->flags[id] & Impl::kSpecial);
}

size_t Tokenizer::size() const { return impl_->bytes.size(); }
size_t Tokenizer::vocab_size() const { return impl_->vocab_count; }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::string& Tokenizer::source() const { return impl_->source; }

void Tokenizer::clear_cache() const {
  std::lock_guard<std::mutex> lock(impl_->cache_mu);
  impl_->cache.clear();
}
void Tokenizer::set_cache_enabled(bool on) {
  clear_cache();
  impl_->cache_enabled = on;
}
void Tokenizer::set_fast_paths_enabled(bool on) { impl_->pre.set_fast_paths_enabled(on); }
bool Tokenizer::has_fast_paths() const { return impl_->pre.has_fast_paths(); }

// ---- streaming -------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok) : tok_(&tok) {}

std::string StreamDecoder::push(int32_t id) { return push_bytes(tok_->decode_one(id)); }

std::string StreamDecoder::push_bytes(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const utf8::Decoded d = utf8::decode(pending_, i);
    if (d.status == utf8::Decoded::kIncomplete) break;
    if (d.status == utf8::Decoded::kValid)
      out.append(pending_, i, d.len);
    else
      out.append(utf8::kReplacementUtf8);
    i += d.len;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = pending_.empty() ? std::string() : std::string(utf8::kReplacementUtf8);
  pending_.clear();
  return out;
}

}  // namespace dsx::text
