// `dsx serve`: the OpenAI- and Anthropic-compatible server coding agents point at
// (docs and ready configs for Claude Code, Codex and opencode: README "Serving").
#include <csignal>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cache/disk_cache.h"
#include "cli/dspark_option.h"
#include "cli/gpus_option.h"
#include "cli/registry.h"
#include "model/cost_model.h"
#include "runtime/engine.h"
#include "server/http.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/threadpool.h"
#ifdef DSX_HAVE_CUDA
#include "runtime/cuda_engine.h"
#endif

namespace dsx::cli {

namespace {

// The GPU's one-time costs (graph capture of the one-row step, the prefill kernels'
// first launches, library handles) paid before the first request, not by it: a restarted
// server's first answer from a restored session would otherwise wait ~0.3 s for them.
// A throwaway session prefills a chunk and decodes two tokens; the engine keeps what
// they built. Nothing to do on the CPU.
void warm_up(Engine& e) {
  if (e.backend_name() == "cpu") return;
  auto s = e.new_session();
  const int64_t V = e.config().vocab_size;
  std::vector<int32_t> ids(64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % static_cast<size_t>(V));
  std::vector<float> logits(static_cast<size_t>(V));
  s->feed(ids.data(), static_cast<int64_t>(ids.size()), logits.data(), false);
  for (int i = 0; i < 2; ++i) s->feed(ids.data() + i, 1, logits.data(), false);
}

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) { g_stop.store(true); }

void usage() {
  std::printf(
      "usage: dsx serve -m MODEL_DIR [options]\n"
      "       dsx serve --synthetic v41-flash --tokenizer FILE [--layers N] [options]\n"
      "Serves the model over HTTP: OpenAI /v1/chat/completions and /v1/responses, Anthropic /v1/messages\n"
      "(configs for Claude Code, Codex and opencode: README \"Serving\"), /health, /metrics.\n"
      "  -m DIR                 the model directory\n"
      "  --synthetic v41-flash  (CUDA) no model directory: release-shaped layers with random weights in the\n"
      "                         official formats, for measuring the server on the GPU (its text is noise)\n"
      "  --layers N             layers of the synthetic model (8)\n"
      "  --tokenizer FILE       the synthetic model's tokenizer.json (the V4.1 tokenizer: 129280 ids)\n"
      "  --host ADDR            listen address (127.0.0.1)\n"
      "  --port N               port (8080; 0: any free one)\n"
      "  --api-key KEY          require this key (x-api-key or Authorization: Bearer)\n"
      "  --ctx N                context tokens per session (65536)\n"
      "  --sessions N           resident sessions, requests running at once (4)\n"
      "  --backend cpu|cuda     (cpu)\n"
      "  --precision fp32|bf16  (fp32)\n"
      "  --threads N            CPU threads\n"
      "%s"
      "  --model-id ID          the id /v1/models reports (deepseek-v4.1-flash)\n"
      "  --effort E             default reasoning effort\n"
      "  --thinking auto|on|off whether requests think (auto: as each request asks)\n"
      "  --max-output N         at most N generated tokens per request\n"
      "  --max-body BYTES       largest request body (8 MiB)\n"
      "  --keepalive SECONDS    keep-alive interval while a prompt waits or prefills (5)\n"
      "  --kv-cache DIR         the on-disk KV cache: sessions survive restarts and eviction from memory\n"
      "                         (default $XDG_CACHE_HOME/dsx/kv, else ~/.cache/dsx/kv; docs/kv-cache.md)\n"
      "  --kv-cache-size BYTES  its byte budget, e.g. 8G, 512M (8G); least recently used entries go first\n"
      "  --no-kv-cache          no disk cache\n"
      "  --no-lazy-tool-grammar with tool_choice auto, decode tool calls freely (by default, once the model\n"
      "                         opens a DSML tool-call block, the calls are constrained to the request's\n"
      "                         tools and their parameter schemas)\n"
      "  --quiet                no request log lines\n"
      "  -h, --help             this text\n"
      "%s"
      "                      (in the server: every decoding request drafts, and its block is verified in\n"
      "                      the step shared with the others; requests under a constraint decode plain)\n",
      kGpusHelp, kDSparkHelp);
}

// $XDG_CACHE_HOME/dsx/kv, else $HOME/.cache/dsx/kv; empty when neither is set.
std::string default_kv_dir() {
  const char* x = std::getenv("XDG_CACHE_HOME");
  if (x && *x == '/') return std::string(x) + "/dsx/kv";
  const char* h = std::getenv("HOME");
  if (h && *h) return std::string(h) + "/.cache/dsx/kv";
  return "";
}

int cmd_serve(int argc, char** argv) {
  const std::vector<std::string> value_opts = {
      "-m",          "--host",       "--port",      "--api-key",  "--ctx",       "--sessions",  "--backend",
      "--precision", "--threads",    "--model-id",  "--effort",   "--max-body",  "--keepalive", "--thinking",
      "--max-output", "--kv-cache",  "--kv-cache-size", "--synthetic", "--layers", "--tokenizer", "--gpus"};
  std::vector<char*> rest;
  const DSparkChoice dspark = take_dspark(argc, argv, value_opts, rest);
  Args a(static_cast<int>(rest.size()), rest.data(), value_opts,
         {"--quiet", "--no-kv-cache", "--no-lazy-tool-grammar", "-h", "--help"});
  if (a.has("-h") || a.has("--help")) {
    usage();
    return 0;
  }
  const bool synthetic = a.has("--synthetic");
  if (synthetic && a.has("-m")) fail("--synthetic and -m exclude each other");
  if (!synthetic && (a.has("--layers") || a.has("--tokenizer"))) fail("--layers / --tokenizer go with --synthetic");
  const std::string dir = synthetic ? std::string() : a.require("-m");
  if (a.has("--no-kv-cache") && (a.has("--kv-cache") || a.has("--kv-cache-size")))
    fail("--no-kv-cache contradicts --kv-cache / --kv-cache-size");
  const int64_t kv_budget = parse_byte_size(a.get_or("--kv-cache-size", "8G"));
  server::ServeOptions so;
  so.host = a.get_or("--host", "127.0.0.1");
  so.port = static_cast<int>(a.get_int("--port", 8080));
  so.api_key = a.get_or("--api-key", "");
  so.model_id = a.get_or("--model-id", "deepseek-v4.1-flash");
  so.max_body_bytes = static_cast<size_t>(a.get_int("--max-body", 8 << 20));
  if (a.has("--effort")) so.default_effort = text::parse_effort(a.require("--effort"));
  so.thinking = a.get_or("--thinking", "auto");
  if (so.thinking != "auto" && so.thinking != "on" && so.thinking != "off") fail("--thinking must be auto, on or off");
  so.max_output = a.get_int("--max-output", 0);
  so.lazy_tool_grammar = !a.has("--no-lazy-tool-grammar");
  so.scheduler.max_sessions = static_cast<int>(a.get_int("--sessions", 4));
  so.scheduler.keepalive_seconds = a.get_double("--keepalive", 5.0);
  so.scheduler.log_requests = !a.has("--quiet");
  if (so.port < 0 || so.port > 65535) fail("--port must be in 0 .. 65535");
  if (so.scheduler.max_sessions < 1) fail("--sessions must be at least 1");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  o.max_context = a.get_int("--ctx", 65536);
  if (o.max_context < 256) fail("--ctx must be at least 256 tokens");
  if (synthetic) o.backend = "cuda";
  apply_gpus_option(a, o);
  std::fprintf(stderr, "dsx serve: loading %s (%s)\n", synthetic ? "a synthetic model" : dir.c_str(),
               o.backend.c_str());
  o.progress = [](double f) {
    const int w = 40, k = static_cast<int>(f * w + 0.5);
    std::fprintf(stderr, "\r[%s%s] %3d%%", std::string(static_cast<size_t>(k), '#').c_str(),
                 std::string(static_cast<size_t>(w - k), ' ').c_str(), static_cast<int>(f * 100 + 0.5));
    if (f >= 1.0) std::fprintf(stderr, "\n");
  };
  const auto t0 = std::chrono::steady_clock::now();
  text::Tokenizer tok = synthetic ? text::Tokenizer::from_file(a.require("--tokenizer"))
                                  : text::Tokenizer::from_model_dir(dir);
  std::unique_ptr<Engine> eng;
  if (synthetic) {
    if (a.require("--synthetic") != "v41-flash") fail("--synthetic: only v41-flash is known");
    const int layers = static_cast<int>(a.get_int("--layers", 8));
    if (layers < 1) fail("--layers must be at least 1");
#ifdef DSX_HAVE_CUDA
    const ModelConfig cfg = synthetic_v41_flash_config(layers);
    if (static_cast<int64_t>(tok.size()) != cfg.vocab_size)
      fail("--tokenizer: ", tok.size(), " ids, the synthetic model has ", cfg.vocab_size, " (the V4.1 tokenizer)");
    eng = make_synthetic_cuda_engine(cfg, o, 1);
#else
    fail("--synthetic needs the CUDA backend (this build has none)");
#endif
  } else {
    eng = load_engine(dir, o);
  }
  print_placement_at_load(*eng, o);
  warm_up(*eng);
  // DSpark: the rule of dsx run (cli/dspark_option.h: on by default when the model has
  // stages); a synthetic model has none
  DSparkSetup ds;
  if (synthetic) {
    if (dspark.mode != DSparkChoice::Mode::Default && dspark.mode != DSparkChoice::Mode::Off)
      std::fprintf(stderr, "dsx serve: a synthetic model has no DSpark stages: plain decoding\n");
  } else {
    ds = setup_dspark(dspark, dir, *eng);
  }
  if (ds.strategy) {
    so.scheduler.drafter = ds.drafter.get();
    so.scheduler.dspark = ds.strategy->options();
    std::fprintf(stderr, "dsx serve: DSpark %s (%d draft stages on %s, block %d); costs %s\n", ds.name.c_str(),
                 ds.drafter->n_stages(), ds.drafter->backend_name().c_str(), ds.drafter->block_size(),
                 ds.costs.c_str());
  } else {
    std::fprintf(stderr, "dsx serve: plain decoding (DSpark off)\n");
  }
  std::fprintf(stderr, "dsx serve: %s loaded in %.1f s; %d sessions of %lld tokens\n", eng->describe().c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               so.scheduler.max_sessions, (long long)o.max_context);
  // the disk KV cache (before the server: it outlives the scheduler, which saves the
  // resident sessions into it when it stops)
  std::unique_ptr<DiskCache> cache;
  if (!a.has("--no-kv-cache")) {
    const bool chosen = a.has("--kv-cache");
    const std::string kv_dir = chosen ? a.require("--kv-cache") : default_kv_dir();
    if (kv_dir.empty()) {
      std::fprintf(stderr, "dsx serve: no disk KV cache (neither XDG_CACHE_HOME nor HOME is set; --kv-cache DIR)\n");
    } else {
      try {
        cache = DiskCache::open(kv_dir, kv_budget, eng->state_identity());
        so.scheduler.secret = server::persistent_secret(kv_dir);
        const DiskCacheStats st = cache->stats();
        std::fprintf(stderr, "dsx serve: kv cache %s: %lld entries, %.1f MB of a %.1f GB budget%s\n",
                     kv_dir.c_str(), (long long)st.entries, st.bytes / 1e6, kv_budget / 1e9,
                     st.refused ? cat("; ", st.refused, " files refused (above)").c_str() : "");
      } catch (const Error& e) {
        // an explicit directory must work; the default one may be another server's
        if (chosen) throw;
        std::fprintf(stderr, "dsx serve: no disk KV cache: %s (--kv-cache DIR or --no-kv-cache)\n", e.what());
        cache.reset();
      }
    }
  }
  so.scheduler.cache = cache.get();
  server::HttpServer srv(*eng, tok, so);
  if (!srv.bind()) fail("cannot listen on ", so.host, ":", so.port, " (in use, or not an address of this machine)");
  std::fprintf(stderr, "dsx serve: listening on http://%s:%d (OpenAI /v1/chat/completions, /v1/responses; "
                       "Anthropic /v1/messages)%s\n",
               so.host.c_str(), srv.port(), so.api_key.empty() ? "" : "; API key required");
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  std::thread watcher([&] {
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::fprintf(stderr, "dsx serve: stopping (running requests finish first)\n");
    srv.stop();
  });
  srv.listen_after_bind();
  g_stop.store(true);
  watcher.join();
  std::fprintf(stderr, "dsx serve: stopped%s\n", cache ? " (resident sessions saved to the kv cache)" : "");
  return 0;
}

}  // namespace

DSX_COMMAND("serve", "serve the model over HTTP: OpenAI chat completions / responses, Anthropic messages", cmd_serve);

}  // namespace dsx::cli
