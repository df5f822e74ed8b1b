// `dsx run`: the main job — chat with a model directory from the command line.
// Renders the prompt as a V4.1 conversation (one user turn), tokenizes it (client
// text can never inject special tokens), generates and streams the reply.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/threadpool.h"

namespace dsx::cli {

namespace {

int cmd_run(int argc, char** argv) {
  Args a(argc, argv,
         {"-m", "-p", "-f", "-n", "--system", "--thinking", "--temperature", "--top-p", "--top-k", "--seed",
          "--backend", "--precision", "--threads"},
         {"--raw", "--show-prompt"});
  const std::string dir = a.require("-m");
  std::string prompt = a.has("-f") ? read_text_file(a.require("-f")) : a.require("-p");
  if (!text::valid_utf8(prompt)) fail("the prompt is not valid UTF-8");
  const int64_t n = a.get_int("-n", 64);
  EngineOptions o;
  o.backend = a.get_or("--backend", "cpu");
  o.precision = a.get_or("--precision", "fp32");
  if (a.has("--threads")) set_num_threads(static_cast<int>(a.get_int("--threads", 0)));
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

  SamplerOptions so;
  so.temperature = static_cast<float>(a.get_double("--temperature", 0.0));
  so.top_p = static_cast<float>(a.get_double("--top-p", 1.0));
  so.top_k = static_cast<int>(a.get_int("--top-k", 0));
  so.seed = static_cast<uint64_t>(a.get_int("--seed", 0));
  Sampler sampler(so);
  auto eng = load_engine(dir, o);
  const ModelConfig& cfg = eng->config();
  for (int32_t id : ids)
    if (id >= cfg.vocab_size) fail("the tokenizer produced id ", id, " beyond the model's vocabulary (", cfg.vocab_size, ")");
  std::vector<float> logits(static_cast<size_t>(cfg.vocab_size));
  auto s = eng->new_session();
  text::StreamDecoder dec(tok);
  int32_t next = sampler.feed_and_pick(*s, ids.data(), static_cast<int64_t>(ids.size()), logits);
  for (int64_t i = 0; i < n; ++i) {
    if (next == cfg.eos_id) break;
    std::string piece = dec.push(next);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (i + 1 < n) next = sampler.feed_and_pick(*s, &next, 1, logits);
  }
  std::string tail = dec.flush();
  std::fwrite(tail.data(), 1, tail.size(), stdout);
  std::printf("\n");
  return 0;
}

}  // namespace

DSX_COMMAND("run", "chat with a model: render a user prompt, generate and stream the reply", cmd_run);

}  // namespace dsx::cli
