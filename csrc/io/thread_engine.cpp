// The last native resort: a pool of threads doing blocking pread/pwrite, one chunk at a time each.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "io/thread_engine.h"

namespace offload::io {

ThreadEngine::ThreadEngine(unsigned num_threads) {
  if (num_threads == 0) num_threads = 1;
  for (unsigned i = 0; i < num_threads; ++i) workers_.emplace_back([this] { work(); });
}

ThreadEngine::~ThreadEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadEngine::submit(std::vector<Chunk*>& chunks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Chunk* c : chunks) queue_.push_back(c);
  }
  chunks.clear();
  cv_.notify_all();
}

void ThreadEngine::work() {
  for (;;) {
    Chunk* c = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      c = queue_.front();
      queue_.pop_front();
    }
    run(c);
  }
}

void ThreadEngine::run(Chunk* c) {
  for (;;) {
    ssize_t r = c->op == Op::kRead ? pread(c->fd, c->cursor(), c->left(), static_cast<off_t>(c->position()))
                                   : pwrite(c->fd, c->cursor(), c->left(), static_cast<off_t>(c->position()));
    int err = 0;
    Step step = apply_result(*c, r < 0 ? -static_cast<long>(errno) : static_cast<long>(r), &err);
    if (step == Step::kRetry) continue;
    finish(c, step == Step::kDone ? 0 : err);
    return;
  }
}

}  // namespace offload::io
