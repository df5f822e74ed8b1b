// dsx serve end to end, on the CPU engine over a tiny random model that takes the V4.1
// test tokenizer: every endpoint answers (streaming and not) in its API's shape with a
// finish reason; a second turn reuses the first turn's prefix (cached tokens, time to
// first token); concurrent streaming clients all complete and decode together; a client
// that goes away mid-stream frees its session; bad requests get well-formed 4xx answers.
#include <gtest/gtest.h>
#include <httplib.h>

#include <array>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/make_tiny.h"
#include "runtime/engine.h"
#include "server/http.h"
#include "test_util.h"
#include "text/engram_cmap.h"
#include "text/tokenizer.h"

using namespace dsx;
using nlohmann::json;

namespace {

struct Served {
  std::string dir;
  std::unique_ptr<text::Tokenizer> tok;
  std::unique_ptr<Engine> eng;
  std::unique_ptr<server::HttpServer> srv;
  std::thread th;
  int port = 0;
  ~Served() {
    if (srv) srv->stop();
    if (th.joinable()) th.join();
    srv.reset();
  }
};

// A tiny model with the golden V4.1 test tokenizer (vocabulary 129280), served with
// `sessions` sessions of `ctx` tokens on an ephemeral loopback port.
std::unique_ptr<Served> serve(int sessions = 4, int64_t ctx = 8192, const std::string& key = "",
                              bool byte_prefix = true, std::function<void(const std::string&)> log = {}) {
  const std::string g = dsx_test::golden_dir();
  if (g.empty()) return nullptr;
  auto s = std::make_unique<Served>();
  static std::string dir;
  if (dir.empty()) {
    dir = dsx_test::temp_dir("server_model");
    const std::string tj = g + "/tokenizer/tokenizer-v41.json";
    text::Tokenizer t = text::Tokenizer::from_file(tj);
    int32_t n_keys = 0;
    text::build_engram_token_map(t, &n_keys);
    TinySpec spec;
    spec.vocab = static_cast<int64_t>(t.size());
    spec.engram_compressed_vocab = n_keys;
    spec.hidden = 128;
    spec.moe_inter = 32;
    write_tiny_model(dir, spec, tj);
  }
  s->dir = dir;
  s->tok = std::make_unique<text::Tokenizer>(text::Tokenizer::from_model_dir(dir));
  EngineOptions o;
  o.max_context = ctx;
  s->eng = load_engine(dir, o);
  server::ServeOptions so;
  so.port = 0;
  so.api_key = key;
  so.scheduler.max_sessions = sessions;
  so.scheduler.log_requests = static_cast<bool>(log);
  so.scheduler.log = log;
  so.scheduler.keepalive_seconds = 0.2;
  so.scheduler.byte_prefix = byte_prefix;
  s->srv = std::make_unique<server::HttpServer>(*s->eng, *s->tok, so);
  if (!s->srv->bind()) return nullptr;
  s->port = s->srv->port();
  server::HttpServer* p = s->srv.get();
  s->th = std::thread([p] { p->listen_after_bind(); });
  return s;
}

httplib::Client client(const Served& s) {
  httplib::Client c("127.0.0.1", s.port);
  c.set_read_timeout(120, 0);
  return c;
}

// The data lines of an SSE stream, parsed (skips comments and [DONE]); `events` gets the
// event names where the stream has them.
std::vector<json> sse(const std::string& body, std::vector<std::string>* events = nullptr, bool* done = nullptr) {
  std::vector<json> out;
  size_t p = 0;
  while (p < body.size()) {
    size_t e = body.find('\n', p);
    if (e == std::string::npos) e = body.size();
    const std::string line = body.substr(p, e - p);
    p = e + 1;
    if (line.rfind("event: ", 0) == 0 && events) events->push_back(line.substr(7));
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string d = line.substr(6);
    if (d == "[DONE]") {
      if (done) *done = true;
      continue;
    }
    out.push_back(json::parse(d));
  }
  return out;
}

json chat_body(const std::string& user, bool stream, int max_tokens = 8, const std::string& system = "") {
  json msgs = json::array();
  if (!system.empty()) msgs.push_back({{"role", "system"}, {"content", system}});
  msgs.push_back({{"role", "user"}, {"content", user}});
  return {{"model", "anything"}, {"messages", msgs}, {"max_tokens", max_tokens}, {"stream", stream},
          {"temperature", 0}, {"stream_options", {{"include_usage", true}}}};
}

}  // namespace

#define SERVE(var, ...)              \
  auto var = serve(__VA_ARGS__);     \
  if (!var) GTEST_SKIP() << "golden tokenizer not found or no port"

TEST(Server, EndpointsAnswerInTheirShapes) {
  SERVE(s);
  auto c = client(*s);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_EQ(json::parse(m->body)["object"], "list");
  auto hd = c.Head("/");
  ASSERT_TRUE(hd);
  EXPECT_EQ(hd->status, 200);
  auto nf = c.Get("/v1/nothing");
  ASSERT_TRUE(nf);
  EXPECT_EQ(nf->status, 404);
  EXPECT_TRUE(json::parse(nf->body).contains("error"));
  auto mt = c.Get("/metrics");
  ASSERT_TRUE(mt);
  EXPECT_NE(mt->body.find("dsx_requests_total"), std::string::npos);

  // chat completions, not streaming and streaming
  auto r = c.Post("/v1/chat/completions", chat_body("Say hi.", false).dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_string());
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 0);
  r = c.Post("/v1/chat/completions?x=1", chat_body("Say hi.", true).dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  bool done = false;
  auto chunks = sse(r->body, nullptr, &done);
  ASSERT_FALSE(chunks.empty());
  EXPECT_TRUE(done);
  bool finish = false;
  for (const auto& ch : chunks)
    if (ch.contains("choices") && !ch["choices"].empty() && ch["choices"][0]["finish_reason"].is_string()) finish = true;
  EXPECT_TRUE(finish) << "no chunk with a finish_reason";
  EXPECT_TRUE(chunks.back().contains("usage"));

  // Anthropic messages (query string ignored, as Claude Code sends it)
  json mb = {{"model", "claude-x"}, {"max_tokens", 8}, {"messages", {{{"role", "user"}, {"content", "Say hi."}}}},
             {"system", {{{"type", "text"}, {"text", "Be brief."}}}}};
  r = c.Post("/v1/messages?beta=true", mb.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  j = json::parse(r->body);
  EXPECT_EQ(j["type"], "message");
  EXPECT_TRUE(j["stop_reason"].is_string());
  mb["stream"] = true;
  r = c.Post("/v1/messages?beta=true", mb.dump(), "application/json");
  ASSERT_TRUE(r);
  std::vector<std::string> ev;
  sse(r->body, &ev);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.front(), "message_start");
  EXPECT_NE(std::find(ev.begin(), ev.end(), "message_delta"), ev.end());
  r = c.Post("/v1/messages/count_tokens", mb.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_GT(json::parse(r->body)["input_tokens"].get<int>(), 0);

  // Responses (what Codex sends: developer item, stream)
  json rb = {{"model", "codex-x"}, {"stream", true}, {"store", false}, {"max_output_tokens", 8},
             {"input", {{{"type", "message"}, {"role", "developer"}, {"content", {{{"type", "input_text"}, {"text", "You code."}}}}},
                        {{"type", "message"}, {"role", "user"}, {"content", {{{"type", "input_text"}, {"text", "Say hi."}}}}}}}};
  r = c.Post("/v1/responses", rb.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  ev.clear();
  auto data = sse(r->body, &ev);
  ASSERT_FALSE(ev.empty());
  const std::string last = ev.back();
  EXPECT_TRUE(last == "response.completed" || last == "response.incomplete") << last;
  EXPECT_NE(std::find(ev.begin(), ev.end(), "response.output_item.done"), ev.end());
}

// A second turn that resends the conversation reuses the first turn's prefix: its usage
// reports the shared prefix as cached, and its time to first token is much shorter.
TEST(Server, SecondTurnReusesThePrefix) {
  SERVE(s, 2, 16384);
  auto c = client(*s);
  std::string sys;
  for (int i = 0; i < 600; ++i) sys += "The build uses CMake and every room has its own library. ";
  auto turn = [&](const std::string& user, double* ttft) {
    json b = chat_body(user, true, 4, sys);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = b.dump();
    req.set_header("Content-Type", "application/json");
    std::string body;
    const auto t0 = std::chrono::steady_clock::now();
    bool first = false;
    // time to the first generated token: the first chunk with reasoning or content text
    req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
      body.append(d, n);
      if (!first)
        for (const auto& ch : sse(body.substr(0, body.rfind("\n\n") + 2)))
          if (ch.contains("choices") && !ch["choices"].empty()) {
            const json& dl = ch["choices"][0]["delta"];
            for (const char* k : {"content", "reasoning_content"})
              if (dl.contains(k) && dl[k].is_string() && !dl[k].get<std::string>().empty()) first = true;
          }
      if (first && *ttft == 0)
        *ttft = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return true;
    };
    auto r = c.send(req);
    EXPECT_TRUE(r);
    json usage;
    for (const auto& ch : sse(body))
      if (ch.contains("usage") && ch["usage"].is_object()) usage = ch["usage"];
    return usage;
  };
  double t1 = 0, t2 = 0;
  const json u1 = turn("First question: what builds the project?", &t1);
  const json u2 = turn("First question: what builds the project? And the tests?", &t2);
  ASSERT_TRUE(u1.is_object() && u2.is_object());
  const int64_t p1 = u1["prompt_tokens"], cached2 = u2["prompt_tokens_details"]["cached_tokens"];
  std::printf("turn 1: %lld prompt tokens, ttft %.3f s; turn 2: %lld cached of %lld, ttft %.3f s\n", (long long)p1, t1,
              (long long)cached2, (long long)u2["prompt_tokens"].get<int64_t>(), t2);
  // the shared prefix is everything before the user's text, nearly all of turn 1's prompt
  EXPECT_GE(cached2, p1 * 95 / 100 - 16);
  EXPECT_LT(t2 * 5, t1) << "time to first token on the second turn";
}

// The request log measures how often a client edits an earlier part of a conversation:
// a request that continues a session says how long that session's previous prompt was
// (prev_prompt) and how many of those tokens it shares (prev_common). A follow-up keeps
// the whole previous prompt; an edited system prompt keeps only the tokens before it.
TEST(Server, RequestLogMeasuresEarlierEdits) {
  std::mutex mu;
  std::vector<json> lines;
  auto log = [&](const std::string& l) {
    std::lock_guard<std::mutex> lk(mu);
    if (!l.empty() && l[0] == '{') lines.push_back(json::parse(l));
  };
  {
    SERVE(s, 1, 8192, "", true, log);
    auto c = client(*s);
    const std::string sys = "You are a careful assistant that answers about build systems.";
    auto post = [&](const json& b) {
      auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
      EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
      return r ? json::parse(r->body) : json();
    };
    json b = chat_body("What builds the project?", false, 4, sys);
    const json a1 = post(b);
    ASSERT_TRUE(a1.contains("choices"));
    b["messages"].push_back({{"role", "assistant"}, {"content", a1["choices"][0]["message"]["content"]}});
    b["messages"].push_back({{"role", "user"}, {"content", "And what runs the tests?"}});
    post(b);
    b["messages"][0]["content"] = "You are terse.";
    post(b);
  }
  std::lock_guard<std::mutex> lk(mu);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_FALSE(lines[0].contains("prev_prompt")) << "a cold session continues nothing";
  // the follow-up shares all of the first prompt (up to the session's prompt end: the
  // last prompt token is fed by the first decoding step) ...
  const int64_t p1 = lines[0]["tokens_in"];
  ASSERT_TRUE(lines[1].contains("prev_prompt"));
  EXPECT_EQ(lines[1]["prev_prompt"].get<int64_t>(), p1 - 1);
  EXPECT_EQ(lines[1]["prev_common"], lines[1]["prev_prompt"]);
  // ... the edited system prompt keeps only what precedes the edit, not the two user
  // turns and the answer after it (more than 20 tokens)
  const int64_t p2 = lines[1]["tokens_in"];
  ASSERT_TRUE(lines[2].contains("prev_prompt"));
  EXPECT_EQ(lines[2]["prev_prompt"].get<int64_t>(), p2 - 1);
  EXPECT_LT(lines[2]["prev_common"].get<int64_t>() + 20, p2 - 1);
  EXPECT_LE(lines[2]["tokens_cached"].get<int64_t>(), lines[2]["prev_common"].get<int64_t>());
}

// The client replays the model's answer as text; the server's tokenization of it differs
// from the tokens the model sampled (a random model samples splits the tokenizer would
// merge), and byte-prefix matching (§5.1) keeps the sampled tokens: the second turn's
// cached tokens cover the first prompt and the whole answer, not only the first prompt.
TEST(Server, ReplayedAnswerIsNotPrefilledAgain) {
  std::string sys;
  for (int i = 0; i < 100; ++i) sys += "Every room has its own library. ";
  // both turns on a server with byte-prefix matching (on) or without (off); returns
  // {turn 1 prompt tokens, turn 1 completion tokens, turn 2 cached tokens, whether the
  // answer is plain text}: a random model also samples added tokens (placeholders), which
  // the client's replay turns into plain text, and byte-prefix matching never puts plain
  // text where the session has an added token (test_byte_prefix.cpp)
  auto conversation = [&](bool on, int seed) {
    auto s = serve(2, 16384, "", on);
    if (!s) return std::array<int64_t, 4>{-1, -1, -1, 0};
    auto c = client(*s);
    json msgs = json::array({{{"role", "system"}, {"content", sys}}, {{"role", "user"}, {"content", "Say something."}}});
    auto ask = [&](const json& m) {
      json b = {{"model", "m"}, {"messages", m}, {"max_tokens", 12}, {"temperature", 1.0}, {"seed", seed},
                {"thinking", false}};
      auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
      EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no answer");
      return r ? json::parse(r->body) : json();
    };
    const json a1 = ask(msgs);
    if (!a1.contains("choices")) return std::array<int64_t, 4>{-1, -1, -1, 0};
    const std::string answer = a1["choices"][0]["message"]["content"];
    const bool plain = answer.find("<|") == std::string::npos && answer.find("<｜") == std::string::npos &&
                       answer.find("\xEF\xBF\xBD") == std::string::npos;
    msgs.push_back({{"role", "assistant"}, {"content", answer}});
    msgs.push_back({{"role", "user"}, {"content", "And then?"}});
    const json a2 = ask(msgs);
    return std::array<int64_t, 4>{a1["usage"]["prompt_tokens"].get<int64_t>(),
                                  a1["usage"]["completion_tokens"].get<int64_t>(),
                                  a2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), plain ? 1 : 0};
  };
  int shown = 0;
  for (int seed = 1; seed <= 40 && shown < 2; ++seed) {
    const auto off = conversation(false, seed);
    if (off[0] < 0) GTEST_SKIP() << "golden tokenizer not found or no port";
    if (!off[3]) continue;
    const int64_t kept = off[0] + off[1] - 1;  // the prompt and every sampled token but the last (not fed)
    if (off[2] >= kept) continue;  // (this sample happens to be the canonical split: no contrast)
    const auto on = conversation(true, seed);
    std::printf("seed %d: turn 1 %lld prompt + %lld sampled tokens; turn 2 cached: %lld without byte-prefix "
                "matching, %lld with it\n",
                seed, (long long)off[0], (long long)off[1], (long long)off[2], (long long)on[2]);
    EXPECT_EQ(on[0], off[0]);
    EXPECT_EQ(on[1], off[1]);
    EXPECT_GE(on[2], kept);
    ++shown;
  }
  EXPECT_EQ(shown, 2) << "no sampled answer was a non-canonical split";
}

// 16 concurrent streaming clients x 4 requests all finish, with batched decode steps.
TEST(Server, ConcurrentClientsAllComplete) {
  SERVE(s, 8);
  std::atomic<int> ok{0}, bad{0};
  std::mutex mu;
  std::string first_bad;  // (what the first failed request got)
  std::vector<std::thread> th;
  for (int i = 0; i < 16; ++i)
    th.emplace_back([&, i] {
      auto c = client(*s);
      for (int k = 0; k < 4; ++k) {
        auto r = c.Post("/v1/chat/completions", chat_body("Client " + std::to_string(i) + " request " + std::to_string(k), true, 6).dump(),
                        "application/json");
        bool fin = false;
        if (r && r->status == 200)
          for (const auto& ch : sse(r->body))
            if (ch.contains("choices") && !ch["choices"].empty() && ch["choices"][0]["finish_reason"].is_string()) fin = true;
        (fin ? ok : bad)++;
        if (!fin) {
          std::lock_guard<std::mutex> lk(mu);
          if (first_bad.empty())
            first_bad = "client " + std::to_string(i) + " request " + std::to_string(k) + ": " +
                        (!r ? "no response (" + httplib::to_string(r.error()) + ")"
                            : "status " + std::to_string(r->status) + ": " + r->body.substr(0, 2000));
        }
      }
    });
  for (auto& t : th) t.join();
  EXPECT_EQ(ok.load(), 64) << first_bad;
  EXPECT_EQ(bad.load(), 0);
  auto c = client(*s);
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  auto metric = [&](const std::string& name) {
    const size_t p = m->body.find("\n" + name + " ");
    return p == std::string::npos ? -1.0 : std::stod(m->body.substr(p + name.size() + 2));
  };
  const double steps = metric("dsx_decode_steps_total"), rows = metric("dsx_decode_rows_total");
  std::printf("decode steps %.0f, rows %.0f (%.2f rows per step)\n", steps, rows, rows / std::max(1.0, steps));
  EXPECT_GT(rows, steps) << "concurrent requests never decoded together";
}

// A client that goes away mid-stream frees its session: with one session, the next
// request still completes.
TEST(Server, DisconnectFreesTheSession) {
  SERVE(s, 1);
  {
    auto c = client(*s);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = chat_body("Tell a very long story.", true, 4000).dump();
    req.set_header("Content-Type", "application/json");
    int got = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++got < 3; };  // then hang up
    c.send(req);
  }
  auto c = client(*s);
  c.set_read_timeout(60, 0);
  auto r = c.Post("/v1/chat/completions", chat_body("Say hi.", false, 4).dump(), "application/json");
  ASSERT_TRUE(r) << "the server did not answer after a client went away";
  EXPECT_EQ(r->status, 200);
}

// Bad requests: well-formed 4xx answers in each API's error shape, never a 5xx.
TEST(Server, BadRequestsGetWellFormed4xx) {
  SERVE(s, 2, 512, "sekret");
  auto c = client(*s);
  httplib::Headers auth = {{"Authorization", "Bearer sekret"}};
  auto r = c.Post("/v1/chat/completions", chat_body("hi", false).dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = c.Post("/v1/messages", httplib::Headers{{"x-api-key", "sekret"}}, "{\"model\":", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["type"], "error");
  for (const char* path : {"/v1/chat/completions", "/v1/responses"}) {
    for (const std::string body : {std::string("not json"), std::string("{\"messages\": 3}"), std::string("[]"),
                                   std::string("{\"input\": {\"x\": 1}}")}) {
      r = c.Post(path, auth, body, "application/json");
      ASSERT_TRUE(r);
      EXPECT_GE(r->status, 400) << path << " " << body;
      EXPECT_LT(r->status, 500) << path << " " << body;
      json j = json::parse(r->body);
      EXPECT_TRUE(j.contains("error")) << r->body;
    }
  }
  // a prompt longer than the context
  std::string big;
  for (int i = 0; i < 400; ++i) big += "many words in this prompt ";
  r = c.Post("/v1/chat/completions", auth, chat_body(big, false).dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "context_length_exceeded");
  // a body over the limit
  r = c.Post("/v1/chat/completions", auth, std::string(9 << 20, ' '), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
}

// tool_choice forces a call even from a random model: a parseable call of the named tool
// whose arguments satisfy the schema (the required keys, their types), in every API.
TEST(Server, ForcedToolCallsAreValid) {
  SERVE(s);
  auto c = client(*s);
  json tools = json::array({{{"type", "function"},
                             {"function", {{"name", "bash"}, {"description", "Run a shell command"},
                                           {"parameters", {{"type", "object"},
                                                           {"properties", {{"command", {{"type", "string"}}},
                                                                           {"timeout", {{"type", "integer"}}}}},
                                                           {"required", {"command", "timeout"}}}}}}}});
  for (bool stream : {false, true}) {
    json b = chat_body("List the files.", stream, 200);
    b["tools"] = tools;
    b["tool_choice"] = {{"type", "function"}, {"function", {{"name", "bash"}}}};
    auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    std::string name, args, finish;
    if (!stream) {
      json j = json::parse(r->body);
      finish = j["choices"][0]["finish_reason"];
      ASSERT_TRUE(j["choices"][0]["message"]["tool_calls"].is_array()) << r->body;
      name = j["choices"][0]["message"]["tool_calls"][0]["function"]["name"];
      args = j["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"];
    } else {
      for (const auto& ch : sse(r->body)) {
        if (!ch.contains("choices") || ch["choices"].empty()) continue;
        const json& ch0 = ch["choices"][0];
        if (ch0["finish_reason"].is_string()) finish = ch0["finish_reason"];
        if (ch0["delta"].contains("tool_calls"))
          for (const auto& tc : ch0["delta"]["tool_calls"]) {
            if (tc["function"].contains("name")) name = tc["function"]["name"];
            if (tc["function"].contains("arguments")) args += tc["function"]["arguments"].get<std::string>();
          }
      }
    }
    EXPECT_EQ(finish, "tool_calls") << (stream ? "stream" : "non-stream");
    EXPECT_EQ(name, "bash");
    json a = json::parse(args);
    EXPECT_TRUE(a["command"].is_string()) << args;
    // (a JSON integer of any size: nlohmann reads one beyond 64 bits as a float)
    const size_t at = args.find("\"timeout\": ");
    ASSERT_NE(at, std::string::npos) << args;
    size_t e = at + 11;
    if (e < args.size() && args[e] == '-') ++e;
    const size_t d0 = e;
    while (e < args.size() && std::isdigit(static_cast<unsigned char>(args[e]))) ++e;
    EXPECT_TRUE(e > d0 && e < args.size() && (args[e] == ',' || args[e] == '}')) << args;
    EXPECT_TRUE(a["timeout"].is_number()) << args;
  }
  // Anthropic: tool_choice {type: tool}
  json mb = {{"model", "x"}, {"max_tokens", 200}, {"messages", {{{"role", "user"}, {"content", "Read a file."}}}},
             {"tools", {{{"name", "read"}, {"description", "Read a file"},
                         {"input_schema", {{"type", "object"}, {"properties", {{"path", {{"type", "string"}}}}},
                                           {"required", {"path"}}}}}}},
             {"tool_choice", {{"type", "tool"}, {"name", "read"}}}};
  auto r = c.Post("/v1/messages", mb.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["stop_reason"], "tool_use");
  bool found = false;
  for (const auto& blk : j["content"])
    if (blk["type"] == "tool_use") found = blk["name"] == "read" && blk["input"]["path"].is_string();
  EXPECT_TRUE(found) << r->body;
  // Responses: tool_choice required
  json rb = {{"model", "x"}, {"max_output_tokens", 200}, {"input", "Read a file."}, {"tool_choice", "required"},
             {"tools", {{{"type", "function"}, {"name", "read"}, {"description", "Read a file"},
                         {"parameters", {{"type", "object"}, {"properties", {{"path", {{"type", "string"}}}}},
                                         {"required", {"path"}}}}}}}};
  r = c.Post("/v1/responses", rb.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  j = json::parse(r->body);
  found = false;
  for (const auto& it : j["output"])
    if (it["type"] == "function_call") found = it["name"] == "read" && json::parse(it["arguments"].get<std::string>())["path"].is_string();
  EXPECT_TRUE(found) << r->body;
}
