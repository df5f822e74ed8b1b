// `dsx serve`'s HTTP front: routes (the three chat APIs, count_tokens, models, health,
// metrics), API-key check, body limit, rendering and tokenization of a request's
// conversation, the job it hands to the scheduler, and the answer: an SSE stream
// drained from the job's Channel while it runs, or the one JSON body. Built on
// cpp-httplib (one thread per connection from its pool); loopback by default.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/engine.h"
#include "server/adapters.h"
#include "server/scheduler.h"
#include "text/dsml.h"
#include "text/tokenizer.h"

namespace httplib {
class Server;
}

namespace dsx::server {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;               // empty: any key (or none) is accepted
  size_t max_body_bytes = size_t{8} << 20;
  std::string model_id = "deepseek-v4.1-flash";
  text::Effort default_effort;       // Default: the renderer's default (high)
  int threads = 32;                  // HTTP worker threads (concurrent connections)
  std::string thinking = "auto";     // auto: as each request asks; on / off: the operator decides
  int64_t max_output = 0;            // > 0: at most this many generated tokens per request
  bool lazy_tool_grammar = true;     // tool_choice auto: constrain a tool-call block once the model opens one
  SchedulerOptions scheduler;
};

class HttpServer {
 public:
  HttpServer(Engine& eng, const text::Tokenizer& tok, ServeOptions o);
  ~HttpServer();
  // Binds (throws dsx::Error naming the address when it cannot) and serves until stop().
  void listen();
  int port() const { return bound_port_; }  // (after bind: the port, also when 0 was asked)
  // Stops accepting, lets running jobs finish, returns from listen(). Thread-safe.
  void stop();
  bool bind();  // binds only (tests: then listen_after_bind()); false when it cannot
  void listen_after_bind();
  std::string metrics_text() const;  // (what GET /metrics answers)

 private:
  void routes();

  Engine& eng_;
  const text::Tokenizer& tok_;
  ServeOptions o_;
  text::ReplayMap replay_;
  AdapterContext ctx_;
  std::unique_ptr<Scheduler> sched_;
  std::unique_ptr<httplib::Server> http_;
  int bound_port_ = 0;
  std::atomic<int> listen_fd_{-1};  // the listening socket (set by httplib's socket-options hook)
  std::atomic<int64_t> http_requests_{0}, http_errors_{0}, next_id_{1};
  // stop() before, during or after the start of listen_after_bind() (httplib's own stop()
  // does nothing before its accept loop runs, which then never ends)
  std::mutex listen_mu_;
  bool stop_requested_ = false, listen_started_ = false;
  std::atomic<bool> listen_returned_{false};
};

}  // namespace dsx::server
