// An emulated cluster on one machine: the ranks of a launch run in a private network namespace
// in which the links between emulated nodes, and optionally within each node, are shaped to
// chosen rates, so that communication costs what it costs across real links while everything
// else (the job, its files, its engines) is unchanged (`lvx launch --inter-node R`).
//
// The namespace. The launcher calls unshare(CLONE_NEWNET) (falling back to a user namespace that
// owns the network namespace where the process lacks CAP_NET_ADMIN) before it starts the ranks,
// which inherit it. It is private to the launch and disappears with its last process, a kill -9
// of the launcher included: nothing of the host is touched (its interfaces, qdiscs, addresses).
// Inside it the loopback is brought up, and every address of 127.0.0.0/8 is on it.
//
// Addresses. Emulated node k's local rank l uses 127.0.(k+1).(l+1) for every socket it makes:
// the Gloo device (ProcessGroup reads LVX_BIND_ADDRESS), and through a preloaded library
// (src/dist/preload/emulated_node.cpp) every connect to a loopback address and every ephemeral
// loopback listener, so the store client and a Python rank's torch.distributed Gloo group too.
// The rendezvous store is on node 0's first address, 127.0.1.1.
//
// Links (tc on the namespace's lo; htb classes, u32 filters on source and destination):
//   inter-node  one class per node for its traffic to every other node at the inter-node rate:
//               a node's link (its NIC, shared by its ranks), as cluster configs describe it
//               (planner/cluster_config.h: inter_node bandwidth per node);
//   intra-node  with an intra-node rate, one class per rank for its traffic to the other ranks of
//               its node (each GPU's own link, as NVLink is); unshaped otherwise;
//   the rest    (127.0.0.1, the launcher's own sockets) unshaped.
// tc shapes rate only: this kernel has no netem, so the emulated links add no latency beyond
// the loopback's own (tens of microseconds) and htb's scheduling. Cost-model predictions for an
// emulated cluster should come from `lvx calibrate` run on it, which measures what the links give.
#pragma once

#include <map>
#include <string>

namespace lvx::dist {

struct LinkRates {
  double inter_node_bytes_per_s = 0;  // > 0: the emulation is on
  double intra_node_bytes_per_s = 0;  // 0: unshaped within a node
  bool enabled() const { return inter_node_bytes_per_s > 0; }
};

// A rate as tc writes it: a number and a unit, bit | kbit | mbit | gbit | tbit (bits per second)
// or bps | kbps | mbps | gbps | tbps (bytes per second), SI multiples (tc's "kbit" is 1000 bits).
// Returns bytes per second; `what` names the option in errors.
double parse_rate(const std::string& text, const std::string& what);
// The rate for people, as tc would take it ("200mbit", "1.6gbit").
std::string format_rate(double bytes_per_s);

// Emulated node `node`'s local rank `local_rank`: "127.0.(node+1).(local_rank+1)".
std::string node_address(int node, int local_rank);

// In the launcher, before the ranks start: makes this process's private network namespace and
// shapes its links for `nodes` nodes of `ranks_per_node` ranks. Errors name what is missing
// (CAP_NET_ADMIN or user namespaces, the tc binary, a kernel without htb) and what to do.
// Returns a description of the links for the launcher to print.
std::string enter_emulated_cluster(int nodes, int ranks_per_node, const LinkRates& rates);

// What a rank of the emulated cluster needs in its environment: LVX_BIND_ADDRESS, and the
// preload library added to LD_PRELOAD (`preload_env` is the launcher's own LD_PRELOAD, or empty).
std::map<std::string, std::string> emulated_rank_env(int node, int local_rank,
                                                      const std::string& preload_env);

// The preload library's path: beside this executable or one folder up (benchmarks/, tests/).
std::string emulated_node_library();

}  // namespace lvx::dist
