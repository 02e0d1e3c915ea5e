// InFlight<Op> (comm/in_flight.h) for the transport's split-phase
// operations, instantiated here where they are complete types.
#include "comm/in_flight.h"

#include "comm/transport.h"

namespace shardtensor::comm {

template <class Op>
InFlight<Op>::InFlight() = default;
template <class Op>
InFlight<Op>::InFlight(std::unique_ptr<Op> op) : op_(std::move(op)) {}
template <class Op>
InFlight<Op>::~InFlight() = default;
template <class Op>
InFlight<Op>::InFlight(InFlight&&) noexcept = default;
template <class Op>
InFlight<Op>& InFlight<Op>::operator=(InFlight&&) noexcept = default;

template <class Op>
bool InFlight<Op>::test() {
  return op_ ? op_->test() : true;
}

template <class Op>
void InFlight<Op>::finish() {
  if (op_) op_->finish();
}

template class InFlight<transport::PendingExchange>;
template class InFlight<transport::PendingReduce>;
template class InFlight<transport::PendingCollective>;

}  // namespace shardtensor::comm
