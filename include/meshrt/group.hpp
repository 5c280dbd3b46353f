// StatelessGroup: typed object collectives (send, recv, broadcast, all_gather, barrier)
// over MPI for any subset of ranks, without global state (docs/ARCHITECTURE.md section 5).
//
//   // Ranks 0 and 1 form a group; later 0..3 form another; ranks 4 and 5 never call.
//   auto g = meshrt::StatelessGroup::create({0, 1});
//   if (g.rank() == 0) g.send_obj(std::string("hello"), 1);
//   else auto s = g.recv_obj<std::string>(0, std::chrono::seconds(5));
//
// Objects are any type Boost.Serialization can save (include the matching
// boost/serialization/<type>.hpp, give user structs a serialize()). std::string and
// std::vector of arithmetic types travel as raw bytes with no serialization copy.
//
// Every message carries a header with a type tag (demangled name + hash), the payload
// size and the operation's sequence number, so a type mismatch, a truncated or foreign
// message or a mismatched collective is a clear meshrt::UsageError / ProtocolError.
// Payloads over MESHRT_GROUP_CHUNK_BYTES (and so over 2 GiB) go in chunks. A recv_obj of
// the wrong type takes the whole object (its chunks too) and leaves the group usable: the
// next recv_obj from that source gets the next object. A send to self (any size) is
// queued locally and taken by a later recv_obj from self.
//
// Every object's first message says what its sender called (operation, root, type,
// sequence number). all_gather_obj and barrier start with each member telling every other,
// so members that disagree get a UsageError naming the disagreement on every rank and the
// group stays usable. broadcast_obj is one message per receiver, the root's, and the root
// does not wait to hear back (as MPI_Bcast's): a receiver that finds a disagreement
// breaks the group and tells every member, which raise the same UsageError in the call
// or, if their part had completed (the root's), at their next call on the group.
//
// MPI must be running: inside meshrt::run, or after the program's own MPI_Init_thread
// (MPI_THREAD_MULTIPLE) and before its MPI_Finalize. A group never initialises MPI; a
// call without it raises UsageError saying so (docs/guide.md, "Who initialises MPI").
//
// Every call waits with a deadline (the group's timeout, MESHRT_GROUP_TIMEOUT, or the
// call's own) and raises meshrt::TimeoutError naming the operation and the ranks that
// did not arrive. create and from_comm too: the members first agree with small
// non-blocking messages on the parent communicator (tag GroupOptions::create_tag), so a
// member that never calls is named (as a parent rank) instead of leaving the others in
// MPI_Comm_create_group. A rank creates one communicator at a time (a group's or a
// mesh's, from any thread), so a group made on rank 0's controller thread during a
// meshrt::run session cannot deadlock with the worker's mesh creation.
//
// A timeout that leaves messages in flight (a send, a broadcast, an all_gather, a
// barrier, a half-received chunked message) makes the group unusable: later calls raise
// UsageError. It also tells the other members so: a member that calls afterwards (one
// that arrives at the barrier after the others gave up) raises TimeoutError naming who
// broke the group, instead of completing with what was left in flight. A recv that timed
// out before anything arrived leaves it usable (a late message is then delivered to the
// next recv from that source).
//
// A group is not thread-safe: one operation at a time per group (like any MPI
// communicator used for ordered collectives). Different groups may be used from
// different threads (MPI_THREAD_MULTIPLE).
//
// Groups across two separately launched jobs (a trainer and an inference service):
// one job calls accept(port_file), the other connect(port_file). With Open MPI 4.1 two
// mpiexec jobs only find each other through a rendezvous server:
//   ompi-server --no-daemonize -r /tmp/ompi-server.uri &          # (as root: same)
//   mpiexec --allow-run-as-root --ompi-server file:/tmp/ompi-server.uri -n 2 trainer
//   mpiexec --allow-run-as-root --ompi-server file:/tmp/ompi-server.uri -n 1 service
// The accepting job writes the MPI port name to port_file (atomically: tmp + rename);
// the connecting job polls for it. Both jobs must destroy (or disconnect()) the group:
// the intercommunicator is released with MPI_Comm_disconnect (collective over both
// jobs), so neither sees a broken pipe at exit. (Open MPI 4.1.4 hangs in
// MPI_Comm_disconnect of the merged intracommunicator, so that one is freed.)
// ompi-server takes no --allow-run-as-root; mpiexec as root needs it (or
// OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1). MPI_Comm_accept itself has
// no timeout: it waits until the other job connects.
#pragma once

#include <mpi.h>

#include <boost/archive/binary_iarchive.hpp>
#include <boost/archive/binary_oarchive.hpp>
#include <boost/core/demangle.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <streambuf>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "meshrt/config.hpp"
#include "meshrt/error.hpp"

#if MESHRT_HAVE_NCCL
struct ncclComm;  // ncclComm_t is `struct ncclComm*`; keeps nccl.h out of this header
#endif

namespace meshrt {

// A per-call timeout; nullopt means the group's default.
using Timeout = std::optional<std::chrono::duration<double>>;

struct GroupOptions {
  // Default timeout of every call; nullopt: MESHRT_GROUP_TIMEOUT.
  Timeout timeout;
  // Largest single MPI message; nullopt: MESHRT_GROUP_CHUNK_BYTES. Tests set it small to
  // exercise chunking with a few KiB.
  std::optional<std::size_t> chunk_bytes;
  // Tag of MPI_Comm_create_group and of the members' agreement before it (point-to-point
  // messages on the parent communicator: keep the program's own messages off it). Groups
  // created concurrently by overlapping ranks need different tags.
  int create_tag = 0x6d72;
};

namespace detail {

// How a type is named on the wire: a readable, stable name and its 64-bit hash.
struct TypeTag {
  std::string name;
  std::uint64_t hash;
};
std::uint64_t fnv1a(std::string_view text);
// A demangled type name as code writes it: default template arguments (allocators, char
// traits, comparators, hashes) dropped, "std::__cxx11::" read as "std::", and
// std::basic_string<char> as std::string: "std::vector<std::string>", not the
// libstdc++ spelling five times as long.
std::string readable_type_name(std::string name);

template <class T>
const TypeTag& type_tag() {
  static const TypeTag tag = [] {
    std::string name = readable_type_name(boost::core::demangle(typeid(T).name()));
    const std::uint64_t h = fnv1a(name);
    return TypeTag{std::move(name), h};
  }();
  return tag;
}

// Types whose bytes are the payload: no serialization copy, received in place.
template <class T>
struct is_raw : std::false_type {};
template <>
struct is_raw<std::string> : std::true_type {};
template <class E, class A>
struct is_raw<std::vector<E, A>> : std::bool_constant<std::is_arithmetic_v<E> && !std::is_same_v<E, bool>> {};

// Where a received payload goes: the group asks for exactly `size` bytes of memory once
// the header has been validated, and writes the payload there.
class PayloadSink {
 public:
  virtual char* prepare(std::size_t size) = 0;

 protected:
  ~PayloadSink() = default;
};

template <class T>
class RawSink final : public PayloadSink {
 public:
  explicit RawSink(T& out) : out_(out) {}
  char* prepare(std::size_t size) override {
    using E = typename T::value_type;
    if (size % sizeof(E) != 0) {
      throw ProtocolError("payload of " + std::to_string(size) + " bytes is not a whole number of " +
                          std::to_string(sizeof(E)) + "-byte elements of " + type_tag<T>().name);
    }
    out_.resize(size / sizeof(E));
    return reinterpret_cast<char*>(out_.data());
  }

 private:
  T& out_;
};

class BufferSink final : public PayloadSink {
 public:
  explicit BufferSink(std::string& buf) : buf_(buf) {}
  char* prepare(std::size_t size) override {
    buf_.resize(size);
    return buf_.data();
  }

 private:
  std::string& buf_;
};

// Appends to a std::string: serializing needs exactly one copy of the object's bytes.
class StringOutBuf final : public std::streambuf {
 public:
  explicit StringOutBuf(std::string& s) : s_(s) {}

 protected:
  std::streamsize xsputn(const char* p, std::streamsize n) override {
    s_.append(p, static_cast<std::size_t>(n));
    return n;
  }
  int_type overflow(int_type c) override {
    if (!traits_type::eq_int_type(c, traits_type::eof())) s_.push_back(traits_type::to_char_type(c));
    return traits_type::not_eof(c);
  }

 private:
  std::string& s_;
};

// Reads a byte range; reading past its end fails the archive instead of overrunning.
class SpanInBuf final : public std::streambuf {
 public:
  explicit SpanInBuf(std::span<const char> bytes) {
    char* p = const_cast<char*>(bytes.data());  // std::streambuf's API is non-const; never written
    setg(p, p, p + bytes.size());
  }
  std::size_t remaining() const { return static_cast<std::size_t>(egptr() - gptr()); }
};

void serialize_failed(const TypeTag& tag, const char* what);
[[noreturn]] void deserialize_failed(const TypeTag& tag, std::size_t size, const char* what, const std::string& where);

constexpr unsigned kArchiveFlags = boost::archive::no_header | boost::archive::no_codecvt;

template <class T>
void save(const T& obj, std::string& out) {
  out.clear();
  try {
    StringOutBuf buf(out);
    boost::archive::binary_oarchive ar(buf, kArchiveFlags);
    ar << obj;
  } catch (const std::exception& e) {
    serialize_failed(type_tag<T>(), e.what());
  }
}

template <class T>
void load(std::span<const char> bytes, T& obj, const std::string& where) {
  try {
    SpanInBuf buf(bytes);
    boost::archive::binary_iarchive ar(buf, kArchiveFlags);
    ar >> obj;
    if (buf.remaining() != 0) {
      deserialize_failed(type_tag<T>(), bytes.size(),
                         (std::to_string(buf.remaining()) + " bytes left over after the object").c_str(), where);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // boost::archive exceptions, std::bad_alloc, std::length_error
    deserialize_failed(type_tag<T>(), bytes.size(), e.what(), where);
  }
}

}  // namespace detail

class StatelessGroup {
 public:
  // Only the members call it (MPI_Comm_create_group). `members` are ranks of `parent`, in
  // the group's rank order: members[i] becomes group rank i. Every member must pass the
  // same list (a different one is a UsageError on every member). A member that does not
  // call it within the timeout is named in a TimeoutError (missing_ranks(): parent ranks).
  static StatelessGroup create(const std::vector<int>& members, MPI_Comm parent = MPI_COMM_WORLD,
                               const GroupOptions& options = {});
  // A group over all ranks of `comm`, on a duplicate of it (`comm` itself is never used).
  static StatelessGroup from_comm(MPI_Comm comm, const GroupOptions& options = {});

  // Cross-job groups. accept(): every rank of `local` calls it; its rank 0 opens an MPI
  // port and writes the port name to `port_file`. connect(): every rank of `local` calls
  // it; `where` is a file path (waited for up to the timeout) or "env:NAME" (the port
  // name is in environment variable NAME). The merged group has the accepting job's
  // ranks first, in `local` order, then the connecting job's.
  static StatelessGroup accept(const std::string& port_file, MPI_Comm local = MPI_COMM_WORLD,
                               const GroupOptions& options = {});
  static StatelessGroup connect(const std::string& where, MPI_Comm local = MPI_COMM_WORLD,
                                const GroupOptions& options = {});

  StatelessGroup(StatelessGroup&&) noexcept;
  StatelessGroup& operator=(StatelessGroup&&) noexcept;
  StatelessGroup(const StatelessGroup&) = delete;
  StatelessGroup& operator=(const StatelessGroup&) = delete;
  ~StatelessGroup();

  int rank() const;
  int world_size() const;
  // Rank in the parent communicator of group rank i (for from_comm/accept/connect groups:
  // the rank in MPI_COMM_WORLD of this job, or -1 for a rank of the other job).
  int parent_rank(int i) const;
  std::vector<int> members() const;
  bool usable() const;
  // The group's own communicator, for tests and for building on top (e.g. NCCL). Sending
  // on it with tags below 64 breaks the group's protocol.
  MPI_Comm comm() const;
  std::chrono::duration<double> default_timeout() const;
  std::size_t chunk_bytes() const;

  // Releases the communicator now (MPI_Comm_disconnect for cross-job groups: collective
  // over both jobs); the destructor does it otherwise.
  void disconnect();

  template <class T>
  void send_obj(const T& obj, int dst, Timeout timeout = {}) {
    if constexpr (detail::is_raw<T>::value) {
      send_bytes(detail::type_tag<T>(), true, as_bytes(obj), dst, timeout);
    } else {
      std::string& buf = scratch();
      detail::save(obj, buf);
      send_bytes(detail::type_tag<T>(), false, buf, dst, timeout);
    }
  }

  template <class T>
  T recv_obj(int src, Timeout timeout = {}) {
    T out{};
    recv_obj_into(out, src, timeout);
    return out;
  }

  // Receives into `out`, reusing its memory where the type allows (raw types).
  template <class T>
  void recv_obj_into(T& out, int src, Timeout timeout = {}) {
    if constexpr (detail::is_raw<T>::value) {
      detail::RawSink<T> sink(out);
      recv_bytes(detail::type_tag<T>(), true, sink, src, timeout);
    } else {
      std::string& buf = scratch();
      detail::BufferSink sink(buf);
      recv_bytes(detail::type_tag<T>(), false, sink, src, timeout);
      detail::load(buf, out, where("recv_obj", src));
    }
  }

  // Every member calls it with the same src; returns src's object on every rank. `obj` is
  // taken by value: the root gets it back without a copy (pass std::move), other ranks
  // receive into its memory where the type allows.
  template <class T>
  T broadcast_obj(T obj, int src, Timeout timeout = {}) {
    if constexpr (detail::is_raw<T>::value) {
      detail::RawSink<T> sink(obj);
      broadcast_bytes(detail::type_tag<T>(), true, as_bytes(obj), sink, src, timeout);
    } else {
      std::string& buf = scratch();
      if (rank() == src) detail::save(obj, buf);
      detail::BufferSink sink(buf);
      broadcast_bytes(detail::type_tag<T>(), false, buf, sink, src, timeout);
      if (rank() != src) detail::load(buf, obj, where("broadcast_obj", src));
    }
    return obj;
  }

  // Every member's object, in group rank order.
  template <class T>
  std::vector<T> all_gather_obj(const T& obj, Timeout timeout = {}) {
    std::vector<T> out;
    all_gather_obj_into(obj, out, timeout);
    return out;
  }

  // As all_gather_obj, into `out` (resized to world_size()), reusing its elements' memory
  // where the type allows.
  template <class T>
  void all_gather_obj_into(const T& obj, std::vector<T>& out, Timeout timeout = {}) {
    out.resize(static_cast<std::size_t>(world_size()));
    if constexpr (detail::is_raw<T>::value) {
      std::vector<detail::RawSink<T>> sinks;
      sinks.reserve(out.size());  // no reallocation: ptrs point into it
      std::vector<detail::PayloadSink*> ptrs;
      for (auto& o : out) ptrs.push_back(&sinks.emplace_back(o));
      all_gather_bytes(detail::type_tag<T>(), true, as_bytes(obj), ptrs, timeout);
      // The own element is filled from `obj` by the group (ptrs[rank()] too).
    } else {
      std::string mine;
      detail::save(obj, mine);
      std::vector<std::string> bufs(out.size());
      std::vector<detail::BufferSink> sinks;
      sinks.reserve(bufs.size());
      std::vector<detail::PayloadSink*> ptrs;
      for (auto& b : bufs) ptrs.push_back(&sinks.emplace_back(b));
      all_gather_bytes(detail::type_tag<T>(), false, mine, ptrs, timeout);
      for (std::size_t i = 0; i < out.size(); ++i) {
        if (static_cast<int>(i) == rank()) {
          out[i] = obj;
        } else {
          detail::load(bufs[i], out[i], where("all_gather_obj", static_cast<int>(i)));
        }
      }
    }
  }

  void barrier(Timeout timeout = {});

  // The transfer functions the templates call; all MPI calls live in src/group/.
  // `raw`: the payload is the object's bytes (else a Boost binary archive).
  void send_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload, int dst, Timeout timeout);
  void recv_bytes(const detail::TypeTag& type, bool raw, detail::PayloadSink& sink, int src, Timeout timeout);
  void broadcast_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload, detail::PayloadSink& sink,
                       int src, Timeout timeout);
  void all_gather_bytes(const detail::TypeTag& type, bool raw, std::span<const char> payload,
                        std::span<detail::PayloadSink* const> sinks, Timeout timeout);

 private:
  struct Impl;
  explicit StatelessGroup(std::unique_ptr<Impl> impl);
  static std::unique_ptr<Impl> make_impl(MPI_Comm comm, std::vector<int> parent_ranks, const GroupOptions& options);
  static StatelessGroup join(bool accepting, const std::string& where, MPI_Comm local, const GroupOptions& options);

  template <class T>
  static std::span<const char> as_bytes(const T& obj) {
    return {reinterpret_cast<const char*>(obj.data()), obj.size() * sizeof(typename T::value_type)};
  }
  std::string& scratch();
  // "group rank R (parent rank P) in <op> from/to peer Q (parent rank S)", for errors.
  std::string where(const char* op, int peer) const;

  std::unique_ptr<Impl> impl_;
};

#if MESHRT_HAVE_NCCL
// An NCCL communicator over the group's ranks (group rank order): group rank 0 makes the
// ncclUniqueId, broadcast_obj sends its 128 bytes to all, the members meet at a barrier,
// and every member calls ncclCommInitRank on `device` (made current with cudaSetDevice).
// Every member calls it. Each step has `timeout` (the group's default when none): a
// member that does not come is named in a TimeoutError, and an init that does not finish
// in time (a member that failed inside it) raises TimeoutError, leaving the init to a
// thread of its own. The result is a blocking communicator; the caller owns it
// (ncclCommDestroy).
ncclComm* make_nccl_comm(StatelessGroup& group, int device, Timeout timeout = {});
#endif

}  // namespace meshrt
