// Checkpoint files (src/engine/checkpoint.cc): what a save does to an existing path, and what a
// load trusts of a manifest.
//
// A save replaces only an empty directory or a checkpoint zoffload wrote; anything else there
// (a file, a symlink, a directory with other files, a user's DIR.prev) is refused with
// ALREADY_EXISTS and left byte for byte. A killed save's DIR.tmp-PID is cleaned by the next save,
// relative paths included. A manifest's fields are covered by a checksum and checked one by
// one: an edited or duplicated field is DATA_LOSS naming it, and nothing loads.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "engine/checkpoint.h"
#include "engine/engine_test_util.h"
#include "swap/crc32c.h"
#include "test_util.h"

namespace zoffload::internal::testing {
namespace {

namespace fs = std::filesystem;

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A pid no process has: a child's, after it exited and was reaped.
pid_t DeadPid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

struct Trained {
  TempDir swap, dir;
  Model model{41};
  std::unique_ptr<OffloadEngine> engine;
  Trained() {
    engine = HostEngine({1, false, StatePrecision::kFp32, "host"}, swap.path(), model);
    if (engine) RunSteps(*engine, 1, 2, 1);
  }
};

TEST(CheckpointSave, ExistingPathsThatAreNotCheckpointsAreRefusedAndKept) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const std::string root = t.dir.path();
  // A project directory with the user's files.
  fs::create_directories(root + "/proj/sub");
  WriteText(root + "/proj/tokenizer.json", "t\n");
  WriteText(root + "/proj/sub/x", "x\n");
  // A file, a symlink to a directory, a FIFO.
  WriteText(root + "/file", "weights\n");
  fs::create_directories(root + "/elsewhere");
  fs::create_directory_symlink(root + "/elsewhere", root + "/link");
  ASSERT_EQ(::mkfifo((root + "/fifo").c_str(), 0644), 0);
  // A checkpoint with a user's file put in it.
  ASSERT_TRUE(t.engine->Save(root + "/ckpt").ok());
  WriteText(root + "/ckpt/README", "mine\n");
  for (const std::string name : {"proj", "file", "link", "fifo", "ckpt", "proj/"}) {
    SCOPED_TRACE(name);
    const Status s = t.engine->Save(root + "/" + name);
    EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s;
    EXPECT_NE(s.message().find("never removes other files"), std::string::npos) << s;
  }
  EXPECT_EQ(ReadText(root + "/proj/tokenizer.json"), "t\n");
  EXPECT_EQ(ReadText(root + "/proj/sub/x"), "x\n");
  EXPECT_EQ(ReadText(root + "/file"), "weights\n");
  EXPECT_TRUE(fs::is_symlink(root + "/link"));
  EXPECT_TRUE(fs::is_fifo(root + "/fifo"));
  EXPECT_EQ(ReadText(root + "/ckpt/README"), "mine\n");
  // A user's DIR.prev (a save steps the old checkpoint aside there) is not removed either.
  ASSERT_TRUE(t.engine->Save(root + "/run").ok());
  fs::create_directories(root + "/run.prev");
  WriteText(root + "/run.prev/notes", "n\n");
  EXPECT_EQ(t.engine->Save(root + "/run").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(ReadText(root + "/run.prev/notes"), "n\n");
  // Nothing was left half-written beside them.
  for (const auto& entry : fs::directory_iterator(root)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  }
}

TEST(CheckpointSave, EmptyDirectoriesAndCheckpointsAreReplaced) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const std::string empty = t.dir.path() + "/empty";
  fs::create_directories(empty);
  ASSERT_TRUE(t.engine->Save(empty).ok());
  ASSERT_TRUE(t.engine->Save(empty).ok());  // its own checkpoint: replaced
  EXPECT_TRUE(fs::exists(empty + "/manifest.json"));
  EXPECT_FALSE(fs::exists(empty + ".prev"));
}

// A save killed mid-way leaves DIR.tmp-PID; the next save of DIR removes it, whether DIR is
// given as an absolute or a relative path; a DIR.tmp-PID holding a user's files stays.
TEST(CheckpointSave, AKilledSavesDebrisIsRemovedByTheNextSaveRelativePathsToo) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const fs::path cwd = fs::current_path();
  fs::current_path(t.dir.path());
  const std::string debris = StrCat("ck.tmp-", DeadPid());
  fs::create_directories(debris);
  WriteText(debris + "/state.bin", "partial");
  const std::string foreign = StrCat("ck.tmp-", DeadPid());
  fs::create_directories(foreign);
  WriteText(foreign + "/mine.txt", "m");
  const Status s = t.engine->Save("ck");
  fs::current_path(cwd);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE(fs::exists(t.dir.path() + "/" + debris));
  EXPECT_EQ(ReadText(t.dir.path() + "/" + foreign + "/mine.txt"), "m");
  EXPECT_TRUE(fs::exists(t.dir.path() + "/ck/manifest.json"));
}

// zoffload-export never writes into the checkpoint it reads, even with overwrite.
TEST(CheckpointSave, AnExportIntoItsOwnCheckpointIsRefused) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const std::string dir = t.dir.path() + "/ck";
  ASSERT_TRUE(t.engine->Save(dir).ok());
  const std::string state = ReadText(dir + "/state.bin");
  for (const std::string& out : {dir + "/state.bin", dir + "/model.safetensors"}) {
    const Status s = ExportSafetensors(dir, out, /*overwrite=*/true);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("inside the checkpoint"), std::string::npos) << s;
  }
  EXPECT_EQ(ReadText(dir + "/state.bin"), state);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
}

// Edits a saved manifest with `edit`, optionally keeping its checksum right (as a careful
// forger would), and expects Load to refuse with DATA_LOSS naming `expect`, changing nothing.
void ExpectRefused(Trained& t, const std::string& dir,
                   const std::function<void(nlohmann::ordered_json&)>& edit, bool fix_checksum,
                   const std::string& expect) {
  ASSERT_TRUE(t.engine->Save(dir).ok());
  const std::string path = dir + "/manifest.json";
  auto j = nlohmann::ordered_json::parse(ReadText(path));
  edit(j);
  if (fix_checksum) {
    j.erase("manifest_crc32c");
    const std::string text = nlohmann::json::parse(j.dump()).dump();
    j["manifest_crc32c"] = Crc32c(text.data(), text.size());
  }
  WriteText(path, j.dump(1));
  const auto before = AllState(*t.engine, StatePrecision::kFp32);
  const Status s = t.engine->Load(dir);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(expect), std::string::npos) << s;
  EXPECT_EQ(AllState(*t.engine, StatePrecision::kFp32), before);
}

TEST(CheckpointLoad, AnEditedManifestIsRefusedNamingWhatIsWrong) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const std::string dir = t.dir.path() + "/ckpt";
  auto lr = [](nlohmann::ordered_json& j) { j["groups"][0]["lr"] = -1; };
  ExpectRefused(t, dir, lr, false, "fails its checksum");
  ExpectRefused(t, dir, lr, true, "hyperparameters no optimizer takes");
  ExpectRefused(
      t, dir,
      [](auto& j) {
        j["groups"][1]["betas"] = {0.9, 1.5};
      },
      true, "hyperparameters");
  ExpectRefused(
      t, dir, [](auto& j) { j["steps"] = -4; }, true, "'steps' is -4");
  ExpectRefused(
      t, dir, [](auto& j) { j["steps"] = 2.5; }, true, "'steps' missing or not");
  ExpectRefused(
      t, dir, [](auto& j) { j["loss_scale"]["scale"] = 0; }, true, "'loss_scale'");
  ExpectRefused(
      t, dir, [](auto& j) { j["parameters"].push_back(j["parameters"][0]); }, true, "listed twice");
  ExpectRefused(
      t, dir, [](auto& j) { j["parameters"][1]["offset"] = 0; }, true, "offset 0");
  ExpectRefused(
      t, dir, [](auto& j) { j["parameters"][0]["group"] = 7; }, true, "group 7");
  ExpectRefused(
      t, dir, [](auto& j) { j["parameters"][0]["moment_bytes"] = 2; }, true, "bytes a moment");
  ExpectRefused(
      t, dir, [](auto& j) { j["parameters"][0]["elements"] = -1; }, true,
      "'elements' missing or not");
  ExpectRefused(
      t, dir, [](auto& j) { j["optimizer_state"] = "fp64"; }, true, "fp64");
  ExpectRefused(
      t, dir, [](auto& j) { j.erase("manifest_crc32c"); }, false, "manifest_crc32c");
  // The manifest says more than state.bin holds (a parameter appended with its own bytes).
  ExpectRefused(
      t, dir,
      [](auto& j) {
        auto extra = j["parameters"].back();
        extra["name"] = "extra";
        extra["offset"] = j["parameters"].back()["offset"].template get<uint64_t>() +
                          4 * j["parameters"].back()["elements"].template get<uint64_t>() * 3;
        j["parameters"].push_back(extra);
      },
      true, "state.bin has");
}

TEST(CheckpointLoad, ManifestsThatAreNotRegularFilesAreRefusedUnread) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const std::string dir = t.dir.path() + "/ckpt";
  ASSERT_TRUE(t.engine->Save(dir).ok());
  const std::string manifest = dir + "/manifest.json";
  fs::remove(manifest);
  fs::create_symlink("/dev/zero", manifest);
  Status s = t.engine->Load(dir);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos) << s;
  EXPECT_EQ(ExportSafetensors(dir, t.dir.path() + "/out.safetensors").code(),
            StatusCode::kInvalidArgument);
  fs::remove(manifest);
  ASSERT_EQ(::mkfifo(manifest.c_str(), 0644), 0);  // would block a plain open
  s = t.engine->Load(dir);
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos) << s;
  fs::remove(manifest);
  fs::create_directory(manifest);
  s = t.engine->Load(dir);
  EXPECT_NE(s.message().find("is a directory"), std::string::npos) << s;
}

// Version-1 checkpoints (no manifest checksum) still load, their fields checked as well.
TEST(CheckpointLoad, VersionOneManifestsLoadWithTheirFieldsChecked) {
  Trained t;
  ASSERT_TRUE(t.engine);
  const std::string dir = t.dir.path() + "/ckpt";
  ASSERT_TRUE(t.engine->Save(dir).ok());
  auto j = nlohmann::ordered_json::parse(ReadText(dir + "/manifest.json"));
  j.erase("manifest_crc32c");
  j["version"] = 1;
  WriteText(dir + "/manifest.json", j.dump(1));
  EXPECT_TRUE(t.engine->Load(dir).ok());
  j["groups"][0]["eps"] = 0;
  WriteText(dir + "/manifest.json", j.dump(1));
  EXPECT_EQ(t.engine->Load(dir).code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace zoffload::internal::testing
