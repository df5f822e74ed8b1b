// dsx render: render an OpenAI-style conversation into the model's prompt (spec §2) and print it, or its
// token ids.
//
//   dsx render [--tokenizer FILE | -m DIR] --messages FILE [--tools FILE] [--thinking off|on|max]
//              [--profile v4|v4-0731|v41] [--effort E] [--ctx N] [--tool-choice auto|none]
//              [--developer-as-system] [--keep-thinking] [--continue-final] [--ids] [--segments]
//
// Output: the prompt text exactly as rendered, with nothing appended (the prompt normally ends with
// "<think>" or "</think>"; no newline is added, so `dsx render … > f` gives the exact prompt bytes).
// --ids prints the token ids, space separated, on one line terminated by "\n" (needs a tokenizer).
// --segments prints one JSON object per line {"trusted": bool, "text": "…"} (debugging the trust split).
//
// --messages: an OpenAI-style messages array, or an object {"messages": […], "tools": […], "tool_choice",
// "thinking_mode": "thinking"|"chat", "thinking": bool|{type}, "reasoning_effort"}; command-line options
// override the object's settings. --thinking: off = chat mode; on = thinking with the default effort (high)
// unless --effort/reasoning_effort says otherwise; max = thinking with effort max. --effort takes the API
// names of spec §4.5 (none, minimal, low, medium, high, xhigh, max, ultra, or 1-100 for v41).
// --ctx: the session context size; Think-Max needs >= 393216 (spec §2.5), without --ctx no downgrade.
// Profile: --profile, else detected from -m DIR (config.json / encoding/*.py, spec §2.1), else v41.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli/registry.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace {

using namespace dsx;
using namespace dsx::text;

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(what, ": cannot open '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) fail(what, ": error reading '", path, "'");
  return ss.str();
}

bool file_contains(const std::filesystem::path& p, std::string_view needle) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str().find(needle) != std::string::npos;
}

// Spec §2.1: model metadata, then the checkpoint's encoder file.
std::optional<Profile> detect_profile(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d(dir);
  std::optional<Profile> from_config;
  const fs::path cfg = d / "config.json";
  if (fs::exists(cfg)) {
    try {
      pyjson::Value c = pyjson::parse(read_file(cfg.string(), "config.json"));
      std::string mt;
      if (const auto* v = c.get("model_type"); v && v->is_string()) mt = v->text;
      std::string arch;
      if (const auto* a = c.get("architectures"); a && a->is_array())
        for (const auto& x : a->items)
          if (x.is_string()) arch += x.text + " ";
      if (mt == "deepseek_v41" || arch.find("DeepseekV41") != std::string::npos) from_config = Profile::V41;
      else if (mt == "deepseek_v4" || arch.find("DeepseekV4") != std::string::npos) from_config = Profile::V4;
    } catch (const Error&) {
    }
  }
  if (from_config == Profile::V41) return from_config;
  const fs::path enc41 = d / "encoding" / "encoding.py";
  if (!from_config && fs::exists(enc41) &&
      (file_contains(enc41, "REASONING_EFFORT_TEMPLATE") || file_contains(enc41, "<｜System｜>")))
    return Profile::V41;
  const fs::path enc4 = d / "encoding" / "encoding_dsv4.py";
  if (fs::exists(enc4)) {
    if (file_contains(enc4, "REASONING_EFFORT_PROMPTS")) return Profile::V4_0731;
    if (file_contains(enc4, "REASONING_EFFORT_MAX")) return Profile::V4;
  }
  return from_config;
}

int cmd_render(int argc, char** argv) {
  cli::Args args(argc, argv,
                 {"--tokenizer", "-m", "--messages", "--tools", "--thinking", "--profile", "--effort", "--ctx",
                  "--tool-choice"},
                 {"--ids", "--segments", "--developer-as-system", "--keep-thinking", "--continue-final", "-h",
                  "--help"});
  if (args.has("-h") || args.has("--help")) {
    std::fprintf(stdout,
                 "usage: dsx render [--tokenizer FILE | -m DIR] --messages FILE [--tools FILE]\n"
                 "                  [--thinking off|on|max] [--profile v4|v4-0731|v41] [--effort E] [--ctx N]\n"
                 "                  [--tool-choice auto|none] [--developer-as-system] [--keep-thinking]\n"
                 "                  [--continue-final] [--ids | --segments]\n");
    return 0;
  }
  if (!args.positional().empty()) fail("unexpected argument '", args.positional()[0], "'");
  if (args.has("--tokenizer") && args.has("-m")) fail("give either --tokenizer or -m, not both");

  JsonOptions jopts;
  jopts.developer_as_system = args.has("--developer-as-system");
  Conversation conv = parse_conversation(read_file(args.require("--messages"), "--messages"), jopts);
  if (auto tools_path = args.get("--tools")) {
    pyjson::Value tv = pyjson::parse(read_file(*tools_path, "--tools"));
    if (tv.is_object() && tv.get("tools")) tv = *tv.get("tools");
    conv.tools = tools_from_value(tv);
  }

  RenderOptions ro;
  if (auto p = args.get("--profile")) ro.profile = parse_profile(*p);
  else if (auto m = args.get("-m")) ro.profile = detect_profile(*m).value_or(Profile::V41);
  ro.thinking = conv.thinking.value_or(true);
  if (conv.effort) ro.effort = *conv.effort;
  if (auto t = args.get("--thinking")) {
    if (*t == "off") {
      ro.thinking = false;
    } else if (*t == "on") {
      ro.thinking = true;
    } else if (*t == "max") {
      ro.thinking = true;
      ro.effort.kind = Effort::Kind::Max;
    } else {
      fail("--thinking: expected off, on or max (got '", *t, "')");
    }
  }
  if (auto e = args.get("--effort")) {
    ThinkingRequest tr = map_api_effort(*e);
    if (!tr.thinking) ro.thinking = false;
    else ro.effort = tr.effort;
  }
  if (args.has("--ctx")) {
    const long long ctx = args.get_int("--ctx", 0);
    if (ctx <= 0) fail("--ctx: expected a positive integer");
    ro.context_tokens = ctx;
  }
  ro.tools_enabled = conv.tools_enabled.value_or(true);
  if (auto tc = args.get("--tool-choice")) {
    if (*tc == "none") ro.tools_enabled = false;
    else if (*tc == "auto" || *tc == "required") ro.tools_enabled = true;
    else fail("--tool-choice: expected auto or none");
  }
  ro.drop_thinking = !args.has("--keep-thinking");
  ro.continue_final_message = args.has("--continue-final");

  const RenderedPrompt prompt = render_prompt(conv, ro);

  if (args.has("--segments")) {
    for (const auto& s : prompt.segments) {
      std::string line = "{\"trusted\": ";
      line += s.trusted ? "true" : "false";
      line += ", \"text\": " + pyjson::quoted(s.text) + "}\n";
      std::fwrite(line.data(), 1, line.size(), stdout);
    }
    return 0;
  }
  if (args.has("--ids")) {
    std::optional<Tokenizer> tok;
    if (auto t = args.get("--tokenizer")) tok.emplace(Tokenizer::from_file(*t));
    else if (auto m = args.get("-m")) tok.emplace(Tokenizer::from_model_dir(*m));
    else fail("--ids needs a tokenizer (--tokenizer FILE or -m DIR)");
    const std::vector<int32_t> ids = encode_segments(*tok, prompt.segments);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
    return 0;
  }
  std::fwrite(prompt.text.data(), 1, prompt.text.size(), stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace

DSX_COMMAND("render", "render a chat conversation into the model prompt (text or token ids)", cmd_render);
