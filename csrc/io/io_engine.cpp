#include "io/io_engine.h"

#include <stdexcept>

#include "io/ring_engine.h"
#include "io/thread_engine.h"

namespace offload::io {

std::unique_ptr<Engine> make_engine(const std::string& kind, unsigned queue_depth, unsigned num_threads) {
  if (queue_depth == 0) queue_depth = 1;
  if (kind == "io_uring") return std::make_unique<RingEngine>(make_uring_ring(queue_depth), "io_uring");
  if (kind == "aio") return std::make_unique<RingEngine>(make_aio_ring(queue_depth), "aio");
  if (kind == "threads") return std::make_unique<ThreadEngine>(num_threads);
  throw std::invalid_argument("unknown I/O engine '" + kind + "': expected io_uring, aio or threads");
}

}  // namespace offload::io
