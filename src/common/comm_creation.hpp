// Creating MPI communicators on a rank that other threads, and late or absent peers, may
// hold up: one lock per process around every creation, and the members' agreement before
// a creation that has no deadline of its own.
//
// The lock: every creation of an MPI communicator (MPI_Comm_create_group, MPI_Comm_split,
// MPI_Comm_dup) made while other threads may create one too (a mesh's communicators on the
// worker thread and a StatelessGroup on any thread, rank 0's controller thread among them)
// takes comm_creation_mutex(). Open MPI agrees on a new communicator's id with a
// multi-round protocol that two concurrent creations on one rank can deadlock in
// (ompi_comm_nextcid), so a rank makes one at a time.
//
// Why it cannot deadlock across ranks: a thread holds the lock across one creation only.
// A creation takes it after every member has announced that it is at this create (the
// agreement below, so all of them enter MPI_Comm_create_group holding their own lock, and
// it completes), and its waits while holding it are bounded by the creation's timeout.
// Meshes are created by the one worker thread of each rank, in command order, the same
// order on every member. A chain of waits therefore ends in a creation that completes or a
// timeout.
#pragma once

#include <mpi.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace meshrt::detail {

std::mutex& comm_creation_mutex();

// How an agreement's errors name ranks and what they create.
struct CreationWording {
  std::string op;  // "StatelessGroup::create"
  // Ranks of the parent communicator as the caller names them: "parent rank 0", and
  // "parent ranks [1, 2]" for a list.
  std::function<std::string(int)> rank;
  std::function<std::string(const std::vector<int>&)> ranks;
  std::string what;  // "the group [0, 1, 2]"
  std::string late;  // why a member may be missing: "(not called with ... within the timeout)"
};

// MPI_Comm_create_group and MPI_Comm_dup have no timeout: a member that never calls them
// leaves the others inside for ever. So the members first agree, with non-blocking
// point-to-point messages on the parent communicator (tag `tag`) and a deadline, and
// enter the blocking creation only when every member is known to enter it:
//   1. every member sends HELLO to every other and waits for every other's HELLO; at the
//      deadline it names the members whose HELLO is missing, sends ABORT to every other
//      and raises TimeoutError (missing_ranks(): those members);
//   2. with every HELLO in, it sends COMMIT to every other and waits for each other's
//      COMMIT or ABORT. Every member that sent HELLO sends exactly one of them, so every
//      member sees the same outcome: all COMMIT (create) or some ABORT (raise, naming
//      those members and the members they found missing, which an ABORT carries: a
//      member that comes after the others gave up finds their HELLO and ABORT waiting,
//      and names itself as the one they waited for).
// A HELLO carries a hash of the member list, so members that pass different lists get a
// UsageError instead of a hang. Messages left over from an attempt that failed are
// skipped where they can be told apart: a COMMIT or ABORT received in step 1 belongs to
// an earlier attempt (a member's current messages start with HELLO). MPI never overtakes
// between two ranks on one tag, so a member that retries sees the others' attempts in
// order.
class CreationAgreement {
 public:
  // `members`, `me`: ranks of `parent`; the wording's `ranks` names them.
  CreationAgreement(CreationWording wording, MPI_Comm parent, int me, std::vector<int> members, int tag,
                    std::chrono::duration<double> timeout);
  CreationAgreement(const CreationAgreement&) = delete;
  CreationAgreement& operator=(const CreationAgreement&) = delete;
  ~CreationAgreement();

  // Returns when every member has agreed to create, holding this rank's communicator
  // creation lock for the creation; raises (on every member alike) if not.
  [[nodiscard]] std::unique_lock<std::mutex> run();

 private:
  // magic, kind, members hash, and in an ABORT the first member its sender found missing
  // (its parent rank + 1; 0 for none).
  using Message = std::array<std::uint64_t, 4>;
  void send_all(int kind);
  void post(std::size_t i);
  void post_recvs();
  // Waits until every receive is taken (accept(i, msg) returns true) or the deadline; a
  // message accept() refuses is skipped and the receive posted again.
  void wait(const std::function<bool(std::size_t, const Message&)>& accept);
  std::vector<int> pending() const;
  void cancel_recvs() noexcept;
  // Tells every other member this attempt is off, then raises `e`.
  template <class E>
  [[noreturn]] void fail_with(const E& e);

  CreationWording wording_;
  MPI_Comm parent_;
  int me_;
  std::vector<int> members_;
  int tag_;
  std::chrono::duration<double> timeout_;
  std::vector<int> peers_;
  std::uint64_t hash_ = 0;
  std::array<Message, 4>* out_ = nullptr;
  std::vector<Message> in_;
  std::vector<MPI_Request> recvs_;
  std::vector<MPI_Request> sends_;
  bool sends_done_ = false;
  std::uint64_t missing_ = 0;  // what this member's ABORT carries
};

}  // namespace meshrt::detail
