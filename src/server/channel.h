// A one-way queue of response bytes from the scheduler's thread (a Sink writing SSE
// events or the final JSON) to an HTTP connection's thread, which writes them out.
// The reader may cancel (the client went away); the writer closes it when done. For a
// non-streaming answer the writer sets the status and content type before closing.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>

namespace dsx::server {

class Channel {
 public:
  // Appends bytes (dropped once the reader cancelled).
  void push(std::string s) {
    std::lock_guard<std::mutex> lk(mu_);
    if (cancelled_ || closed_) return;
    q_.push_back(std::move(s));
    cv_.notify_all();
  }
  void set_status(int status, std::string content_type) {
    std::lock_guard<std::mutex> lk(mu_);
    status_ = status;
    content_type_ = std::move(content_type);
  }
  void close() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  // The next piece, waiting up to `wait`: true with `out` set; false when nothing came
  // (then done() says whether the writer closed).
  bool pop(std::string& out, std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, wait, [&] { return !q_.empty() || closed_ || cancelled_; });
    if (q_.empty()) return false;
    out = std::move(q_.front());
    q_.pop_front();
    return true;
  }
  // Waits until there is something to read or the writer closed; false on timeout.
  bool wait_ready(std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, wait, [&] { return !q_.empty() || closed_ || cancelled_; });
  }
  // Waits until the writer closed (non-streaming answers); false on timeout.
  bool wait_closed(std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, wait, [&] { return closed_ || cancelled_; });
  }
  bool done() const {
    std::lock_guard<std::mutex> lk(mu_);
    return closed_ && q_.empty();
  }
  void cancel() {
    std::lock_guard<std::mutex> lk(mu_);
    cancelled_ = true;
    q_.clear();
    cv_.notify_all();
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> lk(mu_);
    return cancelled_;
  }
  int status() const {
    std::lock_guard<std::mutex> lk(mu_);
    return status_;
  }
  std::string content_type() const {
    std::lock_guard<std::mutex> lk(mu_);
    return content_type_;
  }
  // Everything pushed, joined (non-streaming answers, after close).
  std::string drain() {
    std::lock_guard<std::mutex> lk(mu_);
    std::string s;
    for (auto& p : q_) s += p;
    q_.clear();
    return s;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> q_;
  bool closed_ = false, cancelled_ = false;
  int status_ = 200;
  std::string content_type_ = "text/event-stream";
};

}  // namespace dsx::server
