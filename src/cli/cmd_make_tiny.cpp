// `dsx make-tiny`: writes a random V4.1 model in the official format. With a
// tokenizer (the V4.1 test tokenizer built from the DeepSeek V3 base, or a given
// tokenizer.json) the vocabulary covers it and the Engram layers use its
// compressed token map, so the model takes text.
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "cli/registry.h"
#include "model/make_tiny.h"
#include "text/engram_cmap.h"
#include "text/test_tokenizer_builder.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/switches.h"

namespace dsx::cli {

namespace {

// Where scripts/fetch-tokenizer.sh puts the DeepSeek V3 base tokenizer.
std::string default_tokenizer_base() {
  if (std::string e = sw::get_str(sw::Id::TOKENIZER_BASE); !e.empty()) return e;
  std::string cache;
  if (const char* x = std::getenv("XDG_CACHE_HOME")) cache = std::string(x) + "/dsx";
  else if (const char* h = std::getenv("HOME")) cache = std::string(h) + "/.cache/dsx";
  return cache.empty() ? "" : cache + "/tokenizer-v3-base.json";
}

int cmd_make_tiny(int argc, char** argv) {
  Args a(argc, argv, {"-o", "--seed", "--preset", "--tokenizer", "--tokenizer-base"}, {"--no-tokenizer"});
  const std::string out = a.require("-o");
  TinySpec spec = TinySpec::preset(a.get_or("--preset", "tiny"));
  spec.seed = static_cast<uint64_t>(a.get_int("--seed", 1));
  std::string tok_path;
  if (!a.has("--no-tokenizer")) {
    std::filesystem::create_directories(out);
    if (a.has("--tokenizer")) {
      tok_path = a.require("--tokenizer");
    } else {
      const std::string base = a.get_or("--tokenizer-base", default_tokenizer_base());
      if (base.empty() || !file_exists(base))
        fail("no tokenizer: the DeepSeek V3 base tokenizer was not found at '", base,
             "' (run scripts/fetch-tokenizer.sh, or pass --tokenizer FILE / --tokenizer-base FILE, or --no-tokenizer)");
      const std::string json = text::build_v41_test_tokenizer(base);
      tok_path = out + "/tokenizer.json";
      write_file_atomic(tok_path, json.data(), json.size());
    }
    text::Tokenizer tok = text::Tokenizer::from_file(tok_path);
    int32_t n_keys = 0;
    text::build_engram_token_map(tok, &n_keys);
    spec.vocab = static_cast<int64_t>(tok.size());
    spec.engram_compressed_vocab = n_keys;
  } else {
    spec.engram_layers.clear();
  }
  const std::string tok_copy = (tok_path.empty() || tok_path == out + "/tokenizer.json") ? "" : tok_path;
  write_tiny_model(out, spec, tok_copy);
  std::printf("wrote %s (vocab %lld, hidden %d, %d layers%s)\n", out.c_str(), static_cast<long long>(spec.vocab),
              spec.hidden, spec.layers, tok_path.empty() ? ", no tokenizer" : ", with tokenizer.json");
  return 0;
}

}  // namespace

DSX_COMMAND("make-tiny", "write a random tiny V4.1 model in the official format", cmd_make_tiny);

}  // namespace dsx::cli
