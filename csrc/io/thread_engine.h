// An Engine of worker threads doing blocking pread/pwrite: works on every POSIX kernel and file system.
// Chunks run in submission order across the pool; destruction drains the queue, then joins the workers.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/io_engine.h"

namespace offload::io {

class ThreadEngine final : public Engine {
 public:
  explicit ThreadEngine(unsigned num_threads);
  ~ThreadEngine() override;
  void submit(std::vector<Chunk*>& chunks) override;
  const char* name() const override { return "threads"; }

 private:
  void work();
  static void run(Chunk* chunk);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk*> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace offload::io
