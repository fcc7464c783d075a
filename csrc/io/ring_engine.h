// An Engine over a kernel Ring: callers queue chunks; whoever submits or reaps tops the ring up to its
// capacity, so the queue stays deep without a dedicated submission thread. One reaper thread waits for
// completions, resubmits the rest of short transfers and EINTR/EAGAIN, and finishes chunks.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "io/io_engine.h"
#include "io/ring.h"

namespace offload::io {

class RingEngine final : public Engine {
 public:
  RingEngine(std::unique_ptr<Ring> ring, const char* name);
  ~RingEngine() override;  // drains every chunk, then joins the reaper
  void submit(std::vector<Chunk*>& chunks) override;
  const char* name() const override { return name_; }

 private:
  void pump();
  void handle(std::vector<Completion>& completions);
  void reap_loop();

  std::unique_ptr<Ring> ring_;
  const char* name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk*> pending_;
  unsigned in_flight_ = 0;
  bool stop_ = false;
  std::thread reaper_;
};

}  // namespace offload::io
