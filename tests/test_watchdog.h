// A hang watchdog for the tests that drive a server from several threads: when the test
// has not ended after `seconds`, it prints the backtraces of every thread of this process (gdb,
// where installed and allowed to attach), then what the caller's `report` says (the
// server's request log and metrics), and aborts, so a hang reads as a failure with its
// state instead of ctest's silent timeout.
#pragma once
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace dsx_test {

class Watchdog {
 public:
  Watchdog(int seconds, std::function<std::string()> report) : report_(std::move(report)) {
    th_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lk(mu_);
      if (cv_.wait_for(lk, std::chrono::seconds(seconds), [this] { return done_; })) return;
      std::fprintf(stderr, "\n*** watchdog: the test is still running after %d s ***\n", seconds);
      std::fflush(stderr);
      // the backtraces first: the report may block on the lock of whatever hangs
      prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
      const std::string cmd = "command -v gdb >/dev/null && gdb -p " + std::to_string(::getpid()) +
                              " -batch -ex 'thread apply all bt' 1>&2 2>/dev/null";
      if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "(no backtraces: gdb missing or not allowed)\n");
      if (report_) std::fprintf(stderr, "%s\n", report_().c_str());
      std::fflush(stderr);
      std::abort();
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    th_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::function<std::string()> report_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread th_;
};

}  // namespace dsx_test
