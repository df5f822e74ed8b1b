// CLI: dsx tokenize, dsx detokenize, dsx make-tokenizer.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/registry.h"
#include "text/test_tokenizer_builder.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dsx::text {
namespace {

Tokenizer load_tokenizer(const cli::Args& args) {
  const auto file = args.get("--tokenizer");
  const auto dir = args.get("-m");
  if (file && dir) fail("give either --tokenizer FILE or -m MODEL_DIR, not both");
  if (file) return Tokenizer::from_file(*file);
  if (dir) return Tokenizer::from_model_dir(*dir);
  fail("missing --tokenizer FILE or -m MODEL_DIR");
}

std::string read_input_file(const std::string& path) {
  if (path == "-") {
    std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (std::cin.bad()) fail("cannot read standard input");
    return s;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open input file ", path, ": ", std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail("cannot read input file ", path);
  return std::move(ss).str();
}

void write_all(const std::string& s) {
  if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size() || std::fflush(stdout) != 0) fail("cannot write output");
}

// dsx tokenize (--tokenizer F | -m DIR) (-p TEXT | -f FILE) [--json]
int cmd_tokenize(int argc, char** argv) {
  cli::Args args(argc, argv, {"--tokenizer", "-m", "-p", "-f"}, {"--json"});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  const auto prompt = args.get("-p");
  const auto file = args.get("-f");
  if (prompt && file) fail("give either -p TEXT or -f FILE, not both");
  if (!prompt && !file) fail("missing -p TEXT or -f FILE (use -f - for standard input)");
  const Tokenizer tok = load_tokenizer(args);
  const std::string text = prompt ? *prompt : read_input_file(*file);
  // Plain HF encode without BOS: added tokens written in the text are recognised.
  const std::vector<int32_t> ids = tok.encode(text, /*allow_added=*/true);
  std::string out;
  if (args.has("--json")) {
    nlohmann::json j;
    j["ids"] = ids;
    nlohmann::json toks = nlohmann::json::array();
    for (int32_t id : ids) toks.push_back(tok.id_to_token(id));
    j["tokens"] = std::move(toks);
    out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  } else {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ' ';
      out += std::to_string(ids[i]);
    }
    out += '\n';
  }
  write_all(out);
  return 0;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == ' ' || c == ',' || c == '\t' || c == '\n' || c == '\r' || c == '[' || c == ']') {
      ++i;
      continue;
    }
    size_t j = i;
    if (s[j] == '-') ++j;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
    if (j == i || (s[i] == '-' && j == i + 1)) fail("--ids: '", s.substr(i, 20), "' is not a token id");
    const long long v = std::stoll(s.substr(i, j - i));
    if (v < 0 || v > INT32_MAX) fail("--ids: ", s.substr(i, j - i), " is not a valid token id");
    ids.push_back(static_cast<int32_t>(v));
    i = j;
  }
  return ids;
}

// dsx detokenize (--tokenizer F | -m DIR) --ids "1 2 3"
int cmd_detokenize(int argc, char** argv) {
  cli::Args args(argc, argv, {"--tokenizer", "-m", "--ids"}, {});
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  const std::string ids_text = args.require("--ids");
  const Tokenizer tok = load_tokenizer(args);
  write_all(tok.decode(parse_ids(ids_text)) + "\n");
  return 0;
}

// dsx make-tokenizer --base V3.json -o OUT.json [--profile v41|v4]
int cmd_make_tokenizer(int argc, char** argv) {
  cli::Args args(argc, argv, {"--base", "-o", "--profile"}, {});
  const std::string base = args.require("--base");
  const std::string out_path = args.require("-o");
  const std::string prof = args.get_or("--profile", "v41");
  if (prof != "v41" && prof != "v4") fail("--profile must be v41 or v4, not '", prof, "'");
  const std::string text =
      build_test_tokenizer(base, prof == "v41" ? TestTokenizerProfile::kV41 : TestTokenizerProfile::kV4);
  const std::string tmp = out_path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail("cannot write ", tmp, ": ", std::strerror(errno));
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    f.close();
    if (!f) fail("cannot write ", tmp);
  }
  if (std::rename(tmp.c_str(), out_path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    fail("cannot write ", out_path, ": ", std::strerror(e));
  }
  std::fprintf(stderr, "wrote %s (%zu bytes, profile %s)\n", out_path.c_str(), text.size(), prof.c_str());
  return 0;
}

}  // namespace

DSX_COMMAND("tokenize", "print the token ids of a text (--tokenizer F | -m DIR) (-p TEXT | -f FILE) [--json]",
            cmd_tokenize);
DSX_COMMAND("detokenize", "print the text of token ids (--tokenizer F | -m DIR) --ids \"1 2 3\"", cmd_detokenize);
DSX_COMMAND("make-tokenizer", "build the V4.1 test tokenizer.json from DeepSeek V3's (--base F -o OUT [--profile v4])",
            cmd_make_tokenizer);

}  // namespace dsx::text
