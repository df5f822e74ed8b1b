// `dsx run`: the main job — chat with a model directory from the command line.
// Renders the prompt as a V4.1 conversation (one user turn), tokenizes it (client
// text can never inject special tokens), generates (runtime/generate.h) and streams
// the reply to stdout as it is produced.
#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "cli/manifest.h"
#include "cli/dspark_option.h"
#include "cli/gpus_option.h"
#include "cli/registry.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "text/chat.h"
#include "text/token_text.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/threadpool.h"

namespace dsx::cli {

namespace {

const std::vector<std::string> kValueOpts = {"-m",       "-p",        "-f",      "-n",     "--system",
                                             "--thinking", "--temperature", "--top-p", "--top-k", "--seed",
                                             "--backend", "--precision", "--threads", "--stop", "--manifest",
                                             "--gpus"};
const std::vector<std::string> kFlagOpts = {"--raw", "--show-prompt", "--stats", "-h", "--help"};

void usage() {
  std::printf(
      "usage: dsx run -m DIR (-p PROMPT | -f FILE) [options]\n"
      "\n"
      "Chat with a model: renders the prompt as one user turn of a V4.1 conversation,\n"
      "generates the reply and streams it to stdout as it is produced. Generation ends at\n"
      "the end-of-sentence token, a stop string or after -n tokens.\n"
      "\n"
      "options:\n"
      "  -m DIR              model directory (config.json, weights, tokenizer.json)\n"
      "  -p PROMPT           the user's message\n"
      "  -f FILE             the user's message from a file\n"
      "  -n N                tokens to generate at most (default 64)\n"
      "  --system TEXT       a system message before the user's\n"
      "  --thinking off|on   thinking mode of the rendered prompt (default off)\n"
      "  --raw               tokenize the prompt as it is (no chat template)\n"
      "  --show-prompt       print the rendered prompt to stderr\n"
      "  --stop STRING       stop when the reply contains STRING (not printed); repeatable\n"
      "                      (a newline: --stop $'\\n' in bash)\n"
      "  --temperature T     sampling temperature (default 0: greedy)\n"
      "  --top-p P           nucleus sampling (default 1: off)\n"
      "  --top-k K           top-k sampling (default 0: off)\n"
      "  --seed S            sampling seed (default 0)\n"
      "  --backend cpu|cuda  (default cpu)\n"
      "  --precision fp32|bf16  CUDA precision (default fp32)\n"
      "  --threads N         CPU threads\n"
      "%s"
      "%s"
      "  --stats             print token counts, timings and the finish reason to stderr\n"
      "                      (and DSpark's accepted drafts per cycle)\n"
      "  --manifest FILE     write a reproducibility manifest (dsx manifest verify FILE)\n"
      "  -h, --help          this text\n",
      kGpusHelp, kDSparkHelp);
}

// Args keeps one value per option: the repeatable --stop values are taken out of argv
// first (skipping the values of the other options, as Args reads them).
std::vector<std::string> take_stops(int argc, char** argv, std::vector<char*>& rest) {
  std::vector<std::string> stops;
  rest.assign(argv, argv + (argc > 0 ? 1 : 0));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--stop") {
      if (i + 1 >= argc) fail("option --stop needs a value");
      stops.push_back(argv[++i]);
    } else if (a.rfind("--stop=", 0) == 0) {
      stops.push_back(a.substr(7));
    } else {
      rest.push_back(argv[i]);
      const bool takes_value = std::find(kValueOpts.begin(), kValueOpts.end(), a) != kValueOpts.end();
      if (takes_value && i + 1 < argc) rest.push_back(argv[++i]);
    }
  }
  return stops;
}

int cmd_run(int argc, char** argv) {
  std::vector<char*> rest;
  std::vector<char*> args;
  const DSparkChoice dspark = take_dspark(argc, argv, kValueOpts, args);
  const std::vector<std::string> stops = take_stops(static_cast<int>(args.size()), args.data(), rest);
  Args a(static_cast<int>(rest.size()), rest.data(), kValueOpts, kFlagOpts);
  if (a.has("-h") || a.has("--help")) {
    usage();
    return 0;
  }
  if (!a.positional().empty()) fail("unexpected argument '", a.positional()[0], "'");
  const std::string dir = a.require("-m");
  std::string prompt = a.has("-f") ? read_text_file(a.require("-f")) : a.require("-p");
  if (!text::valid_utf8(prompt)) fail("the prompt is not valid UTF-8");
  const int64_t n = a.get_int("-n", 64);
  if (n < 0) fail("-n must be >= 0");
  for (const std::string& s : stops)
    if (s.empty()) fail("--stop: the stop string is empty");
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
  apply_gpus_option(a, o);
  text::Tokenizer tok = text::Tokenizer::from_model_dir(dir);

  std::vector<int32_t> ids;
  if (a.has("--raw")) {
    ids = tok.encode(prompt, false);
  } else {
    text::Conversation conv;
    if (a.has("--system")) {
      text::Message sys;
      sys.role = text::Role::System;
      sys.content = a.require("--system");
      conv.messages.push_back(sys);
    }
    text::Message user;
    user.role = text::Role::User;
    user.content = prompt;
    conv.messages.push_back(user);
    text::RenderOptions ro;
    ro.profile = text::Profile::V41;
    const std::string th = a.get_or("--thinking", "off");
    if (th != "off" && th != "on") fail("--thinking must be off or on");
    ro.thinking = th == "on";
    auto rendered = text::render_prompt(conv, ro);
    if (a.has("--show-prompt")) std::fprintf(stderr, "%s\n", rendered.text.c_str());
    ids = text::encode_segments(tok, rendered.segments);
  }
  if (ids.empty()) fail("empty prompt");

  GenerateOptions go;
  go.sampling.temperature = static_cast<float>(a.get_double("--temperature", 0.0));
  go.sampling.top_p = static_cast<float>(a.get_double("--top-p", 1.0));
  go.sampling.top_k = static_cast<int>(a.get_int("--top-k", 0));
  go.sampling.seed = static_cast<uint64_t>(a.get_int("--seed", 0));
  go.max_tokens = n;
  go.stop_strings = stops;
  auto eng = load_engine(dir, o);
  print_placement_at_load(*eng, o);
  const ModelConfig& cfg = eng->config();
  for (int32_t id : ids)
    if (id >= cfg.vocab_size) fail("the tokenizer produced id ", id, " beyond the model's vocabulary (", cfg.vocab_size, ")");
  const DSparkSetup ds = setup_dspark(dspark, dir, *eng);  // (before the session: it may measure on a scratch one)
  auto s = eng->new_session();
  text::StreamTokenText detok(tok);
  PlainDecoding plain;
  DecodingStrategy& strategy = ds.strategy ? static_cast<DecodingStrategy&>(*ds.strategy) : plain;
  const GenerateResult r = generate(*s, ids, go, strategy, &detok, [](std::string_view piece, const std::vector<int32_t>&) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::printf("\n");
  std::fflush(stdout);
  if (a.has("--manifest"))
    write_manifest(a.require("--manifest"), {.command = "run", .model_dir = dir, .engine = eng.get(), .options = go,
                                             .prompt_ids = ids, .result = r, .dspark = ds.name, .prompt_text = prompt,
                                             .system = a.get("--system"), .thinking = a.get_or("--thinking", "off") == "on",
                                             .raw = a.has("--raw")});
  if (a.has("--stats")) {
    const double tps = r.decode_seconds > 0 && r.generated_tokens > 1
                           ? static_cast<double>(r.generated_tokens - 1) / r.decode_seconds
                           : 0.0;
    std::fprintf(stderr,
                 "prompt %lld tokens (%lld reused), first token after %.3f s; %lld tokens generated, "
                 "%.3f s decode (%.1f tok/s); finish: %s\n",
                 static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.reused_tokens), r.prefill_seconds,
                 static_cast<long long>(r.generated_tokens), r.decode_seconds, tps, finish_reason_name(r.finish));
    if (ds.strategy) std::fprintf(stderr, "%s\nDSpark costs %s\n", ds.strategy->stats().summary().c_str(), ds.costs.c_str());
  }
  return 0;
}

}  // namespace

DSX_COMMAND("run", "chat with a model: render a user prompt, generate and stream the reply", cmd_run);

}  // namespace dsx::cli
