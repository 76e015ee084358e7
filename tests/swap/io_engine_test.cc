#include "swap/io_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "swap/fault_backend.h"
#include "test_util.h"

namespace zoffload::internal {
namespace {

using testing::FaultPlan;
using testing::FaultRule;
using testing::FillRandom;
using testing::InjectFaults;
using testing::TempDir;

struct EngineCase {
  IoBackendKind backend;
  int threads;
  int queue_depth;
  bool single_submit;
  bool overlap_events;
};

std::string CaseName(const ::testing::TestParamInfo<EngineCase>& info) {
  const EngineCase& c = info.param;
  return std::string(c.backend == IoBackendKind::kPosix ? "posix" : "uring") + "_t" +
         std::to_string(c.threads) + "_qd" + std::to_string(c.queue_depth) +
         (c.single_submit ? "_single" : "") + (c.overlap_events ? "" : "_batched");
}

class IoEngineTest : public ::testing::TestWithParam<EngineCase> {
 protected:
  std::unique_ptr<IoEngine> MakeEngine(int64_t block_size = 64 << 10,
                                       std::shared_ptr<FaultPlan> faults = nullptr) {
    IoEngineOptions o;
    o.aio.block_size = block_size;
    o.aio.queue_depth = GetParam().queue_depth;
    o.aio.intra_op_parallelism = GetParam().threads;
    o.aio.single_submit = GetParam().single_submit;
    o.aio.overlap_events = GetParam().overlap_events;
    o.backend = GetParam().backend;
    if (faults) o.wrap_backend = InjectFaults(faults);
    auto engine = IoEngine::Create(std::move(o));
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(engine).value() : nullptr;
  }
  TempDir dir_;
};

// Writes `len` random bytes from an address `misalign` bytes past an aligned one, reads them
// back into a poisoned buffer, and compares.
void RoundTrip(IoEngine& engine, int file, uint64_t len, size_t misalign, uint64_t seed) {
  auto src = AlignedBuffer::Allocate(len + misalign + 1, 4096);
  auto dst = AlignedBuffer::Allocate(len + misalign + 1, 4096);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::byte* in = src->data() + misalign;
  std::byte* out = dst->data() + misalign;
  FillRandom(in, len, seed);
  std::memset(dst->data(), 0xA5, dst->size());
  ASSERT_TRUE(engine.Submit(IoOp::kWrite, {{file, 0, in, len}}, "test").Wait().ok());
  Status s = engine.Submit(IoOp::kRead, {{file, 0, out, len}}, "test").Wait();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(std::memcmp(in, out, len), 0) << "len " << len << " misalign " << misalign;
  EXPECT_EQ(dst->data()[misalign + len], std::byte{0xA5}) << "wrote past the end";
}

TEST_P(IoEngineTest, RoundTripsAwkwardSizesAndAlignments) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  auto file = engine->OpenFile(dir_.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok()) << file.status();
  uint64_t seed = 1;
  for (uint64_t len : {uint64_t{1}, uint64_t{511}, uint64_t{4095}, uint64_t{4097}, uint64_t{65535},
                       uint64_t{65537}, uint64_t{1 << 20}, uint64_t{(3 << 20) + 7}}) {
    for (size_t misalign : {0, 1, 8}) RoundTrip(*engine, *file, len, misalign, seed++);
  }
  if (engine->direct(*file)) {
    EXPECT_GT(engine->stats().bounced, 0u);
  }
}

TEST_P(IoEngineTest, RegisteredBuffersRoundTrip) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  auto file = engine->OpenFile(dir_.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  const size_t len = 2 << 20;
  auto a = AlignedBuffer::Allocate(len, 4096);
  auto b = AlignedBuffer::Allocate(len, 4096);
  ASSERT_TRUE(engine->RegisterBuffer(a->span()).ok());
  ASSERT_TRUE(engine->RegisterBuffer(b->span()).ok());
  FillRandom(a->data(), len, 7);
  std::memset(b->data(), 0, len);
  ASSERT_TRUE(engine->Submit(IoOp::kWrite, {{*file, 0, a->data(), len}}, "t").Wait().ok());
  ASSERT_TRUE(engine->Submit(IoOp::kRead, {{*file, 0, b->data(), len}}, "t").Wait().ok());
  EXPECT_EQ(std::memcmp(a->data(), b->data(), len), 0);
  EXPECT_TRUE(engine->UnregisterBuffer(a->span()).ok());
  EXPECT_TRUE(engine->UnregisterBuffer(b->span()).ok());
  if (GetParam().backend == IoBackendKind::kUring) {
    EXPECT_TRUE(engine->registration());
  }
}

TEST_P(IoEngineTest, ManyConcurrentRequests) {
  auto engine = MakeEngine(4096);
  ASSERT_NE(engine, nullptr);
  auto file = engine->OpenFile(dir_.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  constexpr int kRequests = 16;
  constexpr size_t kLen = 40960;
  auto src = AlignedBuffer::Allocate(kRequests * kLen, 4096);
  auto dst = AlignedBuffer::Allocate(kRequests * kLen, 4096);
  FillRandom(src->data(), src->size(), 3);
  std::memset(dst->data(), 0, dst->size());
  std::vector<Future<>> writes;
  for (int i = 0; i < kRequests; ++i) {
    writes.push_back(
        engine->Submit(IoOp::kWrite, {{*file, i * kLen, src->data() + i * kLen, kLen}}, "w"));
  }
  for (auto& f : writes) ASSERT_TRUE(f.Wait().ok());
  std::vector<Future<>> reads;
  for (int i = kRequests - 1; i >= 0; --i) {
    reads.push_back(
        engine->Submit(IoOp::kRead, {{*file, i * kLen, dst->data() + i * kLen, kLen}}, "r"));
  }
  for (auto& f : reads) ASSERT_TRUE(f.Wait().ok());
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), src->size()), 0);
}

TEST_P(IoEngineTest, ChecksumsDetectAFlippedByte) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  const std::string path = dir_.File("data");
  auto file = engine->OpenFile(path, O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  const size_t len = 64 << 10;
  auto buf = AlignedBuffer::Allocate(2 * len, 4096);
  FillRandom(buf->data(), 2 * len, 11);
  uint32_t crc[2] = {0, 0};
  std::vector<IoSegment> w = {{*file, 0, buf->data(), len, &crc[0], 0},
                              {*file, len, buf->data() + len, len, &crc[1], len}};
  ASSERT_TRUE(engine->Submit(IoOp::kWrite, w, "tensor 'x'").Wait().ok());
  EXPECT_NE(crc[0], 0u);
  ASSERT_TRUE(engine->Submit(IoOp::kRead, w, "tensor 'x'").Wait().ok());
  // Flip one byte of the second block on disk.
  const int raw = ::open(path.c_str(), O_RDWR);
  unsigned char byte;
  ASSERT_EQ(::pread(raw, &byte, 1, len + 100), 1);
  byte ^= 0x40;
  ASSERT_EQ(::pwrite(raw, &byte, 1, len + 100), 1);
  ::fsync(raw);
  ::close(raw);
  Status s = engine->Submit(IoOp::kRead, w, "tensor 'x'").Wait();
  ASSERT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("checksum mismatch in tensor 'x' at byte offset 65536"),
            std::string::npos)
      << s;
}

TEST_P(IoEngineTest, ShortTransfersAreResubmitted) {
  auto plan = std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kWrite, FaultRule::Action::kTruncate, 0, 3, EIO, 4096, 0},
                             {IoOp::kRead, FaultRule::Action::kTruncate, 0, 3, EIO, 8192, 0}});
  auto engine = MakeEngine(64 << 10, plan);
  ASSERT_NE(engine, nullptr);
  auto file = engine->OpenFile(dir_.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  RoundTrip(*engine, *file, 1 << 20, 0, 5);
  EXPECT_EQ(plan->applied(), 6);
  EXPECT_GE(engine->stats().resubmitted, 6u);
}

TEST_P(IoEngineTest, TransientErrorsAreRetried) {
  auto plan = std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kRead, FaultRule::Action::kFail, 1, 2, EAGAIN},
                             {IoOp::kWrite, FaultRule::Action::kFail, 0, 1, EINTR}});
  auto engine = MakeEngine(64 << 10, plan);
  ASSERT_NE(engine, nullptr);
  auto file = engine->OpenFile(dir_.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  RoundTrip(*engine, *file, 512 << 10, 0, 9);
  EXPECT_EQ(plan->applied(), 3);
}

TEST_P(IoEngineTest, IoErrorFailsTheRequestAfterEveryPieceCompletes) {
  auto plan = std::make_shared<FaultPlan>(
      std::vector<FaultRule>{{IoOp::kRead, FaultRule::Action::kFail, 5, 1, EIO}});
  auto engine = MakeEngine(64 << 10, plan);
  ASSERT_NE(engine, nullptr);
  const std::string path = dir_.File("data");
  auto file = engine->OpenFile(path, O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  const size_t len = 1 << 20;
  auto buf = AlignedBuffer::Allocate(len, 4096);
  FillRandom(buf->data(), len, 2);
  ASSERT_TRUE(engine->Submit(IoOp::kWrite, {{*file, 0, buf->data(), len}}, "t").Wait().ok());
  Status s = engine->Submit(IoOp::kRead, {{*file, 0, buf->data(), len}}, "tensor 'w'").Wait();
  ASSERT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find("read of tensor 'w' (" + path + " at offset"), std::string::npos) << s;
  EXPECT_NE(s.message().find("EIO"), std::string::npos) << s;
  // The engine is still healthy afterwards.
  RoundTrip(*engine, *file, 100000, 3, 4);
}

TEST_P(IoEngineTest, RejectsUnalignedOffsetsAndUnknownFiles) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  auto file = engine->OpenFile(dir_.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  std::byte b[16];
  if (engine->alignment(*file) > 1) {
    EXPECT_EQ(engine->Submit(IoOp::kRead, {{*file, 3, b, 16}}, "t").Wait().code(),
              StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(engine->Submit(IoOp::kRead, {{99, 0, b, 16}}, "t").Wait().code(),
            StatusCode::kInvalidArgument);
  uint32_t crc;
  auto big = AlignedBuffer::Allocate(1 << 20, 4096);
  EXPECT_EQ(
      engine->Submit(IoOp::kWrite, {{*file, 0, big->data(), 1 << 20, &crc}}, "t").Wait().code(),
      StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine->Submit(IoOp::kRead, {}, "empty").Wait().ok());
}

// The I/O engine refuses exactly what the config refuses (one rule set: AioProblems), with
// the same words.
TEST(IoEngineSettings, RefusesWhatTheConfigRefuses) {
  const std::vector<std::string> bad = {
      R"({"aio": {"block_size": 1099511627776}})", R"({"aio": {"block_size": 1000}})",
      R"({"aio": {"queue_depth": 0}})", R"({"aio": {"intra_op_parallelism": 257}})"};
  for (const std::string& json : bad) {
    SCOPED_TRACE(json);
    auto parsed = nlohmann::json::parse(json)["aio"];
    IoEngineOptions o;
    if (parsed.contains("block_size")) o.aio.block_size = parsed["block_size"].get<int64_t>();
    if (parsed.contains("queue_depth")) o.aio.queue_depth = parsed["queue_depth"].get<int>();
    if (parsed.contains("intra_op_parallelism")) {
      o.aio.intra_op_parallelism = parsed["intra_op_parallelism"].get<int>();
    }
    auto engine = IoEngine::Create(o);
    auto config = ParseConfig(json);
    ASSERT_FALSE(engine.ok());
    ASSERT_FALSE(config.ok());
    EXPECT_NE(config.status().message().find(engine.status().message()), std::string::npos)
        << config.status() << " vs " << engine.status();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest,
                         ::testing::Values(EngineCase{IoBackendKind::kUring, 1, 8, false, true},
                                           EngineCase{IoBackendKind::kUring, 3, 2, false, true},
                                           EngineCase{IoBackendKind::kUring, 2, 4, true, true},
                                           EngineCase{IoBackendKind::kUring, 1, 4, false, false},
                                           EngineCase{IoBackendKind::kUring, 1, 1, false, true},
                                           EngineCase{IoBackendKind::kPosix, 1, 8, false, true},
                                           EngineCase{IoBackendKind::kPosix, 3, 4, false, true}),
                         CaseName);

TEST(IoEngineOptionsTest, BufferedModeWorks) {
  TempDir dir;
  IoEngineOptions o;
  o.direct_io = false;
  auto engine = IoEngine::Create(o);
  ASSERT_TRUE(engine.ok());
  auto file = (*engine)->OpenFile(dir.File("data"), O_RDWR | O_CREAT);
  ASSERT_TRUE(file.ok());
  EXPECT_FALSE((*engine)->direct(*file));
  EXPECT_EQ((*engine)->alignment(*file), 1u);
  RoundTrip(**engine, *file, 12345, 1, 8);
  EXPECT_EQ((*engine)->stats().bounced, 0u);
}

TEST(IoEngineOptionsTest, RejectsBadAioSettings) {
  IoEngineOptions o;
  o.aio.block_size = 1000;
  EXPECT_EQ(IoEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.aio.block_size = 4096;
  o.aio.queue_depth = 0;
  EXPECT_EQ(IoEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.aio.queue_depth = 4;
  o.aio.intra_op_parallelism = 0;
  EXPECT_EQ(IoEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(IoEngineOptionsTest, MissingDirectoryNamesIt) {
  auto engine = IoEngine::Create({});
  ASSERT_TRUE(engine.ok());
  auto file = (*engine)->OpenFile("/nonexistent-zoffload/x/data", O_RDWR | O_CREAT);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find("/nonexistent-zoffload/x"), std::string::npos);
}

}  // namespace
}  // namespace zoffload::internal
