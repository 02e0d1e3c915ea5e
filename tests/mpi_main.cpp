// Shared main for the test binaries (MPI or c10d transport): every rank runs every test, rank 0
// prints the usual gtest report, other ranks print only their failures, and
// the exit code is reduced so that every rank exits with the same status.
#include <gtest/gtest.h>
#include <shardtensor/shardtensor.h>

#include "testing.h"

#include <cstdio>

namespace {

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  shardtensor::Runtime runtime(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = shardtensor::world_rank();
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  int rc = RUN_ALL_TESTS();
  const int global_rc = static_cast<int>(shardtensor::testing::max_over_ranks(rc));
  if (rank == 0 && global_rc != rc) {
    std::fprintf(stderr, "some rank other than 0 failed; see [rank N] lines above\n");
  }
  return global_rc;
}
