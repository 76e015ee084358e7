#include "zoffload/future.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

namespace zoffload::internal {
namespace {

using namespace std::chrono_literals;

TEST(FutureTest, PromiseFinishesItsFutureOnAnotherThread) {
  Promise<int> promise;
  Future<int> future = promise.GetFuture();
  EXPECT_FALSE(future.Ready());
  std::thread producer([&] {
    std::this_thread::sleep_for(20ms);
    promise.Set(7);
  });
  EXPECT_TRUE(future.Wait().ok());
  EXPECT_TRUE(future.Ready());
  Result<int> value = future.Get();
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, 7);
  EXPECT_EQ(future.Get().status().code(), StatusCode::kFailedPrecondition) << "taken twice";
  producer.join();
}

TEST(FutureTest, ErrorsAndNoWork) {
  Future<> failed = Future<>::Ready(DataLossError("bad block"));
  EXPECT_TRUE(failed.Ready());
  EXPECT_EQ(failed.Wait().code(), StatusCode::kDataLoss);
  EXPECT_EQ(failed.Get().code(), StatusCode::kDataLoss);  // a status is read, not taken
  Future<> none;
  EXPECT_FALSE(none.valid());
  EXPECT_TRUE(none.Ready());
  EXPECT_TRUE(none.Wait().ok());
  EXPECT_TRUE(none.OrderBefore(nullptr).ok());  // host work: waited for here
}

TEST(FutureTest, ThenChainsRunOnTheFinishingThreadInOrder) {
  Promise<> read;
  std::atomic<int> step{0};
  std::thread::id ran_on;
  Future<int> chain = read.GetFuture()
                          .Then([&](const Status& s) -> Result<int> {
                            ran_on = std::this_thread::get_id();
                            EXPECT_EQ(step.exchange(1), 0);
                            if (!s.ok()) return s;
                            return 20;
                          })
                          .Then([&](Result<int> v) -> Result<int> {
                            EXPECT_EQ(step.exchange(2), 1);
                            if (!v.ok()) return v.status();
                            return *v + 1;
                          });
  EXPECT_EQ(step.load(), 0) << "ran before the work finished";
  std::thread::id finisher;
  std::thread t([&] {
    finisher = std::this_thread::get_id();
    read.Set(Status::Ok());
  });
  t.join();
  EXPECT_EQ(ran_on, finisher);
  Result<int> value = chain.Get();
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, 21);
}

TEST(FutureTest, ThenPassesErrorsAndRunsAtOnceWhenFinished) {
  Future<> chain = Future<>::Ready(NotFoundError("no tensor 'w'")).Then([](const Status& s) {
    return s.WithContext("loading");
  });
  EXPECT_TRUE(chain.Ready());
  const Status s = chain.Wait();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("no tensor 'w'"), std::string::npos) << s;
}

TEST(FutureTest, ThenFlattensAReturnedFuture) {
  Promise<> load, upload;
  Future<> loaded = load.GetFuture();
  Future<> uploaded = loaded.Then(
      [&](const Status& s) { return s.ok() ? upload.GetFuture() : Future<>::Ready(s); });
  load.Set(Status::Ok());
  EXPECT_TRUE(loaded.Ready());
  EXPECT_FALSE(uploaded.Ready()) << "finished before the inner work";
  upload.Set(InternalError("copy failed"));
  EXPECT_EQ(uploaded.Wait().code(), StatusCode::kInternal);
}

TEST(FutureTest, TheLastCopyOfHostWorkWaitsForIt) {
  Promise<> promise;
  std::atomic<bool> finished{false};
  std::thread producer;
  {
    Future<> a = promise.GetFuture();
    Future<> b = a;  // a copy shares the work
    producer = std::thread([&] {
      std::this_thread::sleep_for(30ms);
      finished = true;
      promise.Set(Status::Ok());
    });
    a = Future<>();  // not the last copy: does not wait
    EXPECT_FALSE(finished.load());
  }  // b, the last copy: waits
  EXPECT_TRUE(finished.load()) << "the last copy did not wait for the work";
  producer.join();
}

TEST(FutureTest, DroppingTheSourceOfAChainDoesNotWait) {
  Promise<> promise;
  Future<> chained = promise.GetFuture().Then([](const Status& s) { return s; });
  EXPECT_FALSE(chained.Ready());  // the temporary source was dropped without blocking
  promise.Set(Status::Ok());
  EXPECT_TRUE(chained.Wait().ok());
}

TEST(FutureTest, DeferredFinishRunsOnceOnTheCollectingThread) {
  Promise<> moves;
  std::atomic<int> runs{0};
  std::thread::id ran_on;
  Future<std::unique_ptr<int>> lease = DeferredFuture<std::unique_ptr<int>>(
      moves.GetFuture(), [&](const Status& s) -> Result<std::unique_ptr<int>> {
        ++runs;
        ran_on = std::this_thread::get_id();
        if (!s.ok()) return s;
        return std::make_unique<int>(5);
      });
  EXPECT_FALSE(lease.Ready());
  std::thread t([&] { moves.Set(Status::Ok()); });
  t.join();
  EXPECT_EQ(runs.load(), 0) << "finish ran on the finishing thread";
  EXPECT_TRUE(lease.Ready());
  Future<std::unique_ptr<int>> copy = lease;
  EXPECT_TRUE(copy.Wait().ok());
  Result<std::unique_ptr<int>> value = lease.Get();
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(**value, 5);
  EXPECT_EQ(runs.load(), 1);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
}

TEST(FutureTest, AnUncollectedDeferredFutureFinishesWhenDropped) {
  std::atomic<int> runs{0};
  {
    Future<int> f = DeferredFuture<int>(Future<>::Ready(Status::Ok()), [&](const Status&) {
      ++runs;
      return Result<int>(1);
    });
  }
  EXPECT_EQ(runs.load(), 1) << "a dropped lease future must give its lease back";
}

}  // namespace
}  // namespace zoffload::internal
