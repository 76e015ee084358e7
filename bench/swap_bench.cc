// The cost of integrity: SwapSpace write+read throughput with CRC32C per block on and off,
// on the same disk in the same process, and the raw CRC32C speed of one thread.
//   swap_bench [--benchmark_filter=...]   (ZO_BENCH_DIR: directory to test; default .)
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "common/aligned_buffer.h"
#include "swap/crc32c.h"
#include "swap/swap_space.h"

namespace zoffload::internal {
namespace {

constexpr uint64_t kBytes = 256 << 20;

std::string BenchDir() {
  const char* dir = std::getenv("ZO_BENCH_DIR");  // NOLINT(concurrency-mt-unsafe)
  return dir != nullptr ? dir : ".";
}

void BM_SwapWriteRead(benchmark::State& state) {
  const bool checksums = state.range(0) != 0;
  const std::string dir = BenchDir() + "/zoffload-swap-bench";
  std::filesystem::create_directories(dir);
  SwapSpace::Destroy({dir}).IgnoreError();
  SwapSpaceOptions o;
  o.paths = {dir};
  o.aio.queue_depth = 32;
  o.checksums = checksums;
  auto swap = SwapSpace::Open(o);
  auto buffer = AlignedBuffer::Allocate(kBytes, 4096, /*prefault=*/true);
  if (!swap.ok() || !buffer.ok() || !(*swap)->Allocate("t", kBytes).ok()) {
    state.SkipWithError("cannot set up the swap space");
    return;
  }
  (*swap)->engine().RegisterBuffer(buffer->span()).IgnoreError();
  std::memset(buffer->data(), 0x3c, kBytes);
  for (auto _ : state) {
    if (!(*swap)->Write("t", 0, buffer->span()).Wait().ok() ||
        !(*swap)->Read("t", 0, buffer->span()).Wait().ok()) {
      state.SkipWithError("I/O failed");
      break;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * kBytes));
  state.SetLabel(checksums ? "crc32c on" : "crc32c off");
  swap->reset();
  SwapSpace::Destroy({dir}).IgnoreError();
  std::filesystem::remove(dir);
}
BENCHMARK(BM_SwapWriteRead)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Crc32c(benchmark::State& state) {
  auto buffer = AlignedBuffer::Allocate(1 << 20, 64, /*prefault=*/true);
  std::memset(buffer->data(), 1, buffer->size());
  for (auto _ : state) benchmark::DoNotOptimize(Crc32c(buffer->data(), buffer->size()));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * buffer->size()));
  state.SetLabel(Crc32cIsHardware() ? "sse4.2" : "table");
}
BENCHMARK(BM_Crc32c);

}  // namespace
}  // namespace zoffload::internal

BENCHMARK_MAIN();
