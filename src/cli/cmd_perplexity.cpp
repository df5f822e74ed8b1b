// dsx perplexity: how well a model predicts a text file (tokens, mean negative
// log-likelihood, perplexity, bits per byte); dsx engram-cmap: the Engram compressed
// token map of a tokenizer, written as the golden's engram-cmap safetensors (for the
// training code, which must hash n-grams exactly as the engine does).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "runtime/engine.h"
#include "text/engram_cmap.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/safetensors.h"
#include "util/threadpool.h"

namespace dsx::cli {

namespace {

void perplexity_usage() {
  std::printf(
      "usage: dsx perplexity -m DIR -f FILE [options]\n"
      "\n"
      "Scores a text file with the model. The text is tokenized as plain text (special\n"
      "token strings in it are ordinary text), cut into consecutive windows of ctx - 1\n"
      "tokens, and each window is fed after the model's BOS token in a fresh context, so\n"
      "every token of the file is predicted exactly once (the first of a window from BOS\n"
      "alone). Prints, one per line (a stable form):\n"
      "  tokens N            tokens scored\n"
      "  bytes N             bytes of the file\n"
      "  nll X               mean negative log-likelihood per token (nats)\n"
      "  perplexity X        exp(nll)\n"
      "  bits_per_byte X     total negative log-likelihood in bits / bytes\n"
      "\n"
      "options:\n"
      "  -m DIR              model directory\n"
      "  -f FILE             text file (UTF-8 or any bytes; - reads standard input)\n"
      "  --ctx N             tokens per window including BOS (default 2048; at least 2)\n"
      "  --max-tokens N      score only the first N tokens of the file (default: all)\n"
      "  --backend cpu|cuda  (default cpu)\n"
      "  --precision fp32|bf16  CUDA precision (default fp32)\n"
      "  --threads N         CPU threads\n"
      "  --quiet             no progress on stderr\n"
      "  -h, --help          this text\n");
}

// The text: a file (util's reader) or standard input.
std::string read_input(const std::string& path) {
  if (path != "-") return read_text_file(path);
  std::ostringstream ss;
  ss << std::cin.rdbuf();
  if (std::cin.bad()) fail("cannot read standard input");
  return std::move(ss).str();
}

// -log softmax(row)[target], in double.
double token_nll(const float* row, int64_t V, int32_t target) {
  double mx = -INFINITY;
  for (int64_t i = 0; i < V; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  if (!std::isfinite(mx)) fail("the model produced a row of logits without a finite maximum");
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
  return std::log(sum) + mx - static_cast<double>(row[target]);
}

int cmd_perplexity(int argc, char** argv) {
  Args a(argc, argv, {"-m", "-f", "--ctx", "--max-tokens", "--backend", "--precision", "--threads"},
         {"--quiet", "-h", "--help"});
  if (a.has("-h") || a.has("--help")) {
    perplexity_usage();
    return 0;
  }
  if (!a.positional().empty()) fail("unexpected argument '", a.positional()[0], "'");
  const std::string dir = a.require("-m");
  const long long ctx = a.get_int("--ctx", 2048);
  if (ctx < 2) fail("--ctx ", ctx, " must be at least 2 (BOS and one token)");
  const long long max_tokens = a.get_int("--max-tokens", -1);
  const bool quiet = a.has("--quiet");
  const std::string text = read_input(a.require("-f"));
  if (text.empty()) fail("the text file is empty");

  EngineOptions eo;
  eo.backend = a.get_or("--backend", "cpu");
  eo.precision = a.get_or("--precision", "fp32");
  eo.max_context = ctx;
  eo.checkpoint_every = 0;
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  const text::Tokenizer tok = text::Tokenizer::from_model_dir(dir);
  std::vector<int32_t> ids = tok.encode(text, /*allow_added=*/false);
  if (max_tokens >= 0 && static_cast<long long>(ids.size()) > max_tokens) ids.resize(static_cast<size_t>(max_tokens));
  if (ids.empty()) fail("no tokens to score");
  auto eng = load_engine(dir, eo);
  const int64_t V = eng->config().vocab_size;
  const int32_t bos = eng->config().bos_id;
  for (int32_t t : ids)
    if (t < 0 || t >= V) fail("the tokenizer produced id ", t, " beyond the model's vocabulary (", V, ")");

  const int64_t n = static_cast<int64_t>(ids.size()), win = ctx - 1;
  constexpr int64_t kPiece = 256;  // rows per feed: bounds the logits buffer
  std::vector<float> logits(static_cast<size_t>((kPiece + 1) * V));
  std::vector<int32_t> rows;
  double total = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Session> s;
  for (int64_t w0 = 0; w0 < n; w0 += win) {
    const int64_t w1 = std::min(n, w0 + win);
    s.reset();
    s = eng->new_session();  // a fresh context
    // the rows fed: BOS, ids[w0 .. w1 - 1); row r predicts ids[w0 + r]
    rows.assign(1, bos);
    rows.insert(rows.end(), ids.begin() + w0, ids.begin() + w1 - 1);
    const int64_t R = static_cast<int64_t>(rows.size());
    for (int64_t r0 = 0; r0 < R; r0 += kPiece) {
      const int64_t m = std::min(kPiece, R - r0);
      s->feed(rows.data() + r0, m, logits.data(), true);
      for (int64_t r = 0; r < m; ++r) total += token_nll(logits.data() + r * V, V, ids[static_cast<size_t>(w0 + r0 + r)]);
    }
    if (!quiet) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "\rperplexity: %lld / %lld tokens (%.0f tok/s)", static_cast<long long>(w1),
                   static_cast<long long>(n), static_cast<double>(w1) / std::max(el, 1e-9));
      std::fflush(stderr);
    }
  }
  if (!quiet) std::fprintf(stderr, "\n");
  // bytes: of the scored tokens (the whole file unless --max-tokens cut it)
  size_t bytes = text.size();
  if (max_tokens >= 0) bytes = tok.decode(ids).size();
  const double nll = total / static_cast<double>(n);
  std::printf("tokens %lld\nbytes %zu\nnll %.6f\nperplexity %.6f\nbits_per_byte %.6f\n", static_cast<long long>(n),
              bytes, nll, std::exp(nll), total / std::log(2.0) / static_cast<double>(bytes));
  return 0;
}

int cmd_engram_cmap(int argc, char** argv) {
  Args a(argc, argv, {"--tokenizer", "-m", "-o"}, {"-h", "--help"});
  if (a.has("-h") || a.has("--help")) {
    std::printf(
        "usage: dsx engram-cmap (--tokenizer FILE | -m DIR) -o OUT.safetensors\n"
        "\n"
        "Writes the Engram compressed token map of a tokenizer (model-v41.md §3.2.1) as the\n"
        "engine derives it: tensors cmap (I32 [tokenizer size], raw id -> compressed id)\n"
        "and n_keys (I32 [1]), metadata len_tokenizer, n_keys, tokenizer_sha256.\n"
        "\n"
        "options:\n"
        "  --tokenizer FILE    tokenizer.json\n"
        "  -m DIR              model directory (its tokenizer.json)\n"
        "  -o FILE             output safetensors file\n"
        "  -h, --help          this text\n");
    return 0;
  }
  if (!a.positional().empty()) fail("unexpected argument '", a.positional()[0], "'");
  const auto file = a.get("--tokenizer");
  const auto dir = a.get("-m");
  if (file.has_value() == dir.has_value()) fail("give exactly one of --tokenizer FILE or -m MODEL_DIR");
  const std::string path = file ? *file : *dir + "/tokenizer.json";
  const text::Tokenizer tok = text::Tokenizer::from_file(path);
  int32_t n_keys = 0;
  const std::vector<int32_t> cmap = text::build_engram_token_map(tok, &n_keys);
  SafetensorsWriter w;
  w.add("cmap", DType::I32, {static_cast<int64_t>(cmap.size())}, cmap);
  w.add("n_keys", DType::I32, {1}, std::vector<int32_t>{n_keys});
  w.set_metadata("len_tokenizer", std::to_string(cmap.size()));
  w.set_metadata("n_keys", std::to_string(n_keys));
  w.set_metadata("tokenizer_sha256", text::sha256_file_hex(path));
  w.write(a.require("-o"));
  return 0;
}

}  // namespace

DSX_COMMAND("perplexity", "score a text file: tokens, mean NLL, perplexity, bits per byte", cmd_perplexity);
DSX_COMMAND("engram-cmap", "write a tokenizer's Engram compressed token map (safetensors)", cmd_engram_cmap);

}  // namespace dsx::cli
