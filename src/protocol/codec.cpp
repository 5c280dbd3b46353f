// The wire codec: hand-written, not Boost.Serialization.
//
// Why: `meshrt-bench codec` (apps/meshrt-bench/codec.cpp; figures in docs/benchmarks.md)
// finds a Boost binary archive an order of magnitude slower for a small command, missing
// the <= 1 us target (archive construction and per-field virtual dispatch dominate); for
// bulk data both are memcpy-bound. Boost stays for StatelessGroup's arbitrary objects
// (include/meshrt/tensor_serialization.hpp).
//
// Format: fixed-width little-endian integers (a memcpy each: no varint branches), u32
// lengths before strings and sequences, one tag byte per variant. Every length is checked
// against the bytes left before anything is allocated, so a hostile frame of N bytes
// makes the decoder allocate O(N): at worst one Value (~56 bytes) per 1-byte tag.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <unordered_set>

#include "meshrt/internal/protocol.hpp"

namespace meshrt {

static_assert(std::endian::native == std::endian::little,
              "the meshrt wire format is little-endian; a big-endian port needs byte swaps in Writer/Reader");
static_assert(sizeof(Ref) == sizeof(std::uint64_t) && std::is_trivially_copyable_v<Ref>);

namespace protocol {

bool operator==(const CommandGroup& a, const CommandGroup& b) {
  return a.commands == b.commands;
}

bool operator==(const DefineRecording& a, const DefineRecording& b) {
  return a.recording == b.recording && a.formals == b.formals && a.locals == b.locals && a.idents == b.idents &&
         a.temporaries == b.temporaries && a.commands == b.commands;
}

namespace {

constexpr std::string_view kCommandNames[] = {
    "CreateDeviceMesh", "CreateStream",  "CallFunction",   "FetchValue",      "Reduce",
    "SendTensor",       "BorrowCreate",  "BorrowFirstUse", "BorrowDrop",      "DeleteRefs",
    "CommandGroup",     "RequestStatus", "Exit",           "DefineRecording", "CallRecording",
    "Collective"};
constexpr std::string_view kReplyNames[] = {"Status", "RemoteFunctionFailed", "FetchResult", "Restarted", "TreeStatus"};
static_assert(std::size(kCommandNames) == std::variant_size_v<Command>);
static_assert(std::size(kReplyNames) == std::variant_size_v<Reply>);

// The wire tag of a command or reply is its index in the variant (the encoder writes
// index()). The decoder names them; the asserts below fail to compile if the variant's
// order and these constants ever disagree, instead of a round trip failing at run time.
template <class T, class Variant>
struct variant_index;
template <class T, class... Ts>
struct variant_index<T, std::variant<Ts...>> {
  static constexpr std::size_t value = [] {
    constexpr bool same[] = {std::is_same_v<T, Ts>...};
    std::size_t i = 0;
    while (i < sizeof...(Ts) && !same[i]) ++i;
    return i;
  }();
  static_assert(value < sizeof...(Ts), "not an alternative of the variant");
};
template <class T, class Variant>
inline constexpr std::uint8_t tag_of = static_cast<std::uint8_t>(variant_index<T, Variant>::value);

enum class CommandTag : std::uint8_t {
  CreateDeviceMesh = 0,
  CreateStream = 1,
  CallFunction = 2,
  FetchValue = 3,
  Reduce = 4,
  SendTensor = 5,
  BorrowCreate = 6,
  BorrowFirstUse = 7,
  BorrowDrop = 8,
  DeleteRefs = 9,
  CommandGroup = 10,
  RequestStatus = 11,
  Exit = 12,
  DefineRecording = 13,
  CallRecording = 14,
  Collective = 15,
};
static_assert(static_cast<std::uint8_t>(CommandTag::CreateDeviceMesh) == tag_of<CreateDeviceMesh, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::CreateStream) == tag_of<CreateStream, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::CallFunction) == tag_of<CallFunction, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::FetchValue) == tag_of<FetchValue, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::Reduce) == tag_of<Reduce, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::SendTensor) == tag_of<SendTensor, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::BorrowCreate) == tag_of<BorrowCreate, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::BorrowFirstUse) == tag_of<BorrowFirstUse, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::BorrowDrop) == tag_of<BorrowDrop, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::DeleteRefs) == tag_of<DeleteRefs, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::CommandGroup) == tag_of<CommandGroup, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::RequestStatus) == tag_of<RequestStatus, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::Exit) == tag_of<Exit, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::DefineRecording) == tag_of<DefineRecording, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::CallRecording) == tag_of<CallRecording, Command>);
static_assert(static_cast<std::uint8_t>(CommandTag::Collective) == tag_of<Collective, Command>);

enum class ReplyTag : std::uint8_t {
  Status = 0,
  RemoteFunctionFailed = 1,
  FetchResult = 2,
  Restarted = 3,
  TreeStatus = 4,
};
static_assert(static_cast<std::uint8_t>(ReplyTag::Status) == tag_of<Status, Reply>);
static_assert(static_cast<std::uint8_t>(ReplyTag::RemoteFunctionFailed) == tag_of<RemoteFunctionFailed, Reply>);
static_assert(static_cast<std::uint8_t>(ReplyTag::FetchResult) == tag_of<FetchResult, Reply>);
static_assert(static_cast<std::uint8_t>(ReplyTag::Restarted) == tag_of<Restarted, Reply>);
static_assert(static_cast<std::uint8_t>(ReplyTag::TreeStatus) == tag_of<TreeStatus, Reply>);

constexpr std::byte kMagic0{'m'};
constexpr std::byte kMagic1{'r'};
enum class FrameKind : std::uint8_t {
  Command = 1,
  Reply = 2,
  Handshake = 3,
  Value = 4,
  Query = 5,
  QueryAnswer = 6,
  Envelope = 7
};
constexpr std::size_t kHeaderSize = 4;
// More dimensions than any real tensor or mesh; bounds what a frame can ask for.
constexpr std::uint32_t kMaxDims = 64;
// Far above any MPI job today, far below what would make decoding a slice expensive.
constexpr std::int64_t kMaxSliceRanks = std::int64_t{1} << 20;
constexpr std::int64_t kMaxRank = std::numeric_limits<std::int32_t>::max();

// ------------------------------------------------------------------ writer

// Writes frames into a Buffer or, with kCount, only counts the bytes it would write
// (encoded_size: one walk, no copy, so a 2 GiB tensor costs nothing to measure).
template <bool kCount>
class BasicWriter {
 public:
  explicit BasicWriter(Buffer& out) requires(!kCount) : out_(&out) {}
  BasicWriter() requires kCount = default;
  std::size_t counted() const noexcept { return counted_; }

  template <class T>
  void pod(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    put(&v, sizeof(T));
  }
  void u8(std::uint8_t v) { pod(v); }
  void boolean(bool v) { pod(static_cast<std::uint8_t>(v ? 1 : 0)); }
  void length(std::size_t n, const char* field) {
    if (n > std::numeric_limits<std::uint32_t>::max()) {
      throw ProtocolError(fmt::format("protocol: encoding {}: expected at most {} items, found {}", field,
                                      std::numeric_limits<std::uint32_t>::max(), n));
    }
    pod(static_cast<std::uint32_t>(n));
  }
  void bytes(const void* p, std::size_t n) { put(p, n); }
  void string(std::string_view s, const char* field) {
    length(s.size(), field);
    bytes(s.data(), s.size());
  }
  void ref(Ref r) { pod(r.id); }
  void refs(const std::vector<Ref>& rs, const char* field) {
    length(rs.size(), field);
    bytes(rs.data(), rs.size() * sizeof(Ref));
  }
  void i64s(const std::vector<std::int64_t>& v, const char* field) {
    length(v.size(), field);
    bytes(v.data(), v.size() * sizeof(std::int64_t));
  }
  void slice(const NDSlice& s) {
    pod(s.offset());
    i64s(s.sizes(), "NDSlice sizes");
    bytes(s.strides().data(), s.strides().size() * sizeof(std::int64_t));
  }
  void meta(const TensorMeta& m) {
    u8(static_cast<std::uint8_t>(m.dtype()));
    u8(static_cast<std::uint8_t>(m.device().kind()));
    pod(static_cast<std::int32_t>(m.device().index()));
    i64s(m.shape(), "tensor shape");
  }
  void tensor(const Tensor& t) {
    if (!t.defined())
      throw ProtocolError("protocol: encoding a tensor: expected a defined tensor, found an undefined one");
    if (!t.device().is_cpu()) {
      throw ProtocolError(
          fmt::format("protocol: encoding a tensor: expected a CPU tensor, found {}; copy it to the host first",
                      t.meta().to_string()));
    }
    u8(static_cast<std::uint8_t>(t.dtype()));
    i64s(t.shape(), "tensor shape");
    pod(static_cast<std::uint64_t>(t.nbytes()));
    bytes(t.raw_data(), t.nbytes());
  }
  void value(const Value& v) {
    u8(static_cast<std::uint8_t>(v.kind()));
    switch (v.kind()) {
      case Value::Kind::None:
        return;
      case Value::Kind::Bool:
        return boolean(v.as_bool());
      case Value::Kind::Int:
        return pod(v.as_int());
      case Value::Kind::Double:
        return pod(v.as_number());
      case Value::Kind::String:
        return string(v.as_string(), "string value");
      case Value::Kind::Ref:
        return ref(v.as_ref());
      case Value::Kind::Tensor:
        return tensor(v.as_tensor());
      case Value::Kind::Meta:
        return meta(v.as_meta());
      case Value::Kind::List:
        length(v.as_list().size(), "list");
        for (const Value& item : v.as_list()) value(item);
        return;
      case Value::Kind::Dict:
        length(v.as_dict().size(), "dict");
        for (const auto& [k, item] : v.as_dict()) {
          string(k, "dict key");
          value(item);
        }
        return;
      case Value::Kind::Object:
        throw ProtocolError(
            fmt::format("protocol: encoding a value: expected one that travels, found a {}: a worker object stays on "
                        "its worker (pass its handle)",
                        v.to_string()));
    }
  }
  void values(const std::vector<Value>& vs, const char* field) {
    length(vs.size(), field);
    for (const Value& v : vs) value(v);
  }

  void command(const Command& c) {
    u8(static_cast<std::uint8_t>(c.index()));
    std::visit([&](const auto& m) { body(m); }, c);
  }
  void reply(const Reply& r) {
    u8(static_cast<std::uint8_t>(r.index()));
    std::visit([&](const auto& m) { body(m); }, r);
  }

  void body(const CreateDeviceMesh& m) {
    ref(m.result);
    length(m.names.size(), "CreateDeviceMesh names");
    for (const auto& n : m.names) string(n, "CreateDeviceMesh name");
    slice(m.ranks);
    u8(static_cast<std::uint8_t>(m.device));
  }
  void body(const CreateStream& m) {
    ref(m.result);
    boolean(m.is_default);
  }
  void body(const CallFunction& m) {
    pod(m.ident);
    refs(m.results, "CallFunction results");
    refs(m.mutates, "CallFunction mutates");
    string(m.function, "CallFunction function");
    values(m.args, "CallFunction args");
    ref(m.stream);
    ref(m.mesh);
    boolean(m.keeps_object);
  }
  void body(const FetchValue& m) {
    pod(m.ident);
    refs(m.mutates, "FetchValue mutates");
    boolean(m.function.has_value());
    if (m.function) string(*m.function, "FetchValue function");
    value(m.value);
    ref(m.stream);
  }
  void body(const Reduce& m) {
    ref(m.result);
    ref(m.tensor);
    meta(m.factory);
    ref(m.mesh);
    ref(m.stream);
    string(m.dim, "Reduce dim");
    u8(static_cast<std::uint8_t>(m.reduction));
    boolean(m.scatter);
    boolean(m.inplace);
    pod(m.ident);
  }
  void body(const Collective& m) {
    u8(static_cast<std::uint8_t>(m.kind));
    ref(m.result);
    ref(m.tensor);
    meta(m.factory);
    ref(m.mesh);
    ref(m.stream);
    length(m.dims.size(), "Collective dims");
    for (const auto& d : m.dims) string(d, "Collective dim");
    u8(static_cast<std::uint8_t>(m.reduction));
    boolean(m.scatter);
    boolean(m.inplace);
    pod(m.root);
    pod(m.ident);
  }
  void body(const SendTensor& m) {
    ref(m.result);
    slice(m.from_ranks);
    slice(m.to_ranks);
    ref(m.tensor);
    meta(m.factory);
    ref(m.stream);
    i64s(m.to_order, "SendTensor to_order");
    i64s(m.from_order, "SendTensor from_order");
    pod(m.ident);
  }
  void body(const BorrowCreate& m) {
    ref(m.result);
    ref(m.tensor);
    ref(m.from_stream);
    ref(m.to_stream);
    boolean(m.already_borrowed);
  }
  void body(const BorrowFirstUse& m) { ref(m.borrow); }
  void body(const BorrowDrop& m) { ref(m.borrow); }
  void body(const DeleteRefs& m) { refs(m.refs, "DeleteRefs refs"); }
  void body(const CommandGroup& m) {
    length(m.commands.size(), "CommandGroup commands");
    for (const Command& c : m.commands) command(c);
  }
  void body(const RequestStatus& m) { pod(m.ident); }
  void body(const Exit& m) { boolean(m.restart); }
  void body(const DefineRecording& m) {
    ref(m.recording);
    pod(m.formals);
    pod(m.locals);
    pod(m.idents);
    refs(m.temporaries, "DefineRecording temporaries");
    length(m.commands.size(), "DefineRecording commands");
    for (const Command& c : m.commands) command(c);
  }
  void body(const CallRecording& m) {
    ref(m.recording);
    refs(m.actuals, "CallRecording actuals");
    pod(m.ref_base);
    pod(m.ident_base);
  }
  void body(const Status& m) {
    pod(m.first_uncompleted_ident);
    pod(m.live_values);
  }
  void body(const RemoteFunctionFailed& m) {
    pod(m.ident);
    string(m.error, "RemoteFunctionFailed error");
    pod(m.rank);
    string(m.function, "RemoteFunctionFailed function");
    string(m.exception_type, "RemoteFunctionFailed exception_type");
  }
  void body(const FetchResult& m) {
    pod(m.ident);
    value(m.value);
  }
  void body(const Restarted&) {}
  void body(const TreeStatus& m) {
    if (m.direct_ranks.size() != m.direct_counts.size()) {
      throw ProtocolError(fmt::format("protocol: encoding a TreeStatus: expected one count per rank ({}), found {}",
                                      m.direct_ranks.size(), m.direct_counts.size()));
    }
    pod(m.first_uncompleted_ident);
    pod(m.epoch);
    pod(static_cast<std::uint32_t>(m.direct_ranks.size()));
    for (std::int32_t r : m.direct_ranks) pod(r);
    for (std::uint64_t c : m.direct_counts) pod(c);
  }
  void body(const Handshake& m) {
    string(m.meshrt_version, "Handshake meshrt_version");
    pod(m.protocol_version);
    pod(m.function_table_hash);
    pod(m.thread_level);
    pod(m.rank);
    string(m.host, "Handshake host");
  }
  void body(const Query& m) {
    pod(m.id);
    u8(static_cast<std::uint8_t>(m.op));
    pod(m.limit);
    string(m.reason, "Query reason");
  }
  void body(const QueryAnswer& m) {
    pod(m.query);
    pod(m.rank);
    u8(static_cast<std::uint8_t>(m.op));
    string(m.payload, "QueryAnswer payload");
    string(m.error, "QueryAnswer error");
  }
  void body(const Envelope& m) {
    pod(m.fanout);
    pod(static_cast<std::uint32_t>(m.ranks.size()));
    for (std::int32_t r : m.ranks) pod(r);
    for (std::uint64_t q : m.seqs) pod(q);
    pod(static_cast<std::uint32_t>(m.payload.size()));
    put(m.payload.data(), m.payload.size());
  }

 private:
  void put(const void* p, std::size_t n) {
    if constexpr (kCount) {
      counted_ += n;
    } else if (n > 0) {
      std::memcpy(out_->extend(n), p, n);
    }
  }
  Buffer* out_ = nullptr;
  std::size_t counted_ = 0;
};
using Writer = BasicWriter<false>;

void header(Buffer& out, FrameKind kind) {
  std::byte* p = out.extend(kHeaderSize);
  p[0] = kMagic0;
  p[1] = kMagic1;
  p[2] = std::byte{kVersion};
  p[3] = static_cast<std::byte>(kind);
}

// ------------------------------------------------------------------ reader

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : p_(bytes.data()), size_(bytes.size()) {}

  [[noreturn]] void fail(const char* field, std::string_view what) const { fail_at(pos_, field, what); }
  [[noreturn, gnu::cold, gnu::noinline]] void fail_at(std::size_t at, const char* field, std::string_view what) const {
    throw ProtocolError(fmt::format("protocol: decoding {} at byte {} of a {}-byte frame: {}", field, at, size_, what));
  }
  std::size_t left() const noexcept { return size_ - pos_; }

  // The checks below inline into every field's read; their messages are formatted out of
  // line, so a command's decode stays a few loads and compares per field.
  [[gnu::always_inline]] void need(std::size_t n, const char* field) const {
    if (left() < n) [[unlikely]]
      short_of(n, field);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void short_of(std::size_t n, const char* field) const {
    fail(field, fmt::format("expected {} more bytes, found {}", n, left()));
  }
  template <class T>
  [[gnu::always_inline]] T pod(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  [[gnu::always_inline]] std::uint8_t u8(const char* field) { return pod<std::uint8_t>(field); }
  [[gnu::always_inline]] bool boolean(const char* field) {
    const std::uint8_t b = u8(field);
    if (b > 1) [[unlikely]]
      not_a_bool(b, field);
    return b == 1;
  }
  [[noreturn, gnu::cold, gnu::noinline]] void not_a_bool(std::uint8_t b, const char* field) const {
    fail_at(pos_ - 1, field, fmt::format("expected a bool byte 0 or 1, found {}", b));
  }
  template <class E>
  E enumeration(const char* field, int count) {
    const std::uint8_t b = u8(field);
    if (b >= count) [[unlikely]]
      out_of_range(b, count, field);
    return static_cast<E>(b);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void out_of_range(std::uint8_t b, int count, const char* field) const {
    fail_at(pos_ - 1, field, fmt::format("expected a value in 0..{}, found {}", count - 1, b));
  }
  // A count of items that take at least `min_item_bytes` each: refused before anything is
  // allocated if the rest of the frame cannot hold that many.
  [[gnu::always_inline]] std::size_t length(const char* field, std::size_t min_item_bytes) {
    const std::size_t n = pod<std::uint32_t>(field);
    if (min_item_bytes > 0 && n > left() / min_item_bytes) [[unlikely]]
      too_many(n, min_item_bytes, field);
    return n;
  }
  [[noreturn, gnu::cold, gnu::noinline]] void too_many(std::size_t n, std::size_t min_item_bytes,
                                                       const char* field) const {
    fail_at(pos_ - sizeof(std::uint32_t), field,
            fmt::format("expected a count the remaining {} bytes can hold ({} bytes each), found {}", left(),
                        min_item_bytes, n));
  }
  std::string string(const char* field) {
    std::string s;
    string_into(s, field);
    return s;
  }
  // Into a field of a command being decoded in place: no temporary to move.
  [[gnu::always_inline]] void string_into(std::string& out, const char* field) {
    const std::size_t n = length(field, 1);
    out.assign(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
  }
  [[gnu::always_inline]] Ref ref(const char* field) { return Ref{pod<std::uint64_t>(field)}; }
  std::vector<Ref> refs(const char* field) {
    std::vector<Ref> out;
    refs_into(out, field);
    return out;
  }
  [[gnu::always_inline]] void refs_into(std::vector<Ref>& out, const char* field) {
    const std::size_t n = length(field, sizeof(Ref));
    if (n == 0) {  // most commands mutate nothing
      out.clear();
      return;
    }
    out.resize(n);
    std::memcpy(out.data(), p_ + pos_, n * sizeof(Ref));
    pos_ += n * sizeof(Ref);
  }
  std::vector<std::int64_t> dims(const char* field, std::size_t n) {
    need(n * sizeof(std::int64_t), field);
    std::vector<std::int64_t> out(n);
    if (n > 0) std::memcpy(out.data(), p_ + pos_, n * sizeof(std::int64_t));
    pos_ += n * sizeof(std::int64_t);
    return out;
  }
  std::size_t ndim(const char* field) {
    const std::size_t at = pos_;
    const std::size_t n = length(field, sizeof(std::int64_t));
    if (n > kMaxDims) fail_at(at, field, fmt::format("expected at most {} dimensions, found {}", kMaxDims, n));
    return n;
  }
  NDSlice slice(const char* field) {
    const std::size_t at = pos_;
    const auto offset = pod<std::int64_t>(field);
    const std::size_t n = ndim(field);
    auto sizes = dims(field, n);
    auto strides = dims(field, n);
    // Ranks are MPI ranks (int) and a mesh has at most kMaxSliceRanks of them. Checked
    // before NDSlice's own validation, which enumerates interleaved slices: without the
    // bound a 100-byte frame could cost seconds and tens of MiB.
    std::int64_t len = 1, last = offset;
    for (std::size_t d = 0; d < n; ++d) {
      std::int64_t extent = 0;
      if (sizes[d] < 1 || strides[d] < 1) break;  // NDSlice names these precisely below
      if (__builtin_mul_overflow(len, sizes[d], &len) || __builtin_mul_overflow(sizes[d] - 1, strides[d], &extent) ||
          __builtin_add_overflow(last, extent, &last) || len > kMaxSliceRanks || last > kMaxRank) {
        fail_at(at, field,
                fmt::format("expected at most {} ranks, each <= {}, found sizes [{}] and strides [{}] from offset {}",
                            kMaxSliceRanks, kMaxRank, fmt::join(sizes, ", "), fmt::join(strides, ", "), offset));
      }
    }
    try {
      return NDSlice(offset, std::move(sizes), std::move(strides));
    } catch (const SliceError& e) {
      fail_at(at, field, fmt::format("expected a valid NDSlice, found {}", e.what()));
    }
  }
  TensorMeta meta(const char* field) {
    const std::size_t at = pos_;
    const auto dtype = enumeration<DType>(field, kNumDTypes);
    const auto kind = enumeration<Device::Kind>(field, Device::kNumKinds);
    const auto index = pod<std::int32_t>(field);
    if (index < 0 || (kind == Device::Kind::Cpu && index != 0)) {
      fail_at(pos_ - 4, field, fmt::format("expected a device index >= 0 (0 for cpu), found {}", index));
    }
    auto shape = dims(field, ndim(field));
    try {
      return TensorMeta(std::move(shape), dtype, Device::of(kind, index));
    } catch (const UsageError& e) {
      fail_at(at, field, fmt::format("expected a valid tensor meta, found {}", e.what()));
    }
  }
  Tensor tensor(const char* field) {
    const std::size_t at = pos_;
    const auto dtype = enumeration<DType>(field, kNumDTypes);
    auto shape = dims(field, ndim(field));
    std::int64_t numel = 0;
    try {
      numel = checked_numel(shape, dtype);
    } catch (const UsageError& e) {
      fail_at(at, field, fmt::format("expected a valid tensor shape, found {}", e.what()));
    }
    const std::size_t nbytes_at = pos_;
    const auto nbytes = pod<std::uint64_t>(field);
    const auto expected = static_cast<std::uint64_t>(numel) * element_size(dtype);
    if (nbytes != expected) {
      fail_at(nbytes_at, field,
              fmt::format("expected nbytes = numel {} x {} bytes = {}, found {}", numel, element_size(dtype), expected,
                          nbytes));
    }
    need(nbytes, field);
    // One allocation and one memcpy: no per-element work on the bulk path.
    Tensor t = Tensor::empty(TensorMeta(std::move(shape), dtype));
    if (nbytes > 0) std::memcpy(t.raw_data(), p_ + pos_, nbytes);
    pos_ += nbytes;
    return t;
  }
  Value value(int depth, const char* field) {
    if (depth > kMaxDepth) fail(field, fmt::format("expected values nested at most {} deep, found deeper", kMaxDepth));
    const auto kind = enumeration<Value::Kind>(field, static_cast<int>(Value::Kind::Dict) + 1);
    switch (kind) {
      case Value::Kind::None:
        return Value();
      case Value::Kind::Bool:
        return Value(boolean(field));
      case Value::Kind::Int:
        return Value(pod<std::int64_t>(field));
      case Value::Kind::Double:
        return Value(pod<double>(field));
      case Value::Kind::String:
        return Value(string(field));
      case Value::Kind::Ref:
        return Value(ref(field));
      case Value::Kind::Tensor:
        return Value(tensor(field));
      case Value::Kind::Meta:
        return Value(meta(field));
      case Value::Kind::List: {
        const std::size_t n = length(field, 1);  // every value is at least its tag byte
        Value::List items;
        items.reserve(n);
        for (std::size_t i = 0; i < n; ++i) items.push_back(value(depth + 1, field));
        return Value(std::move(items));
      }
      case Value::Kind::Dict: {
        const std::size_t n = length(field, 5);  // a key's length and a tag at least
        Value::Dict items;
        items.reserve(n);  // no reallocation below, so the views into the keys stay valid
        std::unordered_set<std::string_view> seen;
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t key_at = pos_;
          items.emplace_back(string(field), Value());
          if (!seen.insert(items.back().first).second) {
            fail_at(key_at, field, fmt::format("expected unique dict keys, found '{}' twice", items.back().first));
          }
          items.back().second = value(depth + 1, field);
        }
        return Value(std::move(items));
      }
      case Value::Kind::Object:
        break;  // never encoded: enumeration() above refuses its tag
    }
    fail(field, "unreachable value kind");
  }
  std::vector<Value> values(const char* field) {
    const std::size_t n = length(field, 1);
    std::vector<Value> out;
    if (n == 0) return out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) out.push_back(value(1, field));
    return out;
  }

  Command command(int depth) {
    Command c(std::in_place_type<RequestStatus>);
    command_into(c, depth);
    return c;
  }
  // A frame's commands for the worker's queue, each decoded in place into `slot()`: a
  // group's one by one, nested groups flattened, with command()'s checks.
  void flatten(int depth, const std::function<Command&()>& slot) {
    const std::size_t at = pos_;
    if (left() == 0 || p_[pos_] != std::byte{static_cast<std::uint8_t>(CommandTag::CommandGroup)})
      return command_into(slot(), depth);
    ++pos_;
    if (depth >= kMaxDepth) {
      fail_at(at, "CommandGroup", fmt::format("expected groups nested at most {} deep, found deeper", kMaxDepth));
    }
    const std::size_t n = length("CommandGroup.commands", 1);
    for (std::size_t i = 0; i < n; ++i) flatten(depth + 1, slot);
  }

  void command_into(Command& out, int depth) {
    const std::size_t at = pos_;
    const std::uint8_t tag = u8("command tag");
    switch (static_cast<CommandTag>(tag)) {
      case CommandTag::CreateDeviceMesh: {
        auto& m = out.emplace<CreateDeviceMesh>();
        m.result = ref("CreateDeviceMesh.result");
        const std::size_t n = length("CreateDeviceMesh.names", 4);
        m.names.reserve(n);
        for (std::size_t i = 0; i < n; ++i) m.names.push_back(string("CreateDeviceMesh.names"));
        m.ranks = slice("CreateDeviceMesh.ranks");
        m.device = enumeration<Device::Kind>("CreateDeviceMesh.device", Device::kNumKinds);
        if (m.names.size() != m.ranks.ndim()) {
          fail("CreateDeviceMesh", fmt::format("expected one name per mesh dimension ({}), found {} names",
                                               m.ranks.ndim(), m.names.size()));
        }
        return;
      }
      case CommandTag::CreateStream: {
        auto& m = out.emplace<CreateStream>();
        m.result = ref("CreateStream.result");
        m.is_default = boolean("CreateStream.is_default");
        return;
      }
      case CommandTag::CallFunction: {
        auto& m = out.emplace<CallFunction>();
        m.ident = pod<Ident>("CallFunction.ident");
        refs_into(m.results, "CallFunction.results");
        refs_into(m.mutates, "CallFunction.mutates");
        string_into(m.function, "CallFunction.function");
        m.args = values("CallFunction.args");
        m.stream = ref("CallFunction.stream");
        m.mesh = ref("CallFunction.mesh");
        m.keeps_object = boolean("CallFunction.keeps_object");
        return;
      }
      case CommandTag::FetchValue: {
        auto& m = out.emplace<FetchValue>();
        m.ident = pod<Ident>("FetchValue.ident");
        m.mutates = refs("FetchValue.mutates");
        if (boolean("FetchValue.function present")) m.function = string("FetchValue.function");
        m.value = value(1, "FetchValue.value");
        m.stream = ref("FetchValue.stream");
        return;
      }
      case CommandTag::Reduce: {
        auto& m = out.emplace<Reduce>();
        m.result = ref("Reduce.result");
        m.tensor = ref("Reduce.tensor");
        m.factory = meta("Reduce.factory");
        m.mesh = ref("Reduce.mesh");
        m.stream = ref("Reduce.stream");
        m.dim = string("Reduce.dim");
        m.reduction = enumeration<Reduction>("Reduce.reduction", kNumReductions);
        m.scatter = boolean("Reduce.scatter");
        m.inplace = boolean("Reduce.inplace");
        m.ident = pod<Ident>("Reduce.ident");
        return;
      }
      case CommandTag::Collective: {
        auto& m = out.emplace<Collective>();
        m.kind = enumeration<CollectiveKind>("Collective.kind", kNumCollectiveKinds);
        m.result = ref("Collective.result");
        m.tensor = ref("Collective.tensor");
        m.factory = meta("Collective.factory");
        m.mesh = ref("Collective.mesh");
        m.stream = ref("Collective.stream");
        const std::size_t dims_at = pos_;
        const std::size_t n = length("Collective.dims", 4);
        if (n > kMaxDims)
          fail_at(dims_at, "Collective.dims", fmt::format("expected at most {} dimensions, found {}", kMaxDims, n));
        m.dims.reserve(n);
        for (std::size_t i = 0; i < n; ++i) m.dims.push_back(string("Collective.dims"));
        m.reduction = enumeration<Reduction>("Collective.reduction", kNumReductions);
        m.scatter = boolean("Collective.scatter");
        m.inplace = boolean("Collective.inplace");
        const std::size_t root_at = pos_;
        m.root = pod<std::int64_t>("Collective.root");
        if (m.root < -1) {
          fail_at(root_at, "Collective.root", fmt::format("expected -1 (none) or a position >= 0, found {}", m.root));
        }
        m.ident = pod<Ident>("Collective.ident");
        return;
      }
      case CommandTag::SendTensor: {
        // Built with its slices, in the wire's order (a braced list runs left to right):
        // not from default slices then overwritten.
        auto& m = out.emplace<SendTensor>(SendTensor{.result = ref("SendTensor.result"),
                                                     .from_ranks = slice("SendTensor.from_ranks"),
                                                     .to_ranks = slice("SendTensor.to_ranks"),
                                                     .tensor = ref("SendTensor.tensor"),
                                                     .factory = meta("SendTensor.factory"),
                                                     .stream = ref("SendTensor.stream"),
                                                     .to_order = {},
                                                     .from_order = {},
                                                     .ident = 0});
        m.to_order = dims("SendTensor.to_order", length("SendTensor.to_order", sizeof(std::int64_t)));
        if (!m.to_order.empty()) {
          std::vector<bool> seen(m.to_order.size(), false);
          for (std::int64_t k : m.to_order) {
            if (k < 0 || static_cast<std::size_t>(k) >= seen.size() || seen[static_cast<std::size_t>(k)]) {
              fail("SendTensor",
                   fmt::format("expected to_order to be a permutation of 0..{}, found {}", seen.size() - 1, k));
            }
            seen[static_cast<std::size_t>(k)] = true;
          }
          if (static_cast<std::int64_t>(m.to_order.size()) != m.from_ranks.len()) {
            fail("SendTensor", fmt::format("expected to_order of length {} (the ranks), found {}", m.from_ranks.len(),
                                           m.to_order.size()));
          }
        }
        m.from_order = dims("SendTensor.from_order", length("SendTensor.from_order", sizeof(std::int64_t)));
        if (m.from_order.empty() && m.from_ranks.len() != m.to_ranks.len()) {
          fail("SendTensor", fmt::format("expected from_ranks and to_ranks of one length, found {} and {}",
                                         m.from_ranks.len(), m.to_ranks.len()));
        }
        if (!m.from_order.empty()) {
          if (!m.to_order.empty()) {
            fail("SendTensor", fmt::format("expected to_order or from_order, found both ({} and {} positions)",
                                           m.to_order.size(), m.from_order.size()));
          }
          if (static_cast<std::int64_t>(m.from_order.size()) != m.to_ranks.len()) {
            fail("SendTensor", fmt::format("expected from_order of length {} (the target ranks), found {}",
                                           m.to_ranks.len(), m.from_order.size()));
          }
          for (std::int64_t k : m.from_order) {
            if (k < 0 || k >= m.from_ranks.len()) {
              fail("SendTensor", fmt::format("expected from_order's positions in 0..{} (the source ranks), found {}",
                                             m.from_ranks.len() - 1, k));
            }
          }
        }
        m.ident = pod<Ident>("SendTensor.ident");
        return;
      }
      case CommandTag::BorrowCreate: {
        auto& m = out.emplace<BorrowCreate>();
        m.result = ref("BorrowCreate.result");
        m.tensor = ref("BorrowCreate.tensor");
        m.from_stream = ref("BorrowCreate.from_stream");
        m.to_stream = ref("BorrowCreate.to_stream");
        m.already_borrowed = boolean("BorrowCreate.already_borrowed");
        return;
      }
      case CommandTag::BorrowFirstUse:
        out.emplace<BorrowFirstUse>(BorrowFirstUse{ref("BorrowFirstUse.borrow")});
        return;
      case CommandTag::BorrowDrop:
        out.emplace<BorrowDrop>(BorrowDrop{ref("BorrowDrop.borrow")});
        return;
      case CommandTag::DeleteRefs:
        out.emplace<DeleteRefs>(DeleteRefs{refs("DeleteRefs.refs")});
        return;
      case CommandTag::CommandGroup: {
        if (depth >= kMaxDepth) {
          fail_at(at, "CommandGroup", fmt::format("expected groups nested at most {} deep, found deeper", kMaxDepth));
        }
        auto& m = out.emplace<CommandGroup>();
        const std::size_t n = length("CommandGroup.commands", 1);
        m.commands.reserve(n);
        for (std::size_t i = 0; i < n; ++i)
          command_into(m.commands.emplace_back(std::in_place_type<RequestStatus>), depth + 1);
        return;
      }
      case CommandTag::RequestStatus:
        out.emplace<RequestStatus>(RequestStatus{pod<Ident>("RequestStatus.ident")});
        return;
      case CommandTag::Exit:
        out.emplace<Exit>(Exit{boolean("Exit.restart")});
        return;
      case CommandTag::DefineRecording: {
        // Its commands are decoded as if at the deepest level: no group or recording in them.
        if (depth >= kMaxDepth) fail_at(at, "DefineRecording", "expected it in a batch, found it inside a recording");
        auto& m = out.emplace<DefineRecording>();
        m.recording = ref("DefineRecording.recording");
        m.formals = pod<std::uint32_t>("DefineRecording.formals");
        m.locals = pod<std::uint64_t>("DefineRecording.locals");
        m.idents = pod<std::uint64_t>("DefineRecording.idents");
        m.temporaries = refs("DefineRecording.temporaries");
        const std::size_t n = length("DefineRecording.commands", 1);
        m.commands.reserve(n);
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t c_at = pos_;
          m.commands.push_back(command(kMaxDepth));
          const Command& c = m.commands.back();
          if (!std::holds_alternative<CallFunction>(c) && !std::holds_alternative<Reduce>(c) &&
              !std::holds_alternative<Collective>(c) && !std::holds_alternative<SendTensor>(c) &&
              !std::holds_alternative<BorrowCreate>(c) && !std::holds_alternative<BorrowFirstUse>(c) &&
              !std::holds_alternative<BorrowDrop>(c)) {
            fail_at(c_at, "DefineRecording.commands",
                    fmt::format("expected a call, reduction, send or borrow command, found {}", name(c)));
          }
        }
        return;
      }
      case CommandTag::CallRecording: {
        auto& m = out.emplace<CallRecording>();
        m.recording = ref("CallRecording.recording");
        m.actuals = refs("CallRecording.actuals");
        m.ref_base = pod<std::uint64_t>("CallRecording.ref_base");
        m.ident_base = pod<Ident>("CallRecording.ident_base");
        return;
      }
      default:
        fail_at(at, "command tag",
                fmt::format("expected a command tag in 0..{}, found {}", std::size(kCommandNames) - 1, tag));
    }
  }

  Reply reply() {
    const std::size_t at = pos_;
    const std::uint8_t tag = u8("reply tag");
    switch (static_cast<ReplyTag>(tag)) {
      case ReplyTag::Status: {
        Status m;
        m.first_uncompleted_ident = pod<Ident>("Status.first_uncompleted_ident");
        m.live_values = pod<std::uint64_t>("Status.live_values");
        return m;
      }
      case ReplyTag::RemoteFunctionFailed: {
        RemoteFunctionFailed m;
        m.ident = pod<Ident>("RemoteFunctionFailed.ident");
        m.error = string("RemoteFunctionFailed.error");
        m.rank = pod<std::int32_t>("RemoteFunctionFailed.rank");
        m.function = string("RemoteFunctionFailed.function");
        m.exception_type = string("RemoteFunctionFailed.exception_type");
        return m;
      }
      case ReplyTag::FetchResult: {
        FetchResult m;
        m.ident = pod<Ident>("FetchResult.ident");
        m.value = value(1, "FetchResult.value");
        return m;
      }
      case ReplyTag::Restarted:
        return Restarted{};
      case ReplyTag::TreeStatus: {
        TreeStatus m;
        m.first_uncompleted_ident = pod<Ident>("TreeStatus.first_uncompleted_ident");
        m.epoch = pod<std::uint32_t>("TreeStatus.epoch");
        const std::size_t n = length("TreeStatus.direct_ranks", sizeof(std::int32_t) + sizeof(std::uint64_t));
        m.direct_ranks.resize(n);
        for (auto& r : m.direct_ranks) {
          r = pod<std::int32_t>("TreeStatus.direct_ranks");
          if (r < 0)
            fail_at(pos_ - sizeof(std::int32_t), "TreeStatus.direct_ranks",
                    fmt::format("expected a rank >= 0, found {}", r));
        }
        m.direct_counts.resize(n);
        for (auto& c : m.direct_counts) c = pod<std::uint64_t>("TreeStatus.direct_counts");
        return m;
      }
      default:
        fail_at(at, "reply tag",
                fmt::format("expected a reply tag in 0..{}, found {}", std::size(kReplyNames) - 1, tag));
    }
  }

  Handshake handshake() {
    Handshake h;
    h.meshrt_version = string("Handshake.meshrt_version");
    h.protocol_version = pod<std::uint32_t>("Handshake.protocol_version");
    h.function_table_hash = pod<std::uint64_t>("Handshake.function_table_hash");
    h.thread_level = pod<std::int32_t>("Handshake.thread_level");
    h.rank = pod<std::int32_t>("Handshake.rank");
    h.host = string("Handshake.host");
    return h;
  }

  Query query() {
    Query q;
    q.id = pod<std::uint64_t>("Query.id");
    q.op = enumeration<QueryOp>("Query.op", kNumQueryOps);
    q.limit = pod<std::uint64_t>("Query.limit");
    q.reason = string("Query.reason");
    return q;
  }

  QueryAnswer query_answer() {
    QueryAnswer a;
    a.query = pod<std::uint64_t>("QueryAnswer.query");
    a.rank = pod<std::int32_t>("QueryAnswer.rank");
    if (a.rank < -1) fail("QueryAnswer.rank", fmt::format("expected a rank >= -1, found {}", a.rank));
    a.op = enumeration<QueryOp>("QueryAnswer.op", kNumQueryOps);
    a.payload = string("QueryAnswer.payload");
    a.error = string("QueryAnswer.error");
    return a;
  }

  Envelope envelope() {
    Envelope e;
    const std::size_t fanout_at = pos_;
    e.fanout = pod<std::uint32_t>("Envelope.fanout");
    if (e.fanout == 0) fail_at(fanout_at, "Envelope.fanout", "expected at least 1 child per node, found 0");
    // Each destination takes a rank and a sequence number.
    const std::size_t n = length("Envelope.ranks", sizeof(std::int32_t) + sizeof(std::uint64_t));
    if (n == 0) fail("Envelope.ranks", "expected at least one destination, found none");
    e.ranks.resize(n);
    for (auto& r : e.ranks) {
      r = pod<std::int32_t>("Envelope.ranks");
      if (r < 0)
        fail_at(pos_ - sizeof(std::int32_t), "Envelope.ranks", fmt::format("expected a rank >= 0, found {}", r));
    }
    std::vector<std::int32_t> sorted = e.ranks;
    std::sort(sorted.begin(), sorted.end());
    if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
      fail("Envelope.ranks", fmt::format("expected distinct ranks, found rank {} twice", *dup));
    }
    e.seqs.resize(n);
    for (auto& q : e.seqs) {
      q = pod<std::uint64_t>("Envelope.seqs");
      if (q == 0) fail_at(pos_ - sizeof(std::uint64_t), "Envelope.seqs", "expected a message number >= 1, found 0");
    }
    const std::size_t len = length("Envelope.payload", 1);
    need(len, "Envelope.payload");
    e.payload.assign(p_ + pos_, p_ + pos_ + len);
    pos_ += len;
    return e;
  }

  void header(FrameKind expected) {
    need(kHeaderSize, "frame header");
    if (p_[0] != kMagic0 || p_[1] != kMagic1) {
      fail("frame header", fmt::format("expected the magic bytes 'm' 'r', found 0x{:02x} 0x{:02x}",
                                       std::to_integer<unsigned>(p_[0]), std::to_integer<unsigned>(p_[1])));
    }
    const auto version = std::to_integer<unsigned>(p_[2]);
    if (version != kVersion) {
      fail_at(2, "frame header",
              fmt::format("expected protocol version {}, found {} (a rank runs a different meshrt build)", kVersion,
                          version));
    }
    const auto kind = std::to_integer<unsigned>(p_[3]);
    if (kind != static_cast<unsigned>(expected)) {
      fail_at(3, "frame header",
              fmt::format("expected frame kind {} ({}), found {}", static_cast<unsigned>(expected), kind_name(expected),
                          kind));
    }
    pos_ = kHeaderSize;
  }
  void finish() const {
    if (left() != 0) fail("end of frame", fmt::format("expected the frame to end, found {} more bytes", left()));
  }

  static std::string_view kind_name(FrameKind k) {
    switch (k) {
      case FrameKind::Command:
        return "command";
      case FrameKind::Reply:
        return "reply";
      case FrameKind::Handshake:
        return "handshake";
      case FrameKind::Value:
        return "value";
      case FrameKind::Query:
        return "query";
      case FrameKind::QueryAnswer:
        return "query answer";
      case FrameKind::Envelope:
        return "envelope";
    }
    return "invalid";
  }

 private:
  const std::byte* p_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

template <class F>
std::vector<std::byte> to_vector(F&& encode_fn) {
  Buffer b;
  encode_fn(b);
  return std::vector<std::byte>(b.data(), b.data() + b.size());
}

}  // namespace

std::string_view command_name(std::size_t tag) noexcept {
  return tag < std::size(kCommandNames) ? kCommandNames[tag] : std::string_view("?");
}

std::string_view name(const Command& c) noexcept {
  return kCommandNames[c.index()];
}
std::string_view name(const Reply& r) noexcept {
  return kReplyNames[r.index()];
}

void Buffer::reserve(std::size_t n) {
  if (n > capacity_) grow(n - size_);
}

void Buffer::grow(std::size_t n) {
  const std::size_t needed = size_ + n;
  const std::size_t cap = std::max({needed, capacity_ * 2, std::size_t{256}});
  // make_unique_for_overwrite: no zero fill, the bytes are about to be written.
  auto fresh = std::make_unique_for_overwrite<std::byte[]>(cap);
  if (size_ > 0) std::memcpy(fresh.get(), data_.get(), size_);
  data_ = std::move(fresh);
  capacity_ = cap;
}

void encode_into(const Command& c, Buffer& out) {
  header(out, FrameKind::Command);
  Writer(out).command(c);
}
void encode_into(const Reply& r, Buffer& out) {
  header(out, FrameKind::Reply);
  Writer(out).reply(r);
}
void encode_into(const Handshake& h, Buffer& out) {
  header(out, FrameKind::Handshake);
  Writer(out).body(h);
}
void encode_into(const Query& q, Buffer& out) {
  header(out, FrameKind::Query);
  Writer(out).body(q);
}
void encode_into(const QueryAnswer& a, Buffer& out) {
  header(out, FrameKind::QueryAnswer);
  Writer(out).body(a);
}
void encode_into(const Envelope& e, Buffer& out) {
  if (e.seqs.size() != e.ranks.size()) {
    throw ProtocolError(
        fmt::format("protocol: encoding an envelope: expected one sequence number per rank ({}), found {}",
                    e.ranks.size(), e.seqs.size()));
  }
  header(out, FrameKind::Envelope);
  Writer(out).body(e);
}
std::size_t encoded_size(const Command& c) {
  BasicWriter<true> w;
  w.command(c);
  return kHeaderSize + w.counted();
}
std::size_t encoded_size(const Value& v) {
  BasicWriter<true> w;
  w.value(v);
  return w.counted();
}

void encode_value(const Value& v, Buffer& out) {
  header(out, FrameKind::Value);
  Writer(out).value(v);
}

std::vector<std::byte> encode(const Command& c) {
  return to_vector([&](Buffer& b) { encode_into(c, b); });
}
std::vector<std::byte> encode(const Reply& r) {
  return to_vector([&](Buffer& b) { encode_into(r, b); });
}
std::vector<std::byte> encode(const Handshake& h) {
  return to_vector([&](Buffer& b) { encode_into(h, b); });
}
std::vector<std::byte> encode(const Query& q) {
  return to_vector([&](Buffer& b) { encode_into(q, b); });
}
std::vector<std::byte> encode(const QueryAnswer& a) {
  return to_vector([&](Buffer& b) { encode_into(a, b); });
}
std::vector<std::byte> encode(const Envelope& e) {
  return to_vector([&](Buffer& b) { encode_into(e, b); });
}

Command decode_command(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::Command);
  Command c = r.command(0);
  r.finish();
  return c;
}
void decode_commands(std::span<const std::byte> bytes, const std::function<Command&()>& slot) {
  Reader r(bytes);
  r.header(FrameKind::Command);
  r.flatten(0, slot);
  r.finish();
}
Reply decode_reply(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::Reply);
  Reply rep = r.reply();
  r.finish();
  return rep;
}
Handshake decode_handshake(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::Handshake);
  Handshake h = r.handshake();
  r.finish();
  return h;
}
Query decode_query(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::Query);
  Query q = r.query();
  r.finish();
  return q;
}
QueryAnswer decode_query_answer(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::QueryAnswer);
  QueryAnswer a = r.query_answer();
  r.finish();
  return a;
}
Envelope decode_envelope(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::Envelope);
  Envelope e = r.envelope();
  r.finish();
  return e;
}
bool is_envelope(std::span<const std::byte> bytes) noexcept {
  return bytes.size() >= kHeaderSize && bytes[0] == kMagic0 && bytes[1] == kMagic1 &&
         bytes[3] == static_cast<std::byte>(FrameKind::Envelope);
}
Value decode_value(std::span<const std::byte> bytes) {
  Reader r(bytes);
  r.header(FrameKind::Value);
  Value v = r.value(1, "value");
  r.finish();
  return v;
}

}  // namespace protocol
}  // namespace meshrt
