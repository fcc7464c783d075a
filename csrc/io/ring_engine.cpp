#include "io/ring_engine.h"

namespace offload::io {

RingEngine::RingEngine(std::unique_ptr<Ring> ring, const char* name)
    : ring_(std::move(ring)), name_(name), reaper_([this] { reap_loop(); }) {}

RingEngine::~RingEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  reaper_.join();
}

void RingEngine::submit(std::vector<Chunk*>& chunks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Chunk* c : chunks) pending_.push_back(c);
  }
  chunks.clear();
  pump();
}

void RingEngine::pump() {
  std::vector<Completion> refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool added = false;
    while (in_flight_ < ring_->capacity() && !pending_.empty()) {
      ring_->prepare(pending_.front());
      pending_.pop_front();
      ++in_flight_;
      added = true;
    }
    if (!added) return;
    ring_->submit(refused);
  }
  cv_.notify_all();
  if (!refused.empty()) handle(refused);
}

void RingEngine::handle(std::vector<Completion>& completions) {
  std::vector<Chunk*> again;
  for (const Completion& c : completions) {
    int err = 0;
    switch (apply_result(*c.chunk, c.result, &err)) {
      case Step::kRetry:
        again.push_back(c.chunk);
        break;
      case Step::kDone:
        finish(c.chunk, 0);
        break;
      case Step::kFailed:
        finish(c.chunk, err);
        break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ -= static_cast<unsigned>(completions.size());
    for (auto it = again.rbegin(); it != again.rend(); ++it) pending_.push_front(*it);
  }
  completions.clear();
  pump();
}

void RingEngine::reap_loop() {
  std::vector<Completion> got;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || in_flight_ > 0; });
      if (stop_ && in_flight_ == 0 && pending_.empty()) return;
    }
    ring_->reap(got, 100);
    if (got.empty()) {  // nothing finished: maybe the kernel refused a submission (EAGAIN) earlier; retry it
      std::lock_guard<std::mutex> lock(mu_);
      ring_->submit(got);
    }
    if (!got.empty()) handle(got);
  }
}

}  // namespace offload::io
