// The emulated cluster's namespace and links; see emulated_cluster.h.
#include "src/dist/emulated_cluster.h"

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <vector>

#include "src/common/error.h"
#include "src/dist/launcher.h"

namespace lvx::dist {

namespace fs = std::filesystem;

namespace {

// The shaper's token bucket: at least 16 KiB (measured here: 100 kB messages across an 80 mbit
// class then take their 10 ms; with 128 KiB they went through at once after an idle moment),
// and 0.5 ms of the rate so that high rates are still reached.
int64_t burst_bytes(double rate) {
  return std::max<int64_t>(16 << 10, static_cast<int64_t>(rate * 0.5e-3));
}

std::string tc_rate(double bytes_per_s) {
  return std::to_string(static_cast<int64_t>(std::llround(bytes_per_s * 8))) + "bit";
}

std::string find_tc() {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path != nullptr ? path : "");
  std::vector<std::string> dirs;
  for (std::string d; std::getline(ss, d, ':');) dirs.push_back(d);
  for (const char* d : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) dirs.push_back(d);
  for (const auto& d : dirs) {
    const std::string p = d + "/tc";
    if (!d.empty() && ::access(p.c_str(), X_OK) == 0) return p;
  }
  LVX_FAIL("emulated links need tc (iproute2: apt-get install iproute2); it is not on PATH, "
           "/usr/sbin or /sbin");
}

// Runs `tc args...`; an error names the command and tc's own message.
void tc(const std::string& bin, const std::vector<std::string>& args) {
  int err[2];
  LVX_CHECK(::pipe(err) == 0, "emulated links: pipe failed: ", std::strerror(errno));
  const pid_t pid = ::fork();
  LVX_CHECK(pid >= 0, "emulated links: fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::dup2(err[1], STDERR_FILENO);
    ::dup2(err[1], STDOUT_FILENO);
    ::close(err[0]);
    ::close(err[1]);
    std::vector<char*> argv{const_cast<char*>(bin.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    std::fprintf(stderr, "cannot run %s: %s\n", bin.c_str(), std::strerror(errno));
    _exit(127);
  }
  ::close(err[1]);
  std::string out;
  char buf[1024];
  for (ssize_t n; (n = ::read(err[0], buf, sizeof buf)) > 0;) out.append(buf, n);
  ::close(err[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  std::string cmd = "tc";
  for (const auto& a : args) cmd += " " + a;
  LVX_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "emulated links: '", cmd, "' failed: ",
            out.empty() ? describe_exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st))
                        : out);
}

void write_proc(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.close();
  LVX_CHECK(!f.fail(), "emulated links: cannot write '", text, "' to ", path);
}

// A private network namespace for this process; where CAP_NET_ADMIN is missing, one owned by a
// new user namespace (this user mapped to root inside it, so tc may configure it).
void unshare_network() {
  if (::unshare(CLONE_NEWNET) == 0) return;
  const int first = errno;
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  if (::unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0) {
    write_proc("/proc/self/setgroups", "deny");
    write_proc("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1");
    write_proc("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1");
    return;
  }
  LVX_FAIL("emulated links need a private network namespace, which this process may not make: "
           "unshare(CLONE_NEWNET) failed (",
           std::strerror(first), ") and so did a user namespace (", std::strerror(errno),
           "); run as root or with CAP_NET_ADMIN, or where unprivileged user namespaces are "
           "allowed (sysctl kernel.unprivileged_userns_clone=1)");
}

void loopback_up() {
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  LVX_CHECK(fd >= 0, "emulated links: socket failed: ", std::strerror(errno));
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  const bool ok = ::ioctl(fd, SIOCGIFFLAGS, &ifr) == 0 &&
                  (ifr.ifr_flags |= IFF_UP, ::ioctl(fd, SIOCSIFFLAGS, &ifr) == 0);
  const int e = errno;
  ::close(fd);
  LVX_CHECK(ok, "emulated links: cannot bring the namespace's loopback up: ", std::strerror(e));
}

// Names for the emulated nodes' addresses, so that reverse lookups (c10d's store logs its peers'
// host names) find them instead of asking a DNS server the namespace cannot reach and warning on
// every rank: a private mount namespace in which /etc/hosts is the host's plus these lines. Best
// effort: without it only those warnings return.
void name_the_nodes(int nodes, int ranks_per_node) {
  if (::unshare(CLONE_NEWNS) != 0) return;
  if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return;
  std::string hosts;
  {
    std::ifstream in("/etc/hosts");
    hosts.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Each address also as IPv6-mapped (the store's server socket is dual-stack and sees its
  // clients as ::ffff:127.0.k.l), and ::1, which some hosts files lack.
  hosts += "::1 localhost\n";
  for (int k = 0; k < nodes; ++k)
    for (int l = 0; l < ranks_per_node; ++l)
      for (const char* prefix : {"", "::ffff:"})
        hosts += prefix + node_address(k, l) + " lvx-node" + std::to_string(k) + "-rank" +
                 std::to_string(l) + "\n";
  char path[] = "/tmp/lvx-hosts.XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) return;
  const bool written = ::write(fd, hosts.data(), hosts.size()) == static_cast<ssize_t>(hosts.size());
  ::fchmod(fd, 0644);
  ::close(fd);
  if (written) ::mount(path, "/etc/hosts", nullptr, MS_BIND, nullptr);
  ::unlink(path);  // the bind mount keeps the file while the namespace lives
}

std::string hex(int x) {
  std::ostringstream o;
  o << std::hex << x;
  return o.str();
}

}  // namespace

double parse_rate(const std::string& text, const std::string& what) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (...) {
    pos = 0;
  }
  const std::string unit = pos > 0 ? text.substr(pos) : "";
  static const std::vector<std::pair<std::string, double>> units = {
      {"bit", 1.0 / 8},  {"kbit", 1e3 / 8}, {"mbit", 1e6 / 8}, {"gbit", 1e9 / 8},
      {"tbit", 1e12 / 8}, {"bps", 1},       {"kbps", 1e3},     {"mbps", 1e6},
      {"gbps", 1e9},     {"tbps", 1e12}};
  for (const auto& [u, scale] : units) {
    if (unit != u) continue;
    const double r = v * scale;
    LVX_CHECK(std::isfinite(r) && r >= 1e3 && r <= 1e13, what, ": rate '", text,
              "' is outside 8kbit..80tbit");
    return r;
  }
  LVX_FAIL(what, ": expected a rate as tc writes it (a number and bit, kbit, mbit, gbit, tbit, or ",
           "bps, kbps, mbps, gbps, tbps for bytes: 200mbit, 10gbit), got '", text, "'");
}

std::string format_rate(double bytes_per_s) {
  const double bits = bytes_per_s * 8;
  std::ostringstream o;
  o << std::setprecision(3);
  if (bits >= 1e9)
    o << bits / 1e9 << "gbit";
  else if (bits >= 1e6)
    o << bits / 1e6 << "mbit";
  else
    o << bits / 1e3 << "kbit";
  return o.str();
}

std::string node_address(int node, int local_rank) {
  LVX_CHECK(node >= 0 && node < 254 && local_rank >= 0 && local_rank < 254,
            "emulated cluster: at most 254 nodes of 254 ranks (node ", node, ", local rank ",
            local_rank, ")");
  return "127.0." + std::to_string(node + 1) + "." + std::to_string(local_rank + 1);
}

std::string enter_emulated_cluster(int nodes, int ranks_per_node, const LinkRates& rates) {
  LVX_CHECK(rates.enabled(), "emulated links: no inter-node rate");
  LVX_CHECK(nodes >= 2, "--inter-node needs at least 2 nodes (--nodes), got ", nodes);
  node_address(nodes - 1, ranks_per_node - 1);  // bounds
  const std::string bin = find_tc();
  unshare_network();
  loopback_up();
  // TCP small queues: at most 32 KiB of each socket waiting in the shaper (the host's default
  // here is 4 MiB). Deep queues behind a slow class outlast TCP's retransmission timer: measured
  // at 6.25 MB/s per node, exchanges of 0.9 MB ran at 3.6-6.3 MB/s with spurious timeouts, and
  // at 5.6-6.3 MB/s with none once the queue was bounded. A per-namespace setting.
  write_proc("/proc/sys/net/ipv4/tcp_limit_output_bytes", "32768");
  name_the_nodes(nodes, ranks_per_node);
  const std::string q = "200000";  // htb's largest quantum: no fairness warnings, classes are capped
  tc(bin, {"qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"});
  tc(bin, {"class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit",
           "quantum", q});
  auto shaped = [&](int classid, double rate) {
    const std::string b = std::to_string(burst_bytes(rate));
    tc(bin, {"class", "add", "dev", "lo", "parent", "1:", "classid", "1:" + hex(classid), "htb",
             "rate", tc_rate(rate), "ceil", tc_rate(rate), "burst", b, "cburst", b, "quantum",
             q});
  };
  auto filter = [&](const std::string& src, const std::string& dst, int classid) {
    tc(bin, {"filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "2", "u32",
             "match", "ip", "src", src, "match", "ip", "dst", dst, "flowid", "1:" + hex(classid)});
  };
  // Packets of 32-63 bytes (TCP's pure ACKs: 40 bytes of headers, 52 with timestamps) skip the
  // shaped classes: queued behind data going the other way they hold back each sender's window
  // (measured, 4 ranks exchanging across 2 nodes at 10 MB/s per node and 5 MB/s per rank inside
  // one: 8.3 and 2.8 MB/s without this filter, 9.9 and 4.8 with it). The range excludes a total
  // length of 0, which large GSO packets on lo carry.
  tc(bin, {"filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
           "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
           "match", "u16", "0x0020", "0xffe0", "at", "2", "match", "u8", "0x10", "0xff", "at",
           "33", "flowid", "1:1"});
  auto net = [](int node) { return "127.0." + std::to_string(node + 1) + ".0/24"; };
  for (int a = 0; a < nodes; ++a) {
    const int inter = 0x1000 + a;  // node a's link to every other node
    shaped(inter, rates.inter_node_bytes_per_s);
    for (int b = 0; b < nodes; ++b)
      if (b != a) filter(net(a), net(b), inter);
    if (rates.intra_node_bytes_per_s > 0)
      for (int l = 0; l < ranks_per_node; ++l) {  // rank (a, l)'s link inside its node
        const int intra = 0x2000 + a * ranks_per_node + l;
        shaped(intra, rates.intra_node_bytes_per_s);
        filter(node_address(a, l) + "/32", net(a), intra);
      }
  }
  return str("emulated cluster: ", nodes, " nodes x ", ranks_per_node, " ranks; each node's link to ",
             "the others ", format_rate(rates.inter_node_bytes_per_s), ", inside a node ",
             rates.intra_node_bytes_per_s > 0
                 ? format_rate(rates.intra_node_bytes_per_s) + " per rank"
                 : std::string("unshaped"),
             "; node k rank l at 127.0.(k+1).(l+1); no added latency (tc rate shaping only)");
}

std::string emulated_node_library() {
  const fs::path self = fs::path(self_executable()).parent_path();
  for (const fs::path& p : {self / "liblvx_emulated_node.so",
                            self.parent_path() / "liblvx_emulated_node.so"})
    if (fs::exists(p)) return p.string();
  LVX_FAIL("emulated links: liblvx_emulated_node.so (built with lvx) is not beside ",
           self.string(), " nor one folder up; rebuild lvx");
}

std::map<std::string, std::string> emulated_rank_env(int node, int local_rank,
                                                      const std::string& preload_env) {
  const std::string lib = emulated_node_library();
  return {{"LVX_BIND_ADDRESS", node_address(node, local_rank)},
          {"LD_PRELOAD", preload_env.empty() ? lib : lib + ":" + preload_env}};
}

}  // namespace lvx::dist
