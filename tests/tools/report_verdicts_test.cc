// zoffload-report's verdicts, each for a component present and missing, on reports as the tool
// writes them (this machine has no GPU; a GPU machine's report is written out here).
#include "report_verdicts.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

using Json = nlohmann::ordered_json;

Json Report() {
  return Json::parse(R"json({
    "simd": {"dispatch_target": "AVX3"},
    "openmp": {"max_threads": 16},
    "io_uring": {"usable": true},
    "memlock": {"soft": "unlimited"},
    "paths": [{"path": "/data", "block_device": "nvme0n1", "o_direct": true}],
    "cuda": {"built": true, "nccl_version": "2.28.9",
             "gpus": [{"name": "NVIDIA H200", "memory": "139.80 GiB (150109880320 bytes)",
                       "pcie_link": "gen5 x16"}]
}
})json");
}

const Verdict& Find(const std::vector<Verdict>& verdicts, const std::string& component) {
  for (const Verdict& v : verdicts) {
    if (v.component == component) return v;
  }
  static const Verdict kNone{"", "absent", "", ""};
  return kNone;
}

TEST(ReportVerdictsTest, AMachineWithEverythingIsReady) {
  const auto verdicts = Verdicts(Report());
  ASSERT_EQ(verdicts.size(), 5u);
  for (const Verdict& v : verdicts) {
    EXPECT_EQ(v.status, "ready") << v.component << ": " << v.detail;
    EXPECT_TRUE(v.action.empty()) << v.component;
  }
  EXPECT_EQ(Find(verdicts, "GPU").detail,
            "1 x NVIDIA H200, 139.80 GiB (150109880320 bytes), gen5 x16");
  EXPECT_EQ(Find(verdicts, "NVMe offload at /data").detail, "io_uring, O_DIRECT on nvme0n1");
}

TEST(ReportVerdictsTest, NoGpuIsMissingWithTheDriverAdvice) {
  Json r = Report();
  r["cuda"]["gpus"] = Json::array();
  r["cuda"]["error"] =
      "no usable GPU: the NVIDIA driver is missing or older than this build's CUDA runtime 13.0: "
      "install a driver for it, or train in host mode";
  const auto verdicts = Verdicts(r);
  const Verdict& gpu = Find(verdicts, "GPU");
  EXPECT_EQ(gpu.status, "missing");
  EXPECT_EQ(gpu.detail,
            "the NVIDIA driver is missing or older than this build's CUDA runtime 13.0");
  EXPECT_EQ(gpu.action, "install a driver for it, or train in host mode");
  EXPECT_EQ(Find(verdicts, "NCCL (ZeRO across GPUs)").status, "missing");
  r["cuda"] = Json::parse(R"({"built": false, "gpus": []})");
  EXPECT_NE(Find(Verdicts(r), "GPU").action.find("rebuild with the CUDA toolkit"),
            std::string::npos);
}

TEST(ReportVerdictsTest, ASmallMemlockLimitIsLimitedWithHowToRaiseIt) {
  Json r = Report();
  r["memlock"]["soft"] = "8.00 MiB (8388608 bytes)";
  const auto verdicts = Verdicts(r);
  const Verdict& v = Find(verdicts, "pinned memory");
  EXPECT_EQ(v.status, "limited");
  EXPECT_EQ(v.detail, "memlock limit 8.00 MiB (8388608 bytes)");
  EXPECT_NE(v.action.find("ulimit -l"), std::string::npos);
  r["memlock"]["soft"] = "4.00 GiB (4294967296 bytes)";
  EXPECT_EQ(Find(Verdicts(r), "pinned memory").status, "ready");
}

TEST(ReportVerdictsTest, APathWithoutODirectOrIoUringIsLimited) {
  Json r = Report();
  r["paths"][0] = Json::parse(
      R"({"path": "/mnt/nfs", "block_device": "none", "o_direct": false, "refusal": "EINVAL"})");
  const auto without_direct = Verdicts(r);
  const Verdict& no_direct = Find(without_direct, "NVMe offload at /mnt/nfs");
  EXPECT_EQ(no_direct.status, "limited");
  EXPECT_NE(no_direct.detail.find("O_DIRECT refused (EINVAL)"), std::string::npos);
  EXPECT_NE(no_direct.action.find("local disk"), std::string::npos);
  r = Report();
  r["io_uring"]["usable"] = false;
  const auto without_uring = Verdicts(r);
  const Verdict& no_uring = Find(without_uring, "NVMe offload at /data");
  EXPECT_EQ(no_uring.status, "limited");
  EXPECT_NE(no_uring.action.find("io_uring_disabled"), std::string::npos);
  r = Report();
  r["paths"][0] = Json::parse(R"({"path": "/gone", "error": "NOT_FOUND: stat /gone"})");
  EXPECT_EQ(Find(Verdicts(r), "NVMe offload at /gone").status, "missing");
}

TEST(ReportVerdictsTest, ColourOnlyWhenAsked) {
  const Verdict v{"GPU", "missing", "no driver", "install one"};
  EXPECT_EQ(FormatVerdict(v, false), "  missing  GPU: no driver — install one");
  EXPECT_EQ(FormatVerdict(v, true), "  \x1b[31mmissing \x1b[0m GPU: no driver — install one");
}

}  // namespace
}  // namespace zoffload::internal
