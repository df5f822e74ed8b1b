// DSpark speculative decoding inside `dsx serve` (issues 27 + 25), end to end over HTTP on
// the CPU engine and the trained model assets/dsx-small-v41 (3 draft stages; its drafts
// are accepted often, ~2.75 tokens per cycle on code): a server with --dspark on against
// one with --dspark off (the same engine code, plain decoding):
//   - greedy: several prompts answer byte for byte the same (text, finish reason, token
//     counts), streaming and not; concurrent clients whose rows share steps (a request
//     under response_format decodes plain rows beside the others' DSpark blocks); stop
//     strings and max_tokens that end a request inside an accepted block; a follow-up
//     turn that reuses the prefix (the session and the drafter's rings kept across
//     requests, rolled back to exactly the emitted tokens);
//   - sampling (T > 0): requests complete, and a seed reproduces the answer, alone or
//     decoding beside other requests;
//   - the lazy tool grammar: a tool call opened inside a DSpark block is constrained from
//     the next token on (the answer equals the plain server's) and validates;
//   - /metrics and the request log report accepted drafts and tokens per cycle; the
//     default rule (cli/dspark_option.h) turns DSpark on for the CPU engine (the CUDA
//     engine: CudaDSpark.DefaultIsOnForTheCudaEngine).
#ifdef DSX_HAVE_HTTP
#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT
#endif
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "cache/disk_cache.h"
#include "cli/dspark_option.h"
#include "runtime/engine.h"
#include "server/http.h"
#include "test_util.h"
#include "test_watchdog.h"
#include "text/tokenizer.h"

using namespace dsx;
using nlohmann::json;

namespace {

const std::string kModel = dsx_test::source_dir() + "/assets/dsx-small-v41";

struct Log {
  std::mutex mu;
  std::vector<std::string> lines;
  std::vector<json> requests() {
    std::lock_guard<std::mutex> g(mu);
    std::vector<json> v;
    for (const auto& l : lines) {
      json j = json::parse(l, nullptr, false);
      if (j.is_object() && j.contains("finish")) v.push_back(j);
    }
    return v;
  }
};

// A `dsx serve -m assets/dsx-small-v41 --thinking off --no-kv-cache --dspark on|off` in
// this process, on an ephemeral loopback port.
struct Server {
  std::unique_ptr<text::Tokenizer> tok;
  std::unique_ptr<Engine> eng;
  cli::DSparkSetup ds;
  std::unique_ptr<DiskCache> cache;  // (outlives the scheduler, which saves into it when it stops)
  std::unique_ptr<server::HttpServer> srv;
  std::thread th;
  int port = 0;
  Log log;

  // kv_dir: a disk KV cache there with small save intervals (64-token entries, continued
  // saves every 96 tokens), else none.
  Server(bool dspark, int sessions, const std::string& kv_dir = "") {
    tok = std::make_unique<text::Tokenizer>(text::Tokenizer::from_model_dir(kModel));
    EngineOptions o;
    o.max_context = 8192;
    eng = load_engine(kModel, o);
    server::ServeOptions so;
    so.port = 0;
    so.thinking = "off";
    so.scheduler.max_sessions = sessions;
    so.scheduler.keepalive_seconds = 1;
    so.scheduler.log = [this](const std::string& l) {
      std::lock_guard<std::mutex> g(log.mu);
      log.lines.push_back(l);
    };
    if (!kv_dir.empty()) {
      DiskCacheOptions co;
      co.log = so.scheduler.log;
      cache = DiskCache::open(kv_dir, int64_t{1} << 30, eng->state_identity(), co);
      so.scheduler.cache = cache.get();
      so.scheduler.kv.min_tokens = 64;
      so.scheduler.kv.continued_interval = 96;
    }
    ds = cli::setup_dspark(cli::parse_dspark(dspark ? "on" : "off"), kModel, *eng);
    if (dspark) {
      if (!ds.strategy) throw std::runtime_error("the trained model has no DSpark stages");
      so.scheduler.drafter = ds.drafter.get();
      so.scheduler.dspark = ds.strategy->options();
    }
    srv = std::make_unique<server::HttpServer>(*eng, *tok, so);
    if (!srv->bind()) throw std::runtime_error("no port");
    port = srv->port();
    server::HttpServer* p = srv.get();
    th = std::thread([p] { p->listen_after_bind(); });
  }
  ~Server() {
    srv->stop();
    if (th.joinable()) th.join();
    srv.reset();
    cache.reset();
  }

  json post(const json& body, const std::string& path = "/v1/chat/completions") const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(600, 0);
    auto r = c.Post(path, body.dump(), "application/json");
    if (!r) return json{{"http_error", httplib::to_string(r.error())}};
    if (r->status != 200) return json{{"http_status", r->status}, {"body", r->body}};
    return json::parse(r->body);
  }
  // A streaming chat completion: its content deltas concatenated, and its finish reason.
  std::pair<std::string, std::string> stream(json body) const {
    body["stream"] = true;
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(600, 0);
    auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
    if (!r || r->status != 200) return {"<http error>", ""};
    std::string text, finish;
    size_t p = 0;
    const std::string& b = r->body;
    while (p < b.size()) {
      size_t e = b.find('\n', p);
      if (e == std::string::npos) e = b.size();
      const std::string line = b.substr(p, e - p);
      p = e + 1;
      if (line.rfind("data: ", 0) != 0 || line == "data: [DONE]") continue;
      const json ch = json::parse(line.substr(6));
      if (!ch.contains("choices") || ch["choices"].empty()) continue;
      const json& c0 = ch["choices"][0];
      if (c0["delta"].contains("content") && c0["delta"]["content"].is_string())
        text += c0["delta"]["content"].get<std::string>();
      if (c0["finish_reason"].is_string()) finish = c0["finish_reason"];
    }
    return {text, finish};
  }
  // What the server holds (for a watchdog's report): its request log and its metrics.
  std::string report(const char* name) {
    std::string r = cat("--- server ", name, ": request log\n");
    {
      std::lock_guard<std::mutex> g(log.mu);
      for (const auto& l : log.lines) r += l + "\n";
    }
    return r + cat("--- server ", name, ": metrics\n", srv->metrics_text());
  }
  double metric(const std::string& name) const {
    httplib::Client c("127.0.0.1", port);
    auto r = c.Get("/metrics");
    if (!r) return -1;
    const size_t p = r->body.find("\n" + name + " ");
    return p == std::string::npos ? -1 : std::stod(r->body.substr(p + name.size() + 2));
  }
};

bool have_model() { return std::filesystem::exists(kModel + "/model.safetensors"); }

#define NEED_MODEL() \
  if (!have_model()) GTEST_SKIP() << "no trained model at " << kModel

json chat(const json& messages, int max_tokens, double temperature = 0) {
  return {{"model", "dsx"}, {"messages", messages}, {"max_tokens", max_tokens}, {"temperature", temperature}};
}
json user(const std::string& text) { return json::array({{{"role", "user"}, {"content", text}}}); }

// What a chat completion answered: content, finish reason, completion tokens.
struct Answer {
  std::string content, finish;
  int64_t tokens = -1, cached = -1, prompt = -1;
  json tool_calls;
  bool operator==(const Answer& o) const {
    return content == o.content && finish == o.finish && tokens == o.tokens && tool_calls == o.tool_calls;
  }
};
Answer answer(const json& r) {
  Answer a;
  if (!r.contains("choices")) {
    a.content = "<error " + r.dump() + ">";
    return a;
  }
  const json& m = r["choices"][0]["message"];
  a.content = m.contains("content") && m["content"].is_string() ? m["content"].get<std::string>() : "";
  a.finish = r["choices"][0]["finish_reason"].is_string() ? r["choices"][0]["finish_reason"].get<std::string>() : "";
  a.tokens = r["usage"]["completion_tokens"].get<int64_t>();
  a.prompt = r["usage"]["prompt_tokens"].get<int64_t>();
  if (r["usage"].contains("prompt_tokens_details"))
    a.cached = r["usage"]["prompt_tokens_details"].value("cached_tokens", int64_t{-1});
  if (m.contains("tool_calls")) {
    a.tool_calls = m["tool_calls"];
    for (auto& c : a.tool_calls) c.erase("id");  // (fresh per request)
  }
  return a;
}
std::ostream& operator<<(std::ostream& os, const Answer& a) {
  return os << "[" << a.finish << ", " << a.tokens << " tokens] " << a.content << " " << a.tool_calls.dump();
}

const std::vector<std::string> kPrompts = {
    "Write a Python function that returns the n-th Fibonacci number.",
    "def is_prime(n):\n    \"\"\"Return True when n is prime.\"\"\"",
    "Explain in two sentences what a hash map is.",
    "Write a Python class Stack with push, pop and peek methods.",
    "import os\n\ndef list_files(path):",
};

}  // namespace

// Greedy answers with DSpark equal plain decoding's byte for byte, streaming and not;
// DSpark really drafted and drafts were accepted (/metrics).
TEST(ServerDSpark, GreedyEqualsPlain) {
  NEED_MODEL();
  Server a(true, 4), b(false, 4);
  const double cycles0 = a.metric("dsx_dspark_cycles_total"), acc0 = a.metric("dsx_dspark_drafts_accepted_total");
  int64_t total = 0;
  for (const std::string& p : kPrompts) {
    const json body = chat(user(p), 160);
    const Answer x = answer(a.post(body)), y = answer(b.post(body));
    EXPECT_EQ(x, y) << p;
    EXPECT_GT(x.tokens, 0) << x;
    total += x.tokens;
    const auto [st, fin] = a.stream(body);
    EXPECT_EQ(st, y.content) << "streamed, " << p;
    EXPECT_EQ(fin, y.finish) << "streamed, " << p;
  }
  const double cycles = a.metric("dsx_dspark_cycles_total") - cycles0;
  const double acc = a.metric("dsx_dspark_drafts_accepted_total") - acc0;
  std::printf("%lld tokens equal; %.0f cycles, %.3f accepted drafts per cycle; tokens per cycle (since start) %.3f\n",
              static_cast<long long>(total), cycles, acc / cycles, a.metric("dsx_dspark_tokens_per_cycle"));
  EXPECT_GT(cycles, 0);
  EXPECT_GT(acc, cycles * 0.5) << "the trained model's drafts are accepted";
  EXPECT_EQ(b.metric("dsx_dspark_cycles_total"), -1) << "the plain server reports no DSpark";
}

// max_tokens and stop strings ending a request inside an accepted block: the answer is
// plain decoding's; a follow-up turn on the same session (the session and the rings
// rolled back to exactly the emitted tokens) answers as the plain server's too.
TEST(ServerDSpark, StopsInsideBlocksAndFollowUps) {
  NEED_MODEL();
  Server a(true, 4), b(false, 4);
  const json msgs = user(kPrompts[0]);
  const Answer ref = answer(b.post(chat(msgs, 40)));
  ASSERT_EQ(ref.tokens, 40) << ref;
  for (int n = 1; n <= 14; ++n) {
    const json body = chat(msgs, n);
    EXPECT_EQ(answer(a.post(body)), answer(b.post(body))) << "max_tokens " << n;
  }
  // stop strings: pieces of the reference answer at several places (mid-token too)
  std::set<std::string> stops;
  for (size_t at : {3u, 7u, 12u, 20u, 33u, 47u, 60u})
    if (at + 3 <= ref.content.size()) stops.insert(ref.content.substr(at, 3));
  ASSERT_GE(stops.size(), 4u) << ref;
  for (const std::string& s : stops) {
    json body = chat(msgs, 40);
    body["stop"] = s;
    const Answer x = answer(a.post(body)), y = answer(b.post(body));
    EXPECT_EQ(x, y) << "stop '" << s << "'";
    EXPECT_EQ(y.finish, "stop") << "stop '" << s << "'";
    // the next turn resends the answer and asks more: the kept session serves it
    json next = msgs;
    next.push_back({{"role", "assistant"}, {"content", y.content}});
    next.push_back({{"role", "user"}, {"content", "Now add a docstring."}});
    const Answer x2 = answer(a.post(chat(next, 48))), y2 = answer(b.post(chat(next, 48)));
    EXPECT_EQ(x2, y2) << "follow-up after stop '" << s << "'";
    EXPECT_GT(x2.cached, 0) << "the follow-up reuses the prefix";
  }
}

// Concurrent clients: greedy DSpark requests, a response_format request (plain rows beside
// the blocks in the same steps) and sampled ones; the greedy and constrained answers
// equal the plain server's, the sampled ones their own answers alone.
TEST(ServerDSpark, ConcurrentMixedRows) {
  NEED_MODEL();
  Server a(true, 4), b(false, 4);
  // (alone ~11 s on the 2-core machine; CI once saw it pass ctest's 600 s silently)
  dsx_test::Watchdog dog(300, [&] { return a.report("a (dspark)") + b.report("b (plain)"); });
  const json schema = {{"type", "object"},
                       {"properties", {{"name", {{"type", "string"}}}, {"age", {{"type", "integer"}}}}},
                       {"required", {"name", "age"}}};
  std::vector<json> bodies = {chat(user(kPrompts[0]), 120), chat(user(kPrompts[3]), 120),
                              chat(user("Describe a person as JSON."), 120)};
  bodies[2]["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "person"}, {"schema", schema}}}};
  json s1 = chat(user(kPrompts[1]), 100, 0.8), s2 = chat(user(kPrompts[4]), 100, 1.0);
  s1["seed"] = 7;
  s1["top_p"] = 0.9;
  s2["seed"] = 11;
  bodies.push_back(s1);
  bodies.push_back(s2);
  std::vector<Answer> alone;
  for (size_t i = 0; i < bodies.size(); ++i) alone.push_back(answer((i < 3 ? b : a).post(bodies[i])));
  const double mixed0 = a.metric("dsx_dspark_mixed_steps_total");
  for (int round = 0; round < 2; ++round) {
    std::vector<Answer> got(bodies.size());
    std::vector<std::thread> th;
    for (size_t i = 0; i < bodies.size(); ++i) th.emplace_back([&, i] { got[i] = answer(a.post(bodies[i])); });
    for (auto& t : th) t.join();
    for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(got[i], alone[i]) << "request " << i << ", round " << round;
  }
  const json js = json::parse(alone[2].content, nullptr, false);
  EXPECT_TRUE(js.is_object() && js.contains("name") && js["age"].is_number_integer()) << alone[2];
  for (size_t i = 3; i < bodies.size(); ++i) EXPECT_GT(alone[i].tokens, 0) << alone[i];
  EXPECT_GT(a.metric("dsx_dspark_mixed_steps_total"), mixed0) << "a constrained row decoded beside DSpark blocks";
}

// T > 0: exact speculative sampling with the request's seed: the same seed answers the
// same, other seeds answer (almost surely) otherwise, every answer completes.
TEST(ServerDSpark, SampledRequestsReproduceWithASeed) {
  NEED_MODEL();
  Server a(true, 4);
  std::set<std::string> distinct;
  for (uint64_t seed : {1u, 2u, 3u}) {
    json body = chat(user(kPrompts[2]), 64, 0.9);
    body["seed"] = seed;
    body["top_k"] = 40;
    const Answer x = answer(a.post(body)), y = answer(a.post(body));
    EXPECT_EQ(x, y) << "seed " << seed;
    EXPECT_TRUE(x.finish == "stop" || x.finish == "length") << x;
    distinct.insert(x.content);
  }
  EXPECT_GE(distinct.size(), 2u) << "different seeds sample different answers";
}

// tool_choice auto with tools: the lazy tool grammar turns active inside a DSpark block
// (the trained model calls a tool whenever tools are listed); from the next token on
// the call is constrained: the answer equals the plain server's and the call validates.
TEST(ServerDSpark, LazyToolGrammarCallsValidate) {
  NEED_MODEL();
  Server a(true, 4), b(false, 4);
  const json tools = json::array(
      {{{"type", "function"},
        {"function",
         {{"name", "read_file"},
          {"description", "Read a file of the repository."},
          {"parameters",
           {{"type", "object"}, {"properties", {{"path", {{"type", "string"}}}}}, {"required", {"path"}}}}}}},
       {{"type", "function"},
        {"function",
         {{"name", "run_command"},
          {"description", "Run a shell command."},
          {"parameters",
           {{"type", "object"},
            {"properties", {{"command", {{"type", "string"}}}, {"timeout", {{"type", "integer"}}}}},
            {"required", {"command"}}}}}}}});
  int calls = 0;
  for (const char* ask : {"Show me the contents of README.md.", "Run the tests with make test.",
                          "What files are in the src directory?"}) {
    json body = chat(user(ask), 120);
    body["tools"] = tools;
    const Answer x = answer(a.post(body)), y = answer(b.post(body));
    EXPECT_EQ(x, y) << ask;
    for (const json& c : x.tool_calls) {
      const std::string name = c["function"]["name"];
      EXPECT_TRUE(name == "read_file" || name == "run_command") << name;
      const json args = json::parse(c["function"]["arguments"].get<std::string>(), nullptr, false);
      ASSERT_TRUE(args.is_object()) << c.dump();
      EXPECT_TRUE(args.contains(name == "read_file" ? "path" : "command")) << c.dump();
      ++calls;
    }
  }
  EXPECT_GT(calls, 0) << "the trained model calls a tool on these prompts";
}

// With the disk KV cache: continued saves land on their positions inside DSpark decoding
// (a block never steps over one), and a restarted server restores the conversation from
// disk (the rings then have holes: lossless) and answers as a plain cache-less server.
TEST(ServerDSpark, DiskCacheRestoresAndContinuedSaves) {
  NEED_MODEL();
  const std::string dir = dsx_test::temp_dir("server_dspark_kv");
  std::filesystem::remove_all(dir);
  Server b(false, 1);
  json msgs = user(kPrompts[3] + " Use a Python list to hold the items, and raise IndexError on an empty stack.");
  Answer x1;
  {
    Server a(true, 1, dir);
    x1 = answer(a.post(chat(msgs, 240)));
    EXPECT_EQ(x1, answer(b.post(chat(msgs, 240))));
    const double cont = a.metric("dsx_kv_cache_saves_by_reason_total{reason=\"continued\"}");
    std::printf("turn 1: %lld prompt tokens, %lld out; continued saves %.0f, DSpark %.3f tokens per cycle\n",
                static_cast<long long>(x1.prompt), static_cast<long long>(x1.tokens), cont,
                a.metric("dsx_dspark_tokens_per_cycle"));
    // (the session ends at position prompt + tokens - 1: at or past 96, a continued save
    // point the decode reached, when the prompt is shorter)
    ASSERT_LT(x1.prompt, 96);
    ASSERT_GE(x1.prompt + x1.tokens - 1, 96) << "the answer is long enough to reach the save point";
    EXPECT_EQ(cont, 1) << "the decode landed on the continued-save position 96";
  }  // (stops: the resident session is saved)
  msgs.push_back({{"role", "assistant"}, {"content", x1.content}});
  msgs.push_back({{"role", "user"}, {"content", "Add a method size()."}});
  Server a2(true, 1, dir);
  const Answer x2 = answer(a2.post(chat(msgs, 96)));
  EXPECT_EQ(x2, answer(b.post(chat(msgs, 96))));
  EXPECT_GE(a2.metric("dsx_kv_cache_restores_total"), 1);
  EXPECT_GT(x2.cached, 64) << "the second turn came from disk";
  std::filesystem::remove_all(dir);
}

// The request log line and /metrics say what DSpark did.
TEST(ServerDSpark, MetricsAndRequestLog) {
  NEED_MODEL();
  Server a(true, 4);
  const Answer x = answer(a.post(chat(user(kPrompts[4]), 64)));
  ASSERT_GT(x.tokens, 0);
  // (the line is written right after the answer is handed to the client)
  std::vector<json> req;
  for (int i = 0; i < 200 && req.empty(); ++i) {
    req = a.log.requests();
    if (req.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(req.empty());
  const json& l = req.back();
  ASSERT_TRUE(l.contains("dspark_cycles")) << l.dump();
  const double cy = l["dspark_cycles"], tpc = l["tokens_per_cycle"], apc = l["accepted_per_cycle"];
  EXPECT_NEAR(tpc * cy, static_cast<double>(x.tokens), 0.01 * cy + 1e-9) << l.dump();
  EXPECT_GE(tpc, 1.0);
  EXPECT_GE(apc, tpc - 1.0 - 1e-3);  // (a cycle emits at most its accepted drafts and one more)
  for (const char* m : {"dsx_dspark_cycles_total", "dsx_dspark_drafts_verified_total", "dsx_dspark_drafts_accepted_total",
                        "dsx_dspark_tokens_total", "dsx_dspark_accepted_per_cycle", "dsx_dspark_tokens_per_cycle"})
    EXPECT_GE(a.metric(m), 0) << m;
  EXPECT_LE(a.metric("dsx_dspark_drafts_accepted_total"), a.metric("dsx_dspark_drafts_verified_total"));
}

// The default rule (one place: cli/dspark_option.h): on when the model has stages (here
// the CPU engine).
TEST(ServerDSpark, DefaultIsOnForTheCpuEngine) {
  NEED_MODEL();
  Server a(true, 4);
  const cli::DSparkSetup d = cli::setup_dspark(cli::DSparkChoice{}, kModel, *a.eng);
  ASSERT_TRUE(d.strategy);
  EXPECT_EQ(d.name, "on");
  const cli::DSparkSetup s = cli::setup_dspark(cli::parse_dspark("static 3"), kModel, *a.eng);
  ASSERT_TRUE(s.strategy);
  EXPECT_EQ(s.strategy->options().schedule.static_k, 3);
}

// /metrics read without pause while clients decode: the state figures are the worker's
// (an HTTP thread that read the engine's sessions raced with their checkpoints: about one
// run in thirty of these tests crashed or hung), and they are published.
TEST(ServerDSpark, MetricsWhileDecodingAreSafe) {
  NEED_MODEL();
  Server a(true, 2);
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, bad{0}, ok{0};
  std::thread m([&] {
    httplib::Client c("127.0.0.1", a.port);
    while (!stop.load()) {
      auto r = c.Get("/metrics");
      if (!r || r->status != 200 || r->body.find("\ndsx_session_state_bytes ") == std::string::npos) ++bad;
      ++reads;
    }
  });
  std::vector<std::thread> clients;
  for (int k = 0; k < 2; ++k)
    clients.emplace_back([&, k] {
      for (int i = 0; i < 3; ++i)
        if (answer(a.post(chat(user(kPrompts[(2 * k + i) % kPrompts.size()]), 48))).tokens > 0) ++ok;
    });
  for (auto& t : clients) t.join();
  stop.store(true);
  m.join();
  EXPECT_EQ(ok.load(), 6);
  EXPECT_EQ(bad.load(), 0) << "of " << reads.load() << " reads";
  EXPECT_GT(reads.load(), 10);
  EXPECT_GT(a.metric("dsx_session_state_bytes"), 0) << "the worker publishes its sessions' state";
}

// stop() at any moment of the start, also before the accept loop runs (httplib's own
// stop() does nothing then, and the loop never ended: a test that made no request, or a
// SIGTERM right after the start, hung in join / listen forever).
TEST(ServerDSpark, StopRightAfterTheStartReturns) {
  NEED_MODEL();
  const text::Tokenizer tok = text::Tokenizer::from_model_dir(kModel);
  EngineOptions o;
  o.max_context = 1024;
  auto eng = load_engine(kModel, o);
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 600 && !finished.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!finished.load()) {
      std::fprintf(stderr, "ServerDSpark.StopRightAfterTheStartReturns: a stopped server did not return in 60 s\n");
      std::_Exit(1);
    }
  });
  for (int i = 0; i < 100; ++i) {
    server::ServeOptions so;
    so.port = 0;
    so.scheduler.log = [](const std::string&) {};
    server::HttpServer srv(*eng, tok, so);
    ASSERT_TRUE(srv.bind());
    std::thread th([&] { srv.listen_after_bind(); });
    if (i % 4 == 1) std::this_thread::sleep_for(std::chrono::microseconds(50 * i));  // (also mid-start)
    if (i % 4 == 3) srv.stop();  // (before the thread may even run)
    srv.stop();
    th.join();
  }
  finished.store(true);
  watchdog.join();
}

#endif  // DSX_HAVE_HTTP
