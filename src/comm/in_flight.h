#pragma once
/// \file A transport operation in flight, as a handle the layers above comm/
/// may hold without seeing the transport (private): the split-phase block
/// exchange (comm/exchange.h), the non-blocking sum and the split-phase
/// all-gather and reduce-scatter (comm/async_reduce.h).

#include <memory>

namespace shardtensor::comm {

namespace transport {
class PendingExchange;
class PendingReduce;
class PendingCollective;
}  // namespace transport

/// Move-only. A default-constructed handle is complete (test() is true,
/// finish() does nothing). Destroying a pending one cleans up without
/// throwing (an exchange cancels its receives and waits for its sends; a
/// reduction waits).
template <class Op>
class InFlight {
 public:
  InFlight();
  explicit InFlight(std::unique_ptr<Op> op);
  ~InFlight();
  InFlight(InFlight&&) noexcept;
  InFlight& operator=(InFlight&&) noexcept;
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

  /// Local, non-blocking: drives MPI progress; true once the operation completed
  /// (finish() must still be called).
  bool test();
  /// Local. Waits for completion. Throws c10::Error on MPI failure (or, for an
  /// exchange, a receive of the wrong size). A second call does nothing.
  void finish();

 private:
  std::unique_ptr<Op> op_;
};

// Instantiated once, in in_flight.cpp.
extern template class InFlight<transport::PendingExchange>;
extern template class InFlight<transport::PendingReduce>;
extern template class InFlight<transport::PendingCollective>;

}  // namespace shardtensor::comm
