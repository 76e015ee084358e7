#include "gpu/nccl_comm.h"

#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"

namespace zoffload::internal {
namespace {

using testing::Poisoned;
using testing::ToDevice;
using testing::ToHost;

TEST(NcclUniqueIdTest, HexRejectsBadInput) {
  EXPECT_EQ(NcclUniqueId::FromHex("abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclUniqueId::FromHex(std::string(256, 'g')).status().code(),
            StatusCode::kInvalidArgument);
  auto id = NcclUniqueId::FromHex(std::string(256, 'a'));
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id->ToHex(), std::string(256, 'a'));
}

TEST(NcclCommTest, WorldOfOneRunsEveryCollective) {
  ZO_SKIP_WITHOUT_GPU();
  auto id = NcclUniqueId::Create();
  ASSERT_TRUE(id.ok()) << id.status();
  auto parsed = NcclUniqueId::FromHex(id->ToHex());
  ASSERT_TRUE(parsed.ok());
  ZO_ASSERT_CUDA(cudaSetDevice(0));
  auto comm = NcclComm::Init(1, 0, *parsed);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ(comm->world_size(), 1);
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  constexpr size_t kN = 1000;
  std::vector<float> host(kN);
  std::iota(host.begin(), host.end(), 1.0f);
  DeviceBuffer src = ToDevice(host);
  DeviceBuffer dst = Poisoned(kN * 4);
  ASSERT_TRUE(
      comm->AllReduce(src.data(), dst.data(), kN, DType::kFp32, ReduceOp::kSum, stream->get())
          .ok());
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_EQ(ToHost<float>(dst.data(), kN), host);
  for (int op = 0; op < 3; ++op) {
    ZO_ASSERT_CUDA(cudaMemset(dst.data(), 0xFF, kN * 4));
    const Status s =
        op == 0   ? comm->AllGather(src.data(), dst.data(), kN, DType::kFp32, stream->get())
        : op == 1 ? comm->ReduceScatter(src.data(), dst.data(), kN, DType::kFp32, ReduceOp::kAvg,
                                        stream->get())
                  : comm->Broadcast(src.data(), dst.data(), kN, DType::kFp32, 0, stream->get());
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(stream->Synchronize().ok());
    EXPECT_EQ(ToHost<float>(dst.data(), kN), host) << op;
  }
  EXPECT_TRUE(comm->CheckAsyncError().ok());
}

TEST(NcclCommTest, SingleAndBadRank) {
  ZO_SKIP_WITHOUT_GPU();
  auto single = NcclComm::InitSingle(0);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->rank(), 0);
  auto id = NcclUniqueId::Create();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(NcclComm::Init(2, 2, *id).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoffload::internal
