#include "server/http.h"

#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "server/api_messages.h"
#include "server/api_models.h"
#include "server/signing.h"
#include "util/error.h"

namespace dsx::server {

namespace {

std::string anthropic_error(int status, const std::string& type, const std::string& msg) {
  return nlohmann::json({{"type", "error"}, {"error", {{"type", type}, {"message", msg}}}}).dump();
}
std::string openai_error(const std::string& type, const std::string& msg, const std::string& code = "") {
  nlohmann::json e = {{"message", msg}, {"type", type}, {"param", nullptr}, {"code", code.empty() ? nlohmann::json() : nlohmann::json(code)}};
  return nlohmann::json({{"error", e}}).dump();
}

bool is_anthropic_path(const std::string& p) { return p.rfind("/v1/messages", 0) == 0; }

constexpr int kListenBacklog = 1024;

// fd is a listening socket bound to `port` (the hook's last socket may be one whose bind
// failed and was closed: httplib tries every address of the host).
bool is_listening_on(int fd, int port) {
  int acc = 0;
  socklen_t len = sizeof acc;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) != 0 || !acc) return false;
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) return false;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port) == port;
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port) == port;
  return false;
}

}  // namespace

HttpServer::HttpServer(Engine& eng, const text::Tokenizer& tok, ServeOptions o)
    : eng_(eng), tok_(tok), o_(std::move(o)) {
  ctx_.replay = &replay_;
  // (kept with the disk cache: a restarted server recognises the reasoning it handed out)
  ctx_.secret = o_.scheduler.secret.empty() ? new_secret() : o_.scheduler.secret;
  ctx_.model_id = o_.model_id;
  ctx_.context_tokens = eng_.options().max_context;
  sched_ = std::make_unique<Scheduler>(eng_, tok_, o_.scheduler);
  http_ = std::make_unique<httplib::Server>();
  const int threads = o_.threads;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  // httplib's own options (SO_REUSEADDR), and the listening socket kept: bind() raises
  // its backlog from httplib 0.11's 5 (a burst of connections before the accept loop
  // runs, e.g. agents' parallel requests right after a start, overflowed it: the
  // clients' first requests got their connections dropped, "no response (Read)")
  http_->set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    listen_fd_.store(static_cast<int>(sock));
  });
  routes();
}

HttpServer::~HttpServer() {
  stop();
  sched_.reset();
}

void HttpServer::stop() {
  bool started;
  {
    std::lock_guard<std::mutex> lk(listen_mu_);
    stop_requested_ = true;
    started = listen_started_;
  }
  if (http_ && started) {
    // the accept loop may be starting: httplib's stop() only ends a running one
    while (!http_->is_running() && !listen_returned_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    http_->stop();
  }
  if (sched_) sched_->shutdown();
}

bool HttpServer::bind() {
  if (o_.port == 0) {
    bound_port_ = http_->bind_to_any_port(o_.host.c_str());
    if (bound_port_ <= 0) return false;
  } else {
    if (!http_->bind_to_port(o_.host.c_str(), o_.port)) return false;
    bound_port_ = o_.port;
  }
  // (listen() again on a listening socket sets its backlog; the kernel caps it at somaxconn)
  if (const int fd = listen_fd_.load(); fd >= 0 && is_listening_on(fd, bound_port_)) ::listen(fd, kListenBacklog);
  return true;
}

void HttpServer::listen_after_bind() {
  {
    std::lock_guard<std::mutex> lk(listen_mu_);
    if (stop_requested_) return;  // (stopped before it started)
    listen_started_ = true;
  }
  http_->listen_after_bind();
  listen_returned_.store(true);
}

void HttpServer::listen() {
  if (!bind()) fail("cannot listen on ", o_.host, ":", o_.port, " (address in use or not available?)");
  listen_after_bind();
}

std::string HttpServer::metrics_text() const {
  const SchedulerStats s = sched_->stats();
  const StateFootprint& f = s.footprint;  // (the worker's: the engine is not read from here)
  std::string m;
  auto line = [&](const char* name, const char* type, const char* help, double v) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
    m += buf;
  };
  line("dsx_http_requests_total", "counter", "HTTP requests received", static_cast<double>(http_requests_.load()));
  line("dsx_http_errors_total", "counter", "HTTP requests answered with an error", static_cast<double>(http_errors_.load()));
  line("dsx_requests_total", "counter", "generation requests queued", static_cast<double>(s.requests));
  line("dsx_requests_finished_total", "counter", "generation requests finished", static_cast<double>(s.finished));
  line("dsx_requests_cancelled_total", "counter", "generation requests whose client went away",
       static_cast<double>(s.cancelled));
  line("dsx_requests_failed_total", "counter", "generation requests failed by the engine", static_cast<double>(s.failed));
  line("dsx_prompt_tokens_total", "counter", "prompt tokens of finished requests", static_cast<double>(s.prompt_tokens));
  line("dsx_cached_prompt_tokens_total", "counter", "prompt tokens served from a kept state (prefix cache hits)",
       static_cast<double>(s.cached_tokens));
  line("dsx_generated_tokens_total", "counter", "tokens generated", static_cast<double>(s.generated_tokens));
  line("dsx_prefill_tokens_total", "counter", "prompt tokens computed", static_cast<double>(s.prefill_tokens));
  line("dsx_prefill_seconds_total", "counter", "time spent in prefill", s.prefill_seconds);
  line("dsx_decode_steps_total", "counter",
       "decode steps (every decoding request's rows in one step: one, or a DSpark block of 1 + k)",
       static_cast<double>(s.decode_steps));
  line("dsx_decode_rows_total", "counter", "rows over the decode steps", static_cast<double>(s.decode_rows));
  if (o_.scheduler.drafter) {
    auto d = [](int64_t v) { return static_cast<double>(v); };
    const double cy = static_cast<double>(s.dspark_cycles);
    line("dsx_dspark_cycles_total", "counter", "DSpark cycles (one request's block verified: anchor and k drafts)",
         d(s.dspark_cycles));
    line("dsx_dspark_drafts_verified_total", "counter", "DSpark drafts verified (sum of k)", d(s.dspark_verified));
    line("dsx_dspark_drafts_accepted_total", "counter", "DSpark drafts accepted", d(s.dspark_accepted));
    line("dsx_dspark_tokens_total", "counter", "tokens DSpark cycles emitted (accepted drafts and the correction / bonus)",
         d(s.dspark_tokens));
    line("dsx_dspark_accepted_per_cycle", "gauge", "accepted drafts per DSpark cycle (since start)",
         cy > 0 ? s.dspark_accepted / cy : 0.0);
    line("dsx_dspark_tokens_per_cycle", "gauge", "tokens per DSpark cycle (since start)",
         cy > 0 ? s.dspark_tokens / cy : 0.0);
    line("dsx_dspark_mixed_steps_total", "counter",
         "decode steps that verified DSpark blocks beside plain rows (constrained requests)",
         d(s.dspark_mixed_steps));
  }
  line("dsx_decode_step_seconds_total", "counter", "time spent in decode steps", s.decode_step_seconds);
  line("dsx_queue_depth", "gauge", "requests waiting for a session", static_cast<double>(s.queue_depth));
  line("dsx_active_requests", "gauge", "requests prefilling or decoding", static_cast<double>(s.active));
  line("dsx_sessions", "gauge", "resident sessions", static_cast<double>(s.sessions));
  line("dsx_session_state_bytes", "gauge", "bytes of session state held", static_cast<double>(f.used_bytes));
  line("dsx_session_state_budget_bytes", "gauge", "session state budget", static_cast<double>(f.budget_bytes));
  if (DiskCache* c = o_.scheduler.cache) {
    const DiskCacheStats k = c->stats();
    auto d = [](int64_t v) { return static_cast<double>(v); };
    line("dsx_kv_cache_entries", "gauge", "entries in the disk KV cache", d(k.entries));
    line("dsx_kv_cache_bytes", "gauge", "bytes of the disk KV cache's entries", d(k.bytes));
    line("dsx_kv_cache_budget_bytes", "gauge", "the disk KV cache's byte budget (0: none)", d(k.budget_bytes));
    line("dsx_kv_cache_hits_total", "counter", "disk lookups that found a stored prefix", d(k.hits));
    line("dsx_kv_cache_misses_total", "counter", "disk lookups that found none", d(k.misses));
    line("dsx_kv_cache_restores_total", "counter", "sessions restored from disk", d(k.restores));
    line("dsx_kv_cache_restore_failures_total", "counter", "restores refused (bad file, too large)",
         d(k.restore_failures));
    line("dsx_kv_cache_restored_bytes_total", "counter", "bytes read by restores", d(k.restored_bytes));
    line("dsx_kv_cache_restore_seconds_total", "counter", "time spent restoring", k.restore_seconds);
    line("dsx_kv_cache_restored_tokens_total", "counter", "prompt tokens served by disk restores",
         d(s.kv_restored_tokens));
    line("dsx_kv_cache_saves_total", "counter", "entries written", d(k.saves));
    char buf[160];
    const std::pair<const char*, int64_t> reasons[] = {{"cold", s.kv_saves_cold},
                                                       {"continued", s.kv_saves_continued},
                                                       {"evict", s.kv_saves_evict},
                                                       {"shutdown", s.kv_saves_shutdown}};
    m += "# HELP dsx_kv_cache_saves_by_reason_total session states handed to the disk cache, by reason\n"
         "# TYPE dsx_kv_cache_saves_by_reason_total counter\n";
    for (const auto& [r, v] : reasons) {
      std::snprintf(buf, sizeof buf, "dsx_kv_cache_saves_by_reason_total{reason=\"%s\"} %lld\n", r,
                    static_cast<long long>(v));
      m += buf;
    }
    line("dsx_kv_cache_saves_existing_total", "counter", "saves of a state already stored (not rewritten)",
         d(k.save_existing));
    line("dsx_kv_cache_saves_too_large_total", "counter", "saves skipped: larger than the budget allows",
         d(k.save_too_large));
    line("dsx_kv_cache_saves_dropped_total", "counter", "saves skipped: the writer's queue was full",
         d(s.kv_saves_dropped));
    line("dsx_kv_cache_written_bytes_total", "counter", "bytes written by saves", d(k.written_bytes));
    line("dsx_kv_cache_save_seconds_total", "counter", "time spent writing entries (background)", k.save_seconds);
    line("dsx_kv_cache_snapshot_seconds_total", "counter", "time spent serializing states on the engine thread",
         s.kv_snapshot_seconds);
    line("dsx_kv_cache_evictions_total", "counter", "entries evicted to keep the budget", d(k.evictions));
    line("dsx_kv_cache_evicted_bytes_total", "counter", "bytes evicted", d(k.evicted_bytes));
    line("dsx_kv_cache_refused_files_total", "counter", "files refused (corrupt, truncated, old, another model)",
         d(k.refused));
    line("dsx_kv_cache_foreign_files", "gauge", "files of another model or layout (kept, not loaded)",
         d(k.foreign_files));
    line("dsx_kv_cache_write_errors_total", "counter", "background writes that failed", d(k.write_errors));
    line("dsx_kv_cache_pending_writes", "gauge", "entries waiting for the background writer", d(k.pending));
  }
  return m;
}

void HttpServer::routes() {
  httplib::Server& h = *http_;
  h.set_payload_max_length(o_.max_body_bytes);
  h.set_read_timeout(600, 0);
  h.set_write_timeout(600, 0);
  h.set_keep_alive_timeout(30);
  // auth and body size before any route
  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    ++http_requests_;
    if (!o_.api_key.empty() && req.path.rfind("/v1/", 0) == 0) {
      std::string key = req.get_header_value("x-api-key");
      const std::string auth = req.get_header_value("Authorization");
      if (key.empty() && auth.rfind("Bearer ", 0) == 0) key = auth.substr(7);
      if (key != o_.api_key) {
        ++http_errors_;
        res.status = 401;
        if (is_anthropic_path(req.path))
          res.set_content(anthropic_error(401, "authentication_error", "invalid API key"), "application/json");
        else
          res.set_content(openai_error("invalid_request_error", "invalid API key", "invalid_api_key"), "application/json");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  h.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (res.status == 404) {
      ++http_errors_;
      if (is_anthropic_path(req.path))
        res.set_content(anthropic_error(404, "not_found_error", "unknown endpoint " + req.path), "application/json");
      else
        res.set_content(openai_error("invalid_request_error", "unknown endpoint " + req.path), "application/json");
    } else if (res.status == 413) {
      ++http_errors_;
      const std::string msg = cat("request body larger than ", o_.max_body_bytes, " bytes");
      res.set_content(is_anthropic_path(req.path) ? anthropic_error(413, "request_too_large", msg)
                                                  : openai_error("invalid_request_error", msg),
                      "application/json");
    }
  });
  h.set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    ++http_errors_;
    std::string msg = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(is_anthropic_path(req.path) ? anthropic_error(500, "api_error", msg)
                                                : openai_error("server_error", msg),
                    "application/json");
  });

  h.Get("/", [](const httplib::Request&, httplib::Response& res) { res.set_content("dsx\n", "text/plain"); });
  h.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const SchedulerStats s = sched_->stats();
    res.set_content(nlohmann::json({{"status", "ok"}, {"model", o_.model_id}, {"queue_depth", s.queue_depth},
                                    {"active", s.active}, {"sessions", s.sessions}})
                        .dump(),
                    "application/json");
  });
  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
  h.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(models_body(ctx_, ""), "application/json");
  });
  h.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    res.set_content(models_body(ctx_, req.matches[1]), "application/json");
  });
  h.Post("/v1/messages/count_tokens", [this](const httplib::Request& req, httplib::Response& res) {
    GenRequest g;
    ApiError err;
    if (!parse_count_tokens(req.body, ctx_, g, err)) {
      ++http_errors_;
      res.status = err.status;
      res.set_content(messages_adapter().error_body(err), "application/json");
      return;
    }
    try {
      text::RenderOptions ro;
      ro.thinking = g.thinking;
      ro.effort = g.effort.kind == text::Effort::Kind::Default ? o_.default_effort : g.effort;
      ro.tools_enabled = g.tools_enabled;
      ro.context_tokens = ctx_.context_tokens;
      ro.replay = &replay_;
      const auto rendered = text::render_prompt(g.conv, ro);
      const int64_t n = static_cast<int64_t>(text::encode_segments(tok_, rendered.segments).size());
      res.set_content(count_tokens_body(n), "application/json");
    } catch (const Error& e) {
      ++http_errors_;
      res.status = 400;
      res.set_content(messages_adapter().error_body(ApiError{400, "invalid_request_error", e.what(), "", ""}),
                      "application/json");
    }
  });
  struct Route {
    const char* path;
    const Adapter* a;
  };
  for (const Route r : {Route{"/v1/chat/completions", &chat_adapter()}, Route{"/v1/messages", &messages_adapter()},
                        Route{"/v1/responses", &responses_adapter()}}) {
    const Adapter* ad = r.a;
    const char* path = r.path;
    h.Post(path, [this, ad, path](const httplib::Request& req, httplib::Response& res) {
      auto reject = [&](const ApiError& e) {
        ++http_errors_;
        res.status = e.status;
        res.set_content(ad->error_body(e), "application/json");
      };
      GenRequest g;
      ApiError err;
      if (!ad->parse(req.body, ctx_, g, err)) return reject(err);
      if (o_.thinking == "on") g.thinking = true;
      if (o_.thinking == "off") g.thinking = false;
      if (g.session_hint.empty()) g.session_hint = req.get_header_value("x-session-affinity");
      if (g.session_hint.empty()) g.session_hint = req.get_header_value("x-claude-code-session-id");
      // render and tokenize (client text never becomes a control token: encode_segments)
      std::vector<int32_t> ids;
      text::RenderOptions ro;
      try {
        ro.thinking = g.thinking;
        ro.effort = g.effort.kind == text::Effort::Kind::Default ? o_.default_effort : g.effort;
        ro.tools_enabled = g.tools_enabled;
        ro.context_tokens = ctx_.context_tokens;
        ro.replay = &replay_;
        const auto rendered = text::render_prompt(g.conv, ro);
        ids = text::encode_segments(tok_, rendered.segments);
      } catch (const Error& e) {
        return reject(ApiError{400, "invalid_request_error", e.what(), "", ""});
      }
      const int64_t ctx = ctx_.context_tokens, n = static_cast<int64_t>(ids.size());
      if (n == 0) return reject(ApiError{400, "invalid_request_error", "the request renders to an empty prompt", "", ""});
      if (n >= ctx)
        return reject(ApiError{400, "invalid_request_error",
                               cat("the prompt has ", n, " tokens; this server's context is ", ctx, " tokens"),
                               "context_length_exceeded", "messages"});
      if (g.max_tokens > ctx)
        return reject(ApiError{400, "invalid_request_error",
                               cat("max_tokens ", g.max_tokens, " exceeds this server's context of ", ctx, " tokens"),
                               "", "max_tokens"});
      auto job = std::make_shared<Job>();
      job->id = cat("req_", next_id_++);
      job->api = path;
      job->prompt = std::move(ids);
      job->max_tokens = std::max<int64_t>(1, std::min<int64_t>(g.max_tokens > 0 ? g.max_tokens : ctx, ctx - n));
      if (o_.max_output > 0) job->max_tokens = std::min(job->max_tokens, o_.max_output);
      job->sampling = g.sampling;
      job->session_hint = g.session_hint;
      text::ParserOptions po;
      po.profile = ro.profile;
      po.thinking = g.thinking;
      po.tools_enabled = g.tools_enabled && !g.conv.tools.empty();
      po.tools = g.conv.tools;
      po.stop = g.stop;
      po.id_prefix = g.id_prefix;
      po.replay = &replay_;
      job->parser = std::move(po);
      // tool_choice required / named and response_format: constrained decoding
      try {
        const bool forced = g.tools_enabled && !g.conv.tools.empty() && g.tool_choice != "auto" && g.tool_choice != "none";
        // (the reasoning gets at most a quarter of the output budget and a string value an
        // eighth, so that the call fits)
        ConstraintLimits lim;
        lim.max_reasoning_tokens = static_cast<int>(std::min<int64_t>(lim.max_reasoning_tokens, job->max_tokens / 4));
        lim.max_string_tokens = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(lim.max_string_tokens, job->max_tokens / 8)));
        if (forced)
          job->constraint = tool_call_constraint(tok_, g.conv.tools, g.tool_choice, ro.profile, g.thinking, lim);
        else if (g.response_format)
          job->constraint = json_constraint(tok_, *g.response_format, g.thinking, lim);
        else if (o_.lazy_tool_grammar && g.tools_enabled && !g.conv.tools.empty() && g.tool_choice == "auto") {
          // (no string / item caps: a call the model writes validly is never cut short)
          ConstraintLimits lazy;
          lazy.max_string_tokens = static_cast<int>(std::min<int64_t>(job->max_tokens, 1 << 30));
          lazy.max_items = 1 << 20;
          lazy.max_number_chars = 64;
          job->constraint = lazy_tool_constraint(tok_, g.conv.tools, ro.profile, g.thinking, lazy);
        }
      } catch (const Error& e) {
        return reject(ApiError{400, "invalid_request_error", e.what(), "", ""});
      }
      auto ch = std::make_shared<Channel>();
      job->sink = ad->make_sink(g, ctx_, ch);
      if (!sched_->submit(job))
        return reject(ApiError{503, "server_error", "the server is shutting down or its queue is full", "", ""});
      if (g.stream) {
        // the status is decided by the sink's first bytes: an error before anything was
        // streamed (the sink set a status) is answered as a plain JSON error
        while (!ch->wait_ready(std::chrono::milliseconds(1000))) {
        }
        if (ch->status() != 200) {
          while (!ch->wait_closed(std::chrono::milliseconds(1000))) {
          }
          ++http_errors_;
          res.status = ch->status();
          res.set_content(ch->drain(), ch->content_type());
          return;
        }
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream",
            [ch](size_t, httplib::DataSink& sink) {
              std::string s;
              for (;;) {
                if (sink.is_writable && !sink.is_writable()) {
                  ch->cancel();
                  return false;
                }
                if (ch->pop(s, std::chrono::milliseconds(500))) {
                  if (!sink.write(s.data(), s.size())) {
                    ch->cancel();
                    return false;
                  }
                  return true;
                }
                if (ch->done()) {
                  sink.done();
                  return true;
                }
              }
            },
            [ch](bool ok) {
              if (!ok) ch->cancel();
            });
      } else {
        while (!ch->wait_closed(std::chrono::milliseconds(1000))) {
        }
        res.status = ch->status();
        res.set_content(ch->drain(), ch->content_type());
        if (res.status >= 400) ++http_errors_;
      }
    });
  }
}

}  // namespace dsx::server
