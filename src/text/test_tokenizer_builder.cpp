#include "text/test_tokenizer_builder.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsx::text {

namespace {

// ---- an order-preserving JSON tree ------------------------------------------------------

struct Node {
  enum Kind { kNull, kBool, kInt, kUInt, kFloat, kString, kArray, kObject } kind = kNull;
  bool b = false;
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  std::string s;
  std::vector<std::string> keys;  // objects: member names, parallel to `items`
  std::vector<Node> items;        // arrays: elements; objects: member values

  Node* member(std::string_view k) {
    for (size_t n = 0; n < keys.size(); ++n)
      if (keys[n] == k) return &items[n];
    return nullptr;
  }
};

Node make_string(std::string v) {
  Node n;
  n.kind = Node::kString;
  n.s = std::move(v);
  return n;
}
Node make_bool(bool v) {
  Node n;
  n.kind = Node::kBool;
  n.b = v;
  return n;
}
Node make_int(int64_t v) {
  Node n;
  n.kind = Node::kInt;
  n.i = v;
  return n;
}

// nlohmann SAX consumer building a Node tree (no member reordering, no dedup).
class TreeBuilder {
 public:
  using json = nlohmann::json;
  explicit TreeBuilder(std::string source) : source_(std::move(source)) {}
  Node result;

  bool null() { return attach(Node{}); }
  bool boolean(bool v) { return attach(make_bool(v)); }
  bool number_integer(json::number_integer_t v) { return attach(make_int(v)); }
  bool number_unsigned(json::number_unsigned_t v) {
    Node n;
    n.kind = Node::kUInt;
    n.u = v;
    return attach(std::move(n));
  }
  bool number_float(json::number_float_t v, const json::string_t&) {
    Node n;
    n.kind = Node::kFloat;
    n.d = v;
    return attach(std::move(n));
  }
  bool string(json::string_t& v) { return attach(make_string(std::move(v))); }
  bool binary(json::binary_t&) { return false; }
  bool start_object(std::size_t) {
    Node n;
    n.kind = Node::kObject;
    stack_.push_back(std::move(n));
    return true;
  }
  bool key(json::string_t& k) {
    stack_.back().keys.push_back(std::move(k));
    return true;
  }
  bool end_object() { return close(); }
  bool start_array(std::size_t) {
    Node n;
    n.kind = Node::kArray;
    stack_.push_back(std::move(n));
    return true;
  }
  bool end_array() { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    fail(source_, ": malformed JSON: ", ex.what());
  }

 private:
  bool attach(Node&& v) {
    if (stack_.empty())
      result = std::move(v);
    else
      stack_.back().items.push_back(std::move(v));
    return true;
  }
  bool close() {
    Node n = std::move(stack_.back());
    stack_.pop_back();
    return attach(std::move(n));
  }
  std::string source_;
  std::vector<Node> stack_;
};

Node parse_ordered(std::string_view text, const std::string& source) {
  TreeBuilder b(source);
  nlohmann::json::sax_parse(text.begin(), text.end(), &b);
  return std::move(b.result);
}

// ---- Python json.dumps(ensure_ascii=False) ---------------------------------------------

void dump_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

// Python repr(float): shortest round-trip digits; fixed notation when the decimal
// exponent is in [-4, 16), else d.ddde±XX.
void dump_float(double d, std::string& out) {
  if (std::isnan(d)) {
    out += "NaN";
    return;
  }
  if (std::isinf(d)) {
    out += d < 0 ? "-Infinity" : "Infinity";
    return;
  }
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t epos = sci.find('e');
  const int exp = std::stoi(sci.substr(epos + 1));
  std::string digits = sci.substr(0, epos);
  if (digits.size() > 1) digits.erase(1, 1);  // drop the '.'
  out += sign;
  if (exp >= -4 && exp < 16) {
    const int point = exp + 1;  // digits before the decimal point
    if (point <= 0) {
      out += "0." + std::string(static_cast<size_t>(-point), '0') + digits;
    } else if (static_cast<size_t>(point) >= digits.size()) {
      out += digits + std::string(static_cast<size_t>(point) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(point)) + "." + digits.substr(static_cast<size_t>(point));
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    out += e;
  }
}

void dump(const Node& n, std::string& out) {
  switch (n.kind) {
    case Node::kNull: out += "null"; break;
    case Node::kBool: out += n.b ? "true" : "false"; break;
    case Node::kInt: out += std::to_string(n.i); break;
    case Node::kUInt: out += std::to_string(n.u); break;
    case Node::kFloat: dump_float(n.d, out); break;
    case Node::kString: dump_string(n.s, out); break;
    case Node::kArray:
      out += '[';
      for (size_t k = 0; k < n.items.size(); ++k) {
        if (k) out += ", ";
        dump(n.items[k], out);
      }
      out += ']';
      break;
    case Node::kObject:
      out += '{';
      for (size_t k = 0; k < n.items.size(); ++k) {
        if (k) out += ", ";
        dump_string(n.keys[k], out);
        out += ": ";
        dump(n.items[k], out);
      }
      out += '}';
      break;
  }
}

// ---- the added-token table ------------------------------------------------------------

// 128815 .. 128846 (same in V4 and V4.1).
const char* const kNamedTokens[] = {
    "<｜begin▁of▁repo▁name｜>", "<｜end▁of▁repo▁name｜>", "<｜begin▁of▁file▁name｜>", "<｜end▁of▁file▁name｜>",
    "<｜begin▁of▁file｜>",      "<｜end▁of▁file｜>",      "<think>",                  "</think>",
    "<｜place▁holder▁for▁copy｜>", "<｜place▁holder▁for▁pointer▁replace｜>", "｜DSML｜", "<｜begin▁sys｜>",
    "<｜end▁sys｜>",            "<｜latest_reminder｜>",  "<｜action｜>",              "<｜query｜>",
    "<｜authority｜>",          "<｜domain｜>",           "<｜task｜>",                "<｜political｜>",
    "<｜entity｜>",             "<｜title｜>",            "<｜safety｜>",              "<｜answer｜>",
    "<｜search｜>",             "<dsml:",                "</dsml:",                  "<｜search▁begin｜>",
    "<｜search▁end｜>",         "<｜extracted_url｜>",    "<｜read_url｜>",            "<｜end_of_query｜>"};
constexpr int32_t kFirstNew = 128815;
// 128847 .. 129261: <|place_holder_mm_span_0021|> .. _0435|> (ASCII '|' and '_').
constexpr int32_t kFirstSpan = 128847, kFirstSpanNumber = 21, kLastSpanNumber = 435;
// 129271 .. 129278: grounding markup.
const char* const kGroundingTokens[] = {"<｜/polygon｜>", "<｜polygon｜>", "<｜/point｜>", "<｜point｜>",
                                        "<｜/box｜>",     "<｜box｜>",     "<｜/ref｜>",   "<｜ref｜>"};
// 129265 .. 129270 in V4 (placeholders in V4.1).
const char* const kV4TableTokens[] = {"<｜/table>｜", "<｜table｜>", "<｜/td｜>", "<｜td｜>", "<｜/tr｜>", "<｜tr｜>"};
constexpr int32_t kLastId = 129279;

std::string placeholder(int32_t id) { return "<｜place▁holder▁no▁" + std::to_string(id - 128000) + "｜>"; }

// Content of the added token `id` (kFirstNew <= id <= kLastId).
std::string new_token(int32_t id, TestTokenizerProfile p) {
  const bool v41 = p == TestTokenizerProfile::kV41;
  if (id < kFirstSpan) return kNamedTokens[id - kFirstNew];
  if (id < kFirstSpan + (kLastSpanNumber - kFirstSpanNumber + 1)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "<|place_holder_mm_span_%04d|>", id - kFirstSpan + kFirstSpanNumber);
    return buf;
  }
  switch (id) {
    case 129262: return "<｜rl_image_pad｜>";
    case 129263: return "<｜rl_image_start｜>";
    case 129264: return v41 ? "<｜deepseek_image｜>" : "<｜image2｜>";
    case kLastId: return v41 ? placeholder(id) : "<｜image｜>";
    default: break;
  }
  if (id <= 129270) return v41 ? placeholder(id) : kV4TableTokens[id - 129265];
  return kGroundingTokens[id - 129271];
}

Node added_token(int32_t id, std::string content, bool normalized, bool special) {
  Node n;
  n.kind = Node::kObject;
  const char* keys[] = {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"};
  Node values[] = {make_int(id),      make_string(std::move(content)), make_bool(false), make_bool(false),
                   make_bool(false), make_bool(normalized),            make_bool(special)};
  for (size_t k = 0; k < 7; ++k) {
    n.keys.push_back(keys[k]);
    n.items.push_back(std::move(values[k]));
  }
  return n;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open ", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail("cannot read ", path);
  return std::move(ss).str();
}

}  // namespace

std::string python_json_dumps(std::string_view json_text, const std::string& source) {
  const Node root = parse_ordered(json_text, source);
  std::string out;
  dump(root, out);
  return out;
}

std::string build_test_tokenizer(const std::string& path, TestTokenizerProfile profile) {
  Node root = parse_ordered(read_text(path), path);
  auto not_base = [&](const std::string& why) { fail(path, " is not DeepSeek V3's base tokenizer.json: ", why); };
  if (root.kind != Node::kObject) not_base("not a JSON object");
  Node* added = root.member("added_tokens");
  Node* model = root.member("model");
  if (!added || added->kind != Node::kArray) not_base("no array 'added_tokens'");
  if (!model || model->kind != Node::kObject) not_base("no object 'model'");
  const Node* vocab = model->member("vocab");
  if (!vocab || vocab->kind != Node::kObject || vocab->items.size() != 128000) not_base("model.vocab does not have 128000 entries");
  if (added->items.size() != 818) not_base(cat(added->items.size(), " added tokens instead of 818"));
  // Ids 0..2 then 128000..128814, in order, with the V3 contents at the anchors.
  for (size_t k = 0; k < added->items.size(); ++k) {
    Node& t = added->items[k];
    const int32_t want = k < 3 ? static_cast<int32_t>(k) : static_cast<int32_t>(128000 + k - 3);
    Node* id = t.kind == Node::kObject ? t.member("id") : nullptr;
    Node* content = t.kind == Node::kObject ? t.member("content") : nullptr;
    const bool id_ok = id && ((id->kind == Node::kUInt && id->u == static_cast<uint64_t>(want)) ||
                              (id->kind == Node::kInt && id->i == want));
    if (!id_ok || !content || content->kind != Node::kString)
      not_base(cat("added_tokens[", k, "] is not id ", want));
    if (want == 128799) {
      if (content->s != placeholder(128799)) not_base("id 128799 is not <｜place▁holder▁no▁799｜>");
      if (profile == TestTokenizerProfile::kV41) content->s = "<｜System｜>";
    }
    if ((want == 0 && content->s != "<｜begin▁of▁sentence｜>") || (want == 1 && content->s != "<｜end▁of▁sentence｜>") ||
        (want == 128803 && content->s != "<｜User｜>") || (want == 128814 && content->s != "<｜tool▁sep｜>"))
      not_base(cat("unexpected content '", content->s, "' for id ", want));
  }
  for (int32_t id = kFirstNew; id <= kLastId; ++id)
    added->items.push_back(added_token(id, new_token(id, profile), /*normalized=*/false, /*special=*/true));
  std::string out;
  out.reserve(5 << 20);
  dump(root, out);
  return out;
}

std::string build_v41_test_tokenizer(const std::string& v3_base_json_path) {
  return build_test_tokenizer(v3_base_json_path, TestTokenizerProfile::kV41);
}

}  // namespace dsx::text
