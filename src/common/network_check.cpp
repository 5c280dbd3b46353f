#include "common/network_check.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>

#include "meshrt/error.hpp"

namespace meshrt::detail {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// a.b.c.d/n as (network, prefix length), or nullopt when `entry` is not one.
std::optional<std::pair<std::uint32_t, int>> subnet(std::string_view entry) {
  const auto slash = entry.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  const std::string address(entry.substr(0, slash));
  const std::string_view bits = entry.substr(slash + 1);
  int prefix = -1;
  auto [end, ec] = std::from_chars(bits.data(), bits.data() + bits.size(), prefix);
  in_addr a{};
  if (ec != std::errc() || end != bits.data() + bits.size() || prefix < 0 || prefix > 32 ||
      inet_pton(AF_INET, address.c_str(), &a) != 1) {
    return std::nullopt;
  }
  return std::pair{ntohl(a.s_addr), prefix};
}

std::string describe(const NetworkInterface& i) {
  if (!i.ipv4) return i.name;
  in_addr a{.s_addr = htonl(*i.ipv4)};
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a, text, sizeof text);
  return fmt::format("{} ({})", i.name, text);
}

std::optional<long> environment_number(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0') return std::nullopt;
  return n;
}

// Whether the launcher placed the job's processes on more than one node; false when it
// does not say (a singleton, an unknown launcher: Open MPI's own message follows).
bool job_spans_nodes() {
  if (auto nodes = environment_number("SLURM_STEP_NUM_NODES")) return *nodes > 1;
  const auto size = environment_number("OMPI_COMM_WORLD_SIZE");
  const auto local = environment_number("OMPI_COMM_WORLD_LOCAL_SIZE");
  return size && local && *local < *size;
}

}  // namespace

std::vector<NetworkInterface> network_interfaces() {
  std::vector<NetworkInterface> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_name) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& i) { return i.name == a->ifa_name; });
    if (it == out.end()) it = out.insert(out.end(), NetworkInterface{.name = a->ifa_name});
    if (!it->ipv4 && a->ifa_addr && a->ifa_addr->sa_family == AF_INET) {
      it->ipv4 = ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
    }
  }
  freeifaddrs(list);
  return out;
}

std::optional<std::string> tcp_include_problem(std::string_view include, const std::vector<NetworkInterface>& here) {
  std::vector<std::string_view> entries;
  for (std::size_t start = 0; start <= include.size();) {
    const auto comma = std::min(include.find(',', start), include.size());
    if (auto e = trim(include.substr(start, comma - start)); !e.empty()) entries.push_back(e);
    start = comma + 1;
  }
  if (entries.empty()) return std::nullopt;
  for (const std::string_view e : entries) {
    if (auto net = subnet(e)) {
      const std::uint32_t mask = net->second == 0 ? 0 : ~std::uint32_t{0} << (32 - net->second);
      for (const auto& i : here) {
        if (i.ipv4 && (*i.ipv4 & mask) == (net->first & mask)) return std::nullopt;
      }
    } else if (std::any_of(here.begin(), here.end(), [&](const auto& i) { return i.name == e; })) {
      return std::nullopt;
    }
  }
  std::vector<std::string> has;
  for (const auto& i : here) has.push_back(describe(i));
  return fmt::format(
      "expected an interface of this node or a subnet of its addresses, found {} that {} none: it has {}",
      entries.size() == 1 ? "one entry" : fmt::format("{} entries", entries.size()), entries.size() == 1 ? "is" : "are",
      has.empty() ? "no interface" : fmt::format("{}", fmt::join(has, ", ")));
}

void check_tcp_interfaces() {
  const char* include = std::getenv("OMPI_MCA_btl_tcp_if_include");
  if (!include || !*include || !job_spans_nodes()) return;
  const auto problem = tcp_include_problem(include, network_interfaces());
  if (!problem) return;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  std::string where = fmt::format("on {}", host);
  for (const char* name : {"SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (auto r = environment_number(name)) {
      where = fmt::format("rank {} on {}", *r, host);
      break;
    }
  }
  throw UsageError(fmt::format(
      "{}: setting OMPI_MCA_btl_tcp_if_include={}: {}. Open MPI's TCP transport between this job's nodes would have "
      "no interface here, and MPI_Init would fail (\"unable to reach each other\"). Name an interface every node has, "
      "or unset it",
      where, include, *problem));
}

}  // namespace meshrt::detail
