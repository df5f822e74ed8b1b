// The on-disk KV cache inside `dsx serve` (issue 26), end to end over HTTP on the CPU
// engine and a tiny random model with the golden V4.1 tokenizer:
//   - Replay: a 42-turn coding-agent conversation in Claude Code's shape (Anthropic
//     messages, thinking with signatures, tools, forced and free tool calls fed back
//     with recorded-style tool results) grows past 20k tokens through three server
//     lifetimes over one cache directory (two restarts). After the first turn >= 99 %
//     of the prompt tokens come from cache (usage and /metrics); each restart costs one
//     restore, not a prefill; every answer equals a cache-less server's answer to the
//     same request (greedy: identical text, tool calls and token counts), and the first
//     answer after a restart equals a cold server's: restore(save(s)) == s at the API.
//   - Bad files: a truncated entry, another model's entry and bit-flipped entries in
//     the directory are refused with a log line naming them; the request that would
//     have restored a bit-flipped one falls back to the next entry and answers the same.
//   - An edit in an early block restores the longest stored prefix before it.
//   - Eviction: with one session, two conversations taking turns come back from disk.
//   - kill -9 of a `dsx serve` process at random moments of its saves loses no
//     committed entry and leaves no loadable partial one; SIGTERM saves the resident
//     session, which the next process restores.
#ifdef DSX_HAVE_HTTP
// Debian's libcpp-httplib.so is built with OpenSSL support, which adds members to
// httplib::Client (is_ssl_) and httplib::Request (ssl): without the same macro a Client on
// the stack is one byte smaller than the library's constructor writes.
#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT
#endif
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "cache/disk_cache.h"
#include "model/make_tiny.h"
#include "runtime/engine.h"
#include "server/http.h"
#include "server/scheduler.h"
#include "test_util.h"
#include "text/engram_cmap.h"
#include "text/tokenizer.h"

using namespace dsx;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kCtx = 24576;

// The tiny model of the server tests (golden V4.1 tokenizer, hidden 128); `moe_inter`
// other than 32 makes another model (another config.json, another identity) with the
// same session state layout.
std::string model_dir(int moe_inter = 32) {
  static std::map<int, std::string> dirs;
  auto it = dirs.find(moe_inter);
  if (it != dirs.end()) return it->second;
  const std::string g = dsx_test::golden_dir();
  if (g.empty()) return "";
  const std::string dir = dsx_test::temp_dir(cat("kv_server_model_", moe_inter));
  const std::string tj = g + "/tokenizer/tokenizer-v41.json";
  text::Tokenizer t = text::Tokenizer::from_file(tj);
  int32_t n_keys = 0;
  text::build_engram_token_map(t, &n_keys);
  TinySpec spec;
  spec.vocab = static_cast<int64_t>(t.size());
  spec.engram_compressed_vocab = n_keys;
  spec.hidden = 128;
  spec.moe_inter = moe_inter;
  write_tiny_model(dir, spec, tj);
  return dirs[moe_inter] = dir;
}

// Log lines of a server (scheduler and disk cache), kept for the assertions.
struct Log {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& l) {
      std::lock_guard<std::mutex> g(mu);
      lines.push_back(l);
    };
  }
  std::vector<std::string> matching(const std::string& needle) {
    std::lock_guard<std::mutex> g(mu);
    std::vector<std::string> v;
    for (const auto& l : lines)
      if (l.find(needle) != std::string::npos) v.push_back(l);
    return v;
  }
};

// A `dsx serve` equivalent in this process: engine, tokenizer, disk cache (when `kv_dir`
// is given), HTTP server on an ephemeral loopback port.
struct Server {
  std::unique_ptr<text::Tokenizer> tok;
  std::unique_ptr<Engine> eng;
  std::unique_ptr<DiskCache> cache;
  std::unique_ptr<server::HttpServer> srv;
  std::thread th;
  int port = 0;
  Log log;

  Server(const std::string& model, const std::string& kv_dir, const std::string& secret, int sessions = 1,
         int64_t ctx = kCtx) {
    tok = std::make_unique<text::Tokenizer>(text::Tokenizer::from_model_dir(model));
    EngineOptions o;
    o.max_context = ctx;
    eng = load_engine(model, o);
    server::ServeOptions so;
    so.port = 0;
    so.scheduler.max_sessions = sessions;
    so.scheduler.keepalive_seconds = 1;
    so.scheduler.log = log.sink();
    so.scheduler.secret = secret;
    // (token-prefix reuse only, also in the cache-less references: byte-prefix matching,
    // which a server without a disk cache does, keeps sampled tokens and so computes
    // other states than a server that restores by tokens)
    so.scheduler.byte_prefix = false;
    if (!kv_dir.empty()) {
      DiskCacheOptions co;
      co.log = log.sink();
      cache = DiskCache::open(kv_dir, int64_t{1} << 30, eng->state_identity(), co);
      so.scheduler.cache = cache.get();
    }
    srv = std::make_unique<server::HttpServer>(*eng, *tok, so);
    if (!srv->bind()) throw std::runtime_error("no port");
    port = srv->port();
    server::HttpServer* p = srv.get();
    th = std::thread([p] { p->listen_after_bind(); });
  }
  // Stops as `dsx serve` does on SIGTERM: running requests finish, resident sessions
  // are saved, the cache's writer drains; then the directory is released.
  void stop() {
    if (!srv) return;
    srv->stop();
    if (th.joinable()) th.join();
    srv.reset();
    cache.reset();
    eng.reset();
  }
  ~Server() { stop(); }

  json post(const std::string& path, const json& body) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(600, 0);
    auto r = c.Post(path, body.dump(), "application/json");
    if (!r) return json{{"http_error", httplib::to_string(r.error())}};
    json j = json::parse(r->body, nullptr, false);
    if (r->status != 200) return json{{"http_status", r->status}, {"body", r->body}};
    return j;
  }
  double metric(const std::string& name) const {
    httplib::Client c("127.0.0.1", port);
    auto r = c.Get("/metrics");
    if (!r) return -1;
    const size_t p = r->body.find("\n" + name + " ");
    return p == std::string::npos ? -1 : std::stod(r->body.substr(p + name.size() + 2));
  }
};

// ---- the agent conversation ---------------------------------------------------------------
// Deterministic filler in the style of an agent's system prompt and tool descriptions.
std::string prose(uint32_t seed, int sentences) {
  static const char* subj[] = {"the agent", "you", "every edit", "a test run", "the build", "each tool call",
                               "the reviewer", "a commit", "the patch", "the user"};
  static const char* verb[] = {"must check", "should read", "never changes", "always keeps", "reports",
                               "first inspects", "carefully verifies", "documents", "re-runs", "explains"};
  static const char* obj[] = {"the failing test", "every header it touches", "the build directory",
                              "the public interface", "the error message", "the git history",
                              "the style guide", "the benchmark numbers", "the configuration file",
                              "the list of open issues", "the memory budget", "the thread count"};
  static const char* tail[] = {"before answering.", "after each change.", "when in doubt.",
                               "unless the user says otherwise.", "and says so in the summary.",
                               "without guessing.", "in small steps.", "with exact commands."};
  std::string s;
  uint32_t r = seed * 2654435761u + 12345;
  auto pick = [&](int n) {
    r = r * 1664525u + 1013904223u;
    return static_cast<int>((r >> 8) % static_cast<uint32_t>(n));
  };
  for (int i = 0; i < sentences; ++i) {
    std::string x = std::string(subj[pick(10)]) + " " + verb[pick(10)] + " " + obj[pick(12)] + " " + tail[pick(8)];
    x[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(x[0])));
    s += x;
    s += (i % 7 == 6) ? "\n\n" : " ";
  }
  return s;
}

json agent_tools() {
  auto tool = [](const char* name, const char* arg, uint32_t seed) {
    return json{{"name", name},
                {"description", prose(seed, 40)},
                {"input_schema",
                 {{"type", "object"},
                  {"properties", {{arg, {{"type", "string"}, {"description", prose(seed + 100, 3)}}}}},
                  {"required", {arg}},
                  {"additionalProperties", false}}}};
  };
  return json::array({tool("Bash", "command", 1), tool("Read", "file_path", 2), tool("Edit", "file_path", 3),
                      tool("Grep", "pattern", 4), tool("Glob", "pattern", 5), tool("Write", "file_path", 6)});
}

// What the tools answered, in the style of a recorded session.
std::string tool_output(int turn) {
  static const char* outs[] = {
      "src/cache/disk_cache.cpp\nsrc/cache/disk_cache.h\nsrc/server/scheduler.cpp\nsrc/server/http.cpp\n",
      "[ 42%] Building CXX object CMakeFiles/dsx_lib_server.dir/src/server/scheduler.cpp.o\n"
      "scheduler.cpp:212:7: error: 'hit' was not declared in this scope\n",
      "[==========] 12 tests from 3 test suites ran. (2841 ms total)\n[  PASSED  ] 11 tests.\n[  FAILED  ] 1 test\n",
      "    const int64_t goal = static_cast<int64_t>(p.size()) - 1;\n    int64_t reused = 0;\n",
      "diff --git a/src/server/scheduler.cpp b/src/server/scheduler.cpp\n@@ -88,7 +88,9 @@\n"
      "-  return best;\n+  return useful ? best : nullptr;\n",
      "Process exited with code 0\nWall time: 0.4 seconds\n",
  };
  return cat(outs[turn % 6], "(turn ", turn, ")\n");
}

// The conversation so far and its next request. Two turns in three force a tool call
// (tool_choice any), the third lets the model answer freely.
struct Agent {
  json system = json::array({json{{"type", "text"}, {"text", prose(7, 1080)}}});
  json tools = agent_tools();
  json messages = json::array({json{{"role", "user"},
                                    {"content", "Fix the failing build in src/server and run the tests."}}});
  int turn = 0;

  json request() const {
    const bool forced = turn % 3 != 2;
    json b = {{"model", "dsx-v4-flash"}, {"max_tokens", forced ? 96 : 32}, {"system", system},
              {"tools", tools},          {"messages", messages},          {"temperature", 0},
              {"thinking", {{"type", "enabled"}, {"budget_tokens", 1024}}}};
    if (forced) b["tool_choice"] = {{"type", "any"}};
    return b;
  }
  // The model's answer goes back as the assistant turn, then the tool results (or a
  // nudge when it called none).
  void take(const json& answer) {
    messages.push_back({{"role", "assistant"}, {"content", answer["content"]}});
    json results = json::array();
    for (const auto& b : answer["content"])
      if (b["type"] == "tool_use")
        results.push_back({{"type", "tool_result"}, {"tool_use_id", b["id"]}, {"content", tool_output(turn)}});
    if (results.empty()) results.push_back({{"type", "text"}, {"text", cat("Continue (step ", turn, ").")}});
    messages.push_back({{"role", "user"}, {"content", results}});
    ++turn;
  }
};

// An answer without what differs between servers by design (message and tool-call ids,
// the reasoning's signature: each server signs with its own secret unless shared).
json essence(const json& a) {
  json e = {{"stop_reason", a.value("stop_reason", json())}, {"usage", a.value("usage", json())}};
  json blocks = json::array();
  if (a.contains("content"))
    for (json b : a["content"]) {
      b.erase("id");
      b.erase("signature");
      blocks.push_back(b);
    }
  e["content"] = blocks;
  e["usage"].erase("cache_read_input_tokens");  // (prompt_tokens = input + cache read)
  e["usage"].erase("input_tokens");
  e["usage"]["prompt_tokens"] = a["usage"].value("input_tokens", 0) + a["usage"].value("cache_read_input_tokens", 0);
  return e;
}

int64_t prompt_tokens(const json& a) {
  return a["usage"].value("input_tokens", 0) + a["usage"].value("cache_read_input_tokens", 0);
}
int64_t cached_tokens(const json& a) { return a["usage"].value("cache_read_input_tokens", 0); }

}  // namespace

#define NEED_MODEL()                                 \
  if (model_dir().empty()) GTEST_SKIP() << "golden tokenizer not found"

TEST(ServerKvCache, AgentReplaySurvivesRestartsAndBadFiles) {
  NEED_MODEL();
  const std::string model = model_dir();
  const std::string kv = dsx_test::temp_dir("kv_server_replay");
  const std::string secret = server::persistent_secret(kv);
  EXPECT_EQ(server::persistent_secret(kv), secret) << "the secret is kept";
  // the reference: a cache-less server that sees the same requests and never restarts
  // (the same reasoning secret, so that it takes the replayed thinking back as well)
  Server ref(model, "", secret);
  Agent agent;
  int64_t prompt_sum = 0, cached_sum = 0, extended = 0, extended_full = 0;
  int64_t last_prompt = 0, last_state = 0;
  auto turn = [&](Server& s, const char* phase) {
    const json req = agent.request();
    const json got = s.post("/v1/messages", req);
    const json want = ref.post("/v1/messages", req);
    EXPECT_TRUE(got.contains("content")) << phase << " turn " << agent.turn << ": " << got.dump().substr(0, 400);
    EXPECT_EQ(essence(got), essence(want)) << phase << " turn " << agent.turn;
    const int64_t p = prompt_tokens(got), c = cached_tokens(got);
    if (agent.turn > 0) {
      prompt_sum += p;
      cached_sum += c;
      // how the client's next prompt relates to the state the last turn left: an extension
      // of the last prompt (always, for a client that only appends), and of everything the
      // model generated too (unless the replay of its answer tokenizes differently)
      if (c >= last_prompt - 1) ++extended;
      if (c >= last_state) ++extended_full;
    }
    last_prompt = p;
    last_state = p + got["usage"].value("output_tokens", 0) - 1;
    agent.take(got);
    return got;
  };
  const auto t0 = std::chrono::steady_clock::now();
  // ---- server 1: turns 0 .. 13 ----
  {
    Server s(model, kv, secret);
    for (int i = 0; i < 14; ++i) turn(s, "server 1");
    EXPECT_GT(s.metric("dsx_kv_cache_saves_total"), 0);
    // (turn 0 was cold; the rest reused the resident session)
    const double pt = s.metric("dsx_prompt_tokens_total"), ct = s.metric("dsx_cached_prompt_tokens_total");
    std::printf("server 1: %.0f prompt tokens, %.0f cached\n", pt, ct);
    s.stop();
  }
  // ---- servers 2 and 3: a restart costs one restore ----
  json after_restart[2];
  json after_restart_req[2];
  for (int k = 0; k < 2; ++k) {
    Server s(model, kv, secret);
    const int64_t before = prompt_sum - cached_sum;
    after_restart_req[k] = agent.request();
    after_restart[k] = turn(s, k == 0 ? "server 2" : "server 3");
    EXPECT_EQ(s.metric("dsx_kv_cache_restores_total"), 1) << "restart " << k + 1;
    const int64_t prefilled = prompt_sum - cached_sum - before;
    std::printf("restart %d: restored %lld of %lld prompt tokens, prefilled %lld\n", k + 1,
                (long long)cached_tokens(after_restart[k]), (long long)prompt_tokens(after_restart[k]),
                (long long)prefilled);
    EXPECT_LT(prefilled, 400) << "restart " << k + 1 << " prefilled instead of restoring";
    for (int i = 0; i < 13 + k; ++i) turn(s, k == 0 ? "server 2" : "server 3");
    const double pt = s.metric("dsx_prompt_tokens_total"), ct = s.metric("dsx_cached_prompt_tokens_total");
    std::printf("server %d: %.0f prompt tokens, %.0f cached (%.2f %%), %.0f restored from disk\n", k + 2, pt, ct,
                100 * ct / pt, s.metric("dsx_kv_cache_restored_tokens_total"));
    EXPECT_GE(ct, 0.99 * pt) << "server " << k + 2 << " (/metrics)";
    s.stop();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("replay: %d turns, last prompt %lld tokens; after the first turn %lld of %lld prompt tokens cached "
              "(%.3f %%); %lld of %d prompts extended the last prompt, %lld the whole last state; %.0f s\n",
              agent.turn, (long long)last_prompt, (long long)cached_sum, (long long)prompt_sum,
              100.0 * cached_sum / prompt_sum, (long long)extended, agent.turn - 1, (long long)extended_full, secs);
  EXPECT_GE(agent.turn, 41);
  EXPECT_GT(last_prompt, 20000);
  EXPECT_GE(cached_sum, 0.99 * prompt_sum) << "prompt tokens served from cache after the first turn";
  EXPECT_EQ(extended, agent.turn - 1) << "a prompt that does not extend the last one (renderer or secret)";

  // ---- a cold server (no cache, nothing resident) answers the first request after a
  // restart exactly as the restored session did
  {
    Server cold(model, "", secret);
    const json c = cold.post("/v1/messages", after_restart_req[1]);
    EXPECT_EQ(cached_tokens(c), 0);
    EXPECT_EQ(essence(c), essence(after_restart[1])) << "the first answer after the second restart";
  }

  // ---- bad files in the directory ----
  std::vector<CacheEntryInfo> entries;
  {
    DiskCacheOptions ro;
    ro.exclusive = false;
    ro.log = [](const std::string&) {};
    entries = DiskCache::open_any(kv, ro)->entries();
  }
  ASSERT_GE(entries.size(), 5u);
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.tokens > b.tokens; });
  // the two longest (the last shutdown's states) bit-flipped inside their snapshot, the
  // shortest truncated, and another model's entry copied in
  const std::string flipped[2] = {entries[0].name, entries[1].name};
  for (int k = 0; k < 2; ++k) {
    std::fstream f(kv + "/" + flipped[k], std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(entries[k].bytes / 2);  // (inside the snapshot's KV sections)
    f.seekg(at);
    char ch = 0;
    f.read(&ch, 1);
    ch = static_cast<char>(ch ^ 0x10);
    f.seekp(at);
    f.write(&ch, 1);
  }
  const std::string truncated = entries.back().name;
  fs::resize_file(kv + "/" + truncated, static_cast<uintmax_t>(entries.back().bytes / 3));
  std::string foreign;
  {
    const std::string other = model_dir(64);
    EngineOptions o;
    o.max_context = 4096;
    auto eng = load_engine(other, o);
    const std::string odir = dsx_test::temp_dir("kv_server_other");
    auto oc = DiskCache::open(odir, 0, eng->state_identity());
    auto s = eng->new_session();
    std::vector<int32_t> ids(600);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(1000 + i);
    s->sync(ids);
    foreign = oc->save(*s).name;
    oc.reset();
    fs::copy_file(odir + "/" + foreign, kv + "/" + foreign);
  }
  {
    Server s(model, kv, secret);
    const auto trunc_lines = s.log.matching(truncated), foreign_lines = s.log.matching(foreign);
    ASSERT_EQ(trunc_lines.size(), 1u);
    EXPECT_NE(trunc_lines[0].find("truncated"), std::string::npos) << trunc_lines[0];
    ASSERT_EQ(foreign_lines.size(), 1u);
    EXPECT_NE(foreign_lines[0].find("another model"), std::string::npos) << foreign_lines[0];
    EXPECT_EQ(s.metric("dsx_kv_cache_refused_files_total"), 2);
    // the next turn would restore a flipped entry (the prompt-end state of the last
    // shutdown is a prefix of every next prompt): refused, the next longest restored
    turn(s, "bad files");
    int refused = 0;
    for (const std::string& n : flipped) {
      const auto l = s.log.matching(n);
      if (l.empty()) continue;  // (not a prefix of this prompt: never read)
      ++refused;
      EXPECT_NE(l[0].find("refused"), std::string::npos) << l[0];
      EXPECT_NE(l[0].find("checksum"), std::string::npos) << l[0];
      EXPECT_FALSE(fs::exists(kv + "/" + n)) << "a refused file stays";
    }
    EXPECT_GE(refused, 1) << "no bit-flipped entry was tried";
    EXPECT_EQ(s.metric("dsx_kv_cache_restore_failures_total"), refused);
    EXPECT_EQ(s.metric("dsx_kv_cache_restores_total"), 1);
    // a flipped entry no request read is found by a full check (dsx cache verify)
    const VerifyReport vr = s.cache->verify();
    EXPECT_EQ(vr.bad, 2 - refused);
    for (const std::string& n : flipped) EXPECT_FALSE(fs::exists(kv + "/" + n));
    EXPECT_TRUE(fs::exists(kv + "/" + foreign)) << "another model's file is kept";
  }
  // ---- an edit in an early block (the tool result of turn 3) ----
  {
    Agent edit;
    edit.messages = json::array();
    // the conversation up to turn 6, with turn 3's tool result rewritten
    for (size_t i = 0; i < 13; ++i) edit.messages.push_back(agent.messages[i]);
    json& res = edit.messages[8]["content"][0];
    ASSERT_EQ(edit.messages[8]["role"], "user");
    if (res["type"] == "tool_result") res["content"] = "exit 1\nsomething else happened\n";
    else res["text"] = "Stop and explain first.";
    edit.turn = 6;
    // what is stored before the edit: entries no longer than turn 3's prompt (the edited
    // block follows that prompt and the model's answer to it)
    Server s(model, kv, secret);
    const json req = edit.request();
    const json got = s.post("/v1/messages", req);
    const json want = ref.post("/v1/messages", req);
    EXPECT_EQ(essence(got), essence(want)) << "edited conversation";
    std::vector<CacheEntryInfo> now;
    {
      DiskCacheOptions ro;
      ro.exclusive = false;
      ro.log = [](const std::string&) {};
      now = DiskCache::open_any(kv, ro)->entries();
    }
    // the first difference lies after turn 3's prompt: the longest entry up to there
    const json turn3 = s.post("/v1/messages/count_tokens", [&] {
      json b = edit.request();
      b["messages"] = json::array();
      for (size_t i = 0; i < 7; ++i) b["messages"].push_back(edit.messages[i]);
      b.erase("max_tokens");
      b.erase("temperature");
      return b;
    }());
    const int64_t l3 = turn3.value("input_tokens", 0);
    int64_t expect = 0;
    for (const auto& e : now)
      if (e.tokens <= l3 - 1) expect = std::max(expect, e.tokens);
    std::printf("edit at turn 3 (prompt %lld tokens): restored %lld (longest entry before it %lld), prompt %lld\n",
                (long long)l3, (long long)cached_tokens(got), (long long)expect, (long long)prompt_tokens(got));
    EXPECT_GT(expect, 0);
    EXPECT_EQ(cached_tokens(got), expect);
    EXPECT_EQ(s.metric("dsx_kv_cache_restores_total"), 1);
  }
}

// The three agents' request shapes (../shared/agents/README.md): Claude Code (messages,
// thinking blocks with signatures), Codex (responses, store:false, reasoning items with
// encrypted_content, function_call / function_call_output) and opencode (chat completions,
// reasoning_content and tool_calls echoed, role tool). Each conversation runs 4 turns,
// the server restarts over the same directory and secret, 2 more turns, then a server with
// a fresh secret answers one more. Every prompt extends the previous one (the renderer
// and the adapters never rewrite history), also across the restart; with a fresh secret
// the reasoning Claude Code and Codex replay is not recognised and the prefix breaks at
// the first assistant turn (why the secret is kept beside the cache).
TEST(ServerKvCache, AgentShapesExtendTheirPromptsAcrossARestart) {
  NEED_MODEL();
  const std::string model = model_dir();
  struct Shape {
    const char* name;
    const char* path;
    std::function<json(const json& conv, int turn)> request;
    std::function<void(json& conv, const json& answer, int turn)> take;
    std::function<int64_t(const json&)> prompt, cached;
  };
  const std::string sys = prose(11, 150);
  json tools = agent_tools();
  json fn_tools = json::array(), chat_tools = json::array();
  for (const auto& t : tools) {
    fn_tools.push_back({{"type", "function"}, {"name", t["name"]}, {"description", t["description"]},
                        {"parameters", t["input_schema"]}, {"strict", false}});
    chat_tools.push_back({{"type", "function"},
                          {"function", {{"name", t["name"]}, {"description", t["description"]},
                                        {"parameters", t["input_schema"]}}}});
  }
  const Shape shapes[] = {
      {"claude-code", "/v1/messages",
       [&](const json& conv, int turn) {
         Agent a;
         a.system = json::array({json{{"type", "text"}, {"text", sys}}});
         a.messages = conv;
         a.turn = turn;
         return a.request();
       },
       [&](json& conv, const json& ans, int turn) {
         Agent a;
         a.messages = conv;
         a.turn = turn;
         a.take(ans);
         conv = a.messages;
       },
       [](const json& a) { return prompt_tokens(a); }, [](const json& a) { return cached_tokens(a); }},
      {"codex", "/v1/responses",
       // (every turn calls a tool: the random model's free answers are a lone, unfinished
       // reasoning item, which the adapter drops on replay: that prompt would not extend)
       [&](const json& conv, int turn) {
         return json{{"model", "dsx-v4-flash"}, {"input", conv}, {"tools", fn_tools}, {"tool_choice", "required"},
                     {"store", false}, {"include", {"reasoning.encrypted_content"}},
                     {"reasoning", {{"summary", "auto"}}}, {"max_output_tokens", 96}, {"temperature", 0}};
       },
       [&](json& conv, const json& ans, int turn) {
         bool called = false;
         for (const auto& it : ans["output"]) {
           conv.push_back(it);
           if (it["type"] == "function_call") {
             conv.push_back(
                 {{"type", "function_call_output"}, {"call_id", it["call_id"]}, {"output", tool_output(turn)}});
             called = true;
           }
         }
         if (!called)
           conv.push_back({{"type", "message"}, {"role", "user"},
                           {"content", {{{"type", "input_text"}, {"text", cat("Continue (step ", turn, ").")}}}}});
       },
       [](const json& a) { return a["usage"].value("input_tokens", int64_t{0}); },
       [](const json& a) { return a["usage"]["input_tokens_details"].value("cached_tokens", int64_t{0}); }},
      {"opencode", "/v1/chat/completions",
       [&](const json& conv, int turn) {
         const bool forced = turn % 3 != 2;
         return json{{"model", "dsx-v4-flash"}, {"messages", conv}, {"tools", chat_tools},
                     {"tool_choice", forced ? "required" : "auto"}, {"max_tokens", forced ? 96 : 32},
                     {"temperature", 0}};
       },
       [&](json& conv, const json& ans, int turn) {
         const json& m = ans["choices"][0]["message"];
         json a = {{"role", "assistant"}, {"content", m.value("content", json(""))}};
         if (m.contains("reasoning_content")) a["reasoning_content"] = m["reasoning_content"];
         if (m.contains("tool_calls")) a["tool_calls"] = m["tool_calls"];
         conv.push_back(a);
         if (m.contains("tool_calls"))
           for (const auto& c : m["tool_calls"])
             conv.push_back({{"role", "tool"}, {"tool_call_id", c["id"]}, {"content", tool_output(turn)}});
         else
           conv.push_back({{"role", "user"}, {"content", cat("Continue (step ", turn, ").")}});
       },
       [](const json& a) { return a["usage"].value("prompt_tokens", int64_t{0}); },
       [](const json& a) { return a["usage"]["prompt_tokens_details"].value("cached_tokens", int64_t{0}); }},
  };
  for (const Shape& sh : shapes) {
    const std::string kv = dsx_test::temp_dir(cat("kv_server_shape_", sh.name));
    const std::string secret = server::persistent_secret(kv);
    json conv;
    if (std::string(sh.name) == "claude-code")
      conv = json::array({json{{"role", "user"}, {"content", "Fix the failing build in src/server."}}});
    else if (std::string(sh.name) == "codex")
      conv = json::array({json{{"type", "message"}, {"role", "developer"},
                               {"content", {{{"type", "input_text"}, {"text", sys}}}}},
                          json{{"type", "message"}, {"role", "user"},
                               {"content", {{{"type", "input_text"}, {"text", "Fix the failing build."}}}}}});
    else
      conv = json::array({json{{"role", "system"}, {"content", sys}},
                          json{{"role", "user"}, {"content", "Fix the failing build in src/server."}}});
    int64_t last_prompt = 0, last_state = 0;
    int extended = 0, extended_full = 0, turns = 0;
    int64_t restart_cached = 0, restart_prompt = 0;
    auto run = [&](Server& s, int turn) {
      const json ans = s.post(sh.path, sh.request(conv, turn));
      EXPECT_FALSE(ans.contains("http_status")) << sh.name << " turn " << turn << ": " << ans.dump().substr(0, 300);
      const int64_t p = sh.prompt(ans), c = sh.cached(ans);
      std::printf("  %s turn %d: prompt %lld, cached %lld (last prompt %lld, last state %lld)\n", sh.name, turn,
                  (long long)p, (long long)c, (long long)last_prompt, (long long)last_state);
      if (turn > 0) {
        ++turns;
        if (c >= last_prompt - 1) ++extended;
        if (c >= last_state) ++extended_full;
      }
      int64_t out = 0;
      if (ans.contains("usage"))
        out = ans["usage"].value("output_tokens", ans["usage"].value("completion_tokens", int64_t{0}));
      last_prompt = p;
      last_state = p + out - 1;
      sh.take(conv, ans, turn);
      return std::make_pair(p, c);
    };
    int turn = 0;
    {
      Server s(model, kv, secret, 1, 8192);
      for (; turn < 4; ++turn) run(s, turn);
    }
    {
      Server s(model, kv, secret, 1, 8192);
      std::tie(restart_prompt, restart_cached) = run(s, turn++);
      EXPECT_EQ(s.metric("dsx_kv_cache_restores_total"), 1) << sh.name;
      run(s, turn++);
    }
    int64_t fresh_cached = 0, fresh_prompt = 0, before = last_prompt;
    {
      Server s(model, kv, "", 1, 8192);  // a fresh secret
      std::tie(fresh_prompt, fresh_cached) = run(s, turn++);
    }
    std::printf("%-11s %d turns: %d extended the last prompt, %d the whole last state; restart: %lld of %lld "
                "cached; with a fresh secret: %lld of %lld cached (last prompt %lld)\n",
                sh.name, turns, extended, extended_full, (long long)restart_cached, (long long)restart_prompt,
                (long long)fresh_cached, (long long)fresh_prompt, (long long)before);
    EXPECT_GE(extended, turns - 1) << sh.name;  // (all but the fresh-secret turn)
    EXPECT_GE(restart_cached, restart_prompt - 200) << sh.name;
    // Claude Code's thinking blocks are taken back only with their signature's secret
    if (std::string(sh.name) == "claude-code") EXPECT_LT(fresh_cached, before - 1);
  }
}

// The save policy (chat-and-serving.md §5.4, K1): a cold prompt of L tokens is stored at
// its chat anchor (the position of the <｜User｜> after the system prompt) and at
// align_down(L - 32, 2048); a follow-up that reuses it stores nothing new until it is
// evicted or the server stops (then the whole state and the prompt-end state).
TEST(ServerKvCache, ColdSavesAtTheAnchorAndTheAlignedBoundary) {
  NEED_MODEL();
  const std::string model = model_dir();
  const std::string kv = dsx_test::temp_dir("kv_server_policy");
  auto sizes = [&] {
    DiskCacheOptions ro;
    ro.exclusive = false;
    ro.log = [](const std::string&) {};
    std::multiset<int64_t> v;
    for (const auto& e : DiskCache::open_any(kv, ro)->entries()) v.insert(e.tokens);
    return v;
  };
  const std::string sys = prose(21, 230);
  json b = {{"model", "x"},
            {"messages", {{{"role", "system"}, {"content", sys}}, {{"role", "user"}, {"content", "Build it."}}}},
            {"max_tokens", 6},
            {"temperature", 0},
            {"thinking", false}};
  json sys_only = b;
  sys_only["messages"] = json::array({b["messages"][0]});
  int64_t L = 0, anchor = 0, L2 = 0;
  {
    Server s(model, kv, "", 1, 8192);
    const json a = s.post("/v1/chat/completions", b);
    L = a["usage"]["prompt_tokens"];
    s.cache->flush();
    const std::multiset<int64_t> got = sizes();
    // the prompt ends <｜User｜>Build it.<｜Assistant｜></think>: the anchor is where that starts
    anchor = L - 3 - static_cast<int64_t>(s.tok->encode("Build it.", false).size());
    std::printf("prompt %lld tokens: entries", (long long)L);
    for (int64_t t : got) std::printf(" %lld", (long long)t);
    std::printf(" (anchor %lld, align_down(L - 32, 2048) = %lld)\n", (long long)anchor,
                (long long)((L - 32) / 2048 * 2048));
    EXPECT_EQ(got, (std::multiset<int64_t>{(L - 32) / 2048 * 2048, anchor}));
    // a follow-up reuses the prefix: no cold save
    b["messages"].push_back({{"role", "assistant"}, {"content", "Done."}});
    b["messages"].push_back({{"role", "user"}, {"content", "Now test it."}});
    const json a2 = s.post("/v1/chat/completions", b);
    L2 = a2["usage"]["prompt_tokens"];
    EXPECT_GE(a2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), L - 1);
    s.cache->flush();
    EXPECT_EQ(sizes().size(), 2u);
    EXPECT_EQ(s.metric("dsx_kv_cache_saves_by_reason_total{reason=\"cold\"}"), 2);
  }
  // stopped: the resident session's whole state and its prompt-end state (L2 - 1)
  const std::multiset<int64_t> after = sizes();
  EXPECT_EQ(after.size(), 4u);
  EXPECT_EQ(after.count(L2 - 1), 1u);
  EXPECT_EQ(*after.rbegin(), L2 + 5) << "the whole state: the prompt and all but the last of 6 generated tokens";
}

// One session, two long conversations taking turns: each evicts the other, which comes
// back from disk instead of a cold prefill.
TEST(ServerKvCache, EvictedSessionsComeBackFromDisk) {
  NEED_MODEL();
  const std::string model = model_dir();
  const std::string kv = dsx_test::temp_dir("kv_server_evict");
  Server s(model, kv, "", 1, 8192);
  Server ref(model, "", "", 2, 8192);
  auto body = [](int conv, int turn) {
    json msgs = json::array();
    msgs.push_back({{"role", "system"}, {"content", prose(50 + conv, 120)}});
    for (int t = 0; t <= turn; ++t) {
      msgs.push_back({{"role", "user"}, {"content", cat("Conversation ", conv, ", question ", t, ".")}});
      if (t < turn) msgs.push_back({{"role", "assistant"}, {"content", cat("Answer ", t, ".")}});
    }
    return json{{"model", "x"}, {"messages", msgs}, {"max_tokens", 8}, {"temperature", 0}};
  };
  for (int turn = 0; turn < 3; ++turn)
    for (int conv = 0; conv < 2; ++conv) {
      const json got = s.post("/v1/chat/completions", body(conv, turn));
      const json want = ref.post("/v1/chat/completions", body(conv, turn));
      ASSERT_TRUE(got.contains("choices")) << got.dump().substr(0, 300);
      EXPECT_EQ(got["choices"][0]["message"], want["choices"][0]["message"]);
      const int64_t p = got["usage"]["prompt_tokens"], c = got["usage"]["prompt_tokens_details"]["cached_tokens"];
      if (turn > 0) EXPECT_GE(c, p - 40) << "conversation " << conv << " turn " << turn << " was not restored";
    }
  EXPECT_GE(s.metric("dsx_kv_cache_restores_total"), 4);
  EXPECT_GE(s.metric("dsx_kv_cache_saves_total"), 4);
}

namespace {

std::string dsx_binary() {
  if (const char* b = std::getenv("DSX_BUILD_DIR")) {
    const std::string p = std::string(b) + "/dsx";
    if (fs::exists(p)) return p;
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(self.parent_path() / "dsx")) return (self.parent_path() / "dsx").string();
  return "";
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// `dsx serve` in a child process; waits for /health.
pid_t spawn_server(const std::string& bin, const std::string& model, const std::string& kv, int port,
                   const std::string& log) {
  const std::string p = std::to_string(port);  // (the child only calls async-signal-safe functions)
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) ::dup2(fd, 2), ::dup2(fd, 1);
    ::execl(bin.c_str(), bin.c_str(), "serve", "-m", model.c_str(), "--port", p.c_str(), "--ctx", "8192",
            "--sessions", "1", "--threads", "1", "--kv-cache", kv.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  httplib::Client c("127.0.0.1", port);
  for (int i = 0; i < 300; ++i) {
    if (auto r = c.Get("/health"); r && r->status == 200) return pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return -1;
}

// Waits for the child at most `seconds`; one still running then is killed, and the test
// fails naming what it waited for (a server that does not stop must not hold the run).
int wait_child(pid_t pid, int seconds, const char* what) {
  int status = 0;
  for (int i = 0; i < seconds * 10; ++i) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ADD_FAILURE() << "dsx serve did not exit within " << seconds << " s of " << what;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return status;
}

std::set<std::string> entry_files(const std::string& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 6 && n.compare(n.size() - 6, 6, ".dsxkv") == 0) s.insert(n);
  }
  return s;
}

}  // namespace

// kill -9 at random moments while a `dsx serve` process prefills and saves: every entry
// published before the kill survives and verifies; nothing partial is ever loaded.
// SIGTERM: the resident session is saved, and the next process restores it.
TEST(ServerKvCache, KillNineLosesNoCommittedEntry) {
  NEED_MODEL();
  const std::string bin = dsx_binary();
  if (bin.empty()) GTEST_SKIP() << "the dsx binary is not built next to the tests";
  const std::string model = model_dir();
  const std::string kv = dsx_test::temp_dir("kv_server_kill");
  const std::string log = kv + "-serve.log";
  std::mt19937 rng(20261202);
  auto body = [](int i) {
    return json{{"model", "x"},
                {"messages",
                 {{{"role", "system"}, {"content", prose(300 + i, 260)}},
                  {{"role", "user"}, {"content", cat("Request ", i)}}}},
                {"max_tokens", 24},
                {"temperature", 0}};
  };
  int killed_with_files = 0;
  for (int i = 0; i < 6; ++i) {
    const int port = free_port();
    const pid_t pid = spawn_server(bin, model, kv, port, log);
    ASSERT_GT(pid, 0) << "dsx serve did not come up (" << log << ")";
    std::thread client([&] {
      httplib::Client c("127.0.0.1", port);
      c.set_read_timeout(60, 0);
      c.Post("/v1/chat/completions", body(i).dump(), "application/json");  // (killed: no answer)
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(100, 4000)(rng)));
    const std::set<std::string> before = entry_files(kv);
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    client.join();
    if (!before.empty()) ++killed_with_files;
    const std::set<std::string> after = entry_files(kv);
    for (const std::string& n : before) EXPECT_TRUE(after.count(n)) << "kill " << i << " lost " << n;
    // reopening removes temporary files; every entry is whole
    std::vector<std::string> lines;
    DiskCacheOptions co;
    co.log = [&](const std::string& l) { lines.push_back(l); };
    EngineOptions o;
    o.max_context = 8192;
    auto eng = load_engine(model, o);
    auto c = DiskCache::open(kv, 0, eng->state_identity(), co);
    EXPECT_EQ(c->stats().refused, 0) << (lines.empty() ? "" : lines[0]);
    EXPECT_EQ(c->verify().bad, 0);
  }
  EXPECT_GT(killed_with_files, 0);
  // SIGTERM: the request finishes, the session is saved; the next process restores it
  const int port = free_port();
  pid_t pid = spawn_server(bin, model, kv, port, log);
  ASSERT_GT(pid, 0);
  json first;
  {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    auto r = c.Post("/v1/chat/completions", body(100).dump(), "application/json");
    ASSERT_TRUE(r && r->status == 200);
    first = json::parse(r->body);
  }
  ::kill(pid, SIGTERM);
  const int status = wait_child(pid, 120, "SIGTERM");
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const int port2 = free_port();
  pid = spawn_server(bin, model, kv, port2, log);
  ASSERT_GT(pid, 0);
  {
    httplib::Client c("127.0.0.1", port2);
    c.set_read_timeout(120, 0);
    auto r = c.Post("/v1/chat/completions", body(100).dump(), "application/json");
    ASSERT_TRUE(r && r->status == 200);
    const json again = json::parse(r->body);
    const int64_t p = again["usage"]["prompt_tokens"];
    const int64_t cached = again["usage"]["prompt_tokens_details"]["cached_tokens"];
    EXPECT_EQ(cached, p - 1) << "the SIGTERM save was not restored";
    EXPECT_EQ(again["choices"][0]["message"], first["choices"][0]["message"]);
  }
  ::kill(pid, SIGTERM);
  wait_child(pid, 120, "SIGTERM");
}

#endif  // DSX_HAVE_HTTP
