// Open MPI's TCP transport between nodes uses the interfaces OMPI_MCA_btl_tcp_if_include
// names. If none of them is on a node, a job that spans nodes fails inside MPI_Init with
// Open MPI's "unable to reach each other", once per rank, naming no setting a user set.
// Runtime checks the setting first and says which interfaces the node has.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshrt::detail {

struct NetworkInterface {
  std::string name;
  std::optional<std::uint32_t> ipv4;  // host byte order
};

// This process's interfaces (getifaddrs), each once, with its first IPv4 address.
std::vector<NetworkInterface> network_interfaces();

// Why `include` (btl_tcp_if_include's value: interface names and a.b.c.d/n subnets,
// comma-separated) names nothing on a node with `here`, or nullopt when an entry names
// one of its interfaces or a subnet of one of its addresses (Open MPI ignores the rest).
std::optional<std::string> tcp_include_problem(std::string_view include, const std::vector<NetworkInterface>& here);

// Before MPI_Init: throws UsageError, naming the rank, the host and the interfaces it has,
// when the job spans nodes (as its launcher says: Slurm's step, Open MPI's mpirun) and
// OMPI_MCA_btl_tcp_if_include names nothing on this one.
void check_tcp_interfaces();

}  // namespace meshrt::detail
