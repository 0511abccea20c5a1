#include "src/dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "src/common/error.h"
#include "src/dist/rendezvous.h"

namespace lvx::dist {

std::string self_executable() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  LVX_CHECK(n > 0, "cannot resolve /proc/self/exe: ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

int relaunch_self_as_ranks(int nproc, int argc, char** argv) {
  if (launched_as_rank()) return -1;
  std::vector<std::string> cmd{self_executable()};
  for (int i = 1; i < argc; ++i) cmd.push_back(argv[i]);
  LaunchOptions o;
  o.nproc = nproc;
  o.capture = true;
  auto res = launch_local(cmd, o);
  for (const auto& rk : res.ranks)
    if (rk.rank == 0 || rk.exit_code != 0) std::cout << rk.output;
  return res.exit_code;
}

int available_cores() {
  int cores = 0;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  // A container's CPU quota (cgroup v2 "max 100000" / "200000 100000"): at most that many.
  std::ifstream q("/sys/fs/cgroup/cpu.max");
  std::string quota, period;
  if (q >> quota >> period && quota != "max") {
    try {
      const double n = std::stod(quota) / std::stod(period);
      if (n > 0) cores = std::min(cores, std::max(1, static_cast<int>(std::ceil(n))));
    } catch (...) {
      // Unreadable quota: the affinity count stands.
    }
  }
  return std::max(1, cores);
}

double default_exit_wait_s(const std::map<std::string, std::string>& env) {
  auto it = env.find("LVX_DIST_TIMEOUT_S");
  const char* v = it != env.end() ? it->second.c_str() : std::getenv("LVX_DIST_TIMEOUT_S");
  const double t = v ? std::atof(v) : 0;
  return 2 * (t > 0 ? t : 60);  // the ranks reject a bad value themselves
}

std::string describe_exit(int code) {
  if (code == 124) return "was stopped by a launch time limit";
  if (code > 128 && code < 128 + 65) {
    int sig = code - 128;
    return str("was killed by signal ", sig, " (", strsignal(sig), ")");
  }
  return str("exited with code ", code);
}

namespace {

volatile sig_atomic_t g_launcher_signal = 0;  // LaunchOptions::forward_signals: the one received
extern "C" void remember_launcher_signal(int sig) { g_launcher_signal = sig; }

// A rank's two output pipes: [0] its stdout, [1] its stderr (each forwarded to the same stream of
// the launcher, so that errors never land in a result redirected from stdout).
struct Child {
  pid_t pid = -1;
  int fd[2] = {-1, -1};
  std::string partial[2];
  bool running = true;
  std::chrono::steady_clock::time_point start;
};

void emit(RankExit& rank, const std::string& line, bool capture, bool to_stderr) {
  if (capture) {
    rank.output += line;
  } else if (to_stderr) {
    std::cout << std::flush;
    std::cerr << "[rank " << rank.rank << "] " << line << std::flush;
  } else {
    std::cout << "[rank " << rank.rank << "] " << line << std::flush;
  }
}

}  // namespace

namespace {

// One rank's process environment and command (in the forked child: nothing here may throw).
// `agent_store`: the launcher hosts the rendezvous store (torchrun's variable says so to the
// ranks).
[[noreturn]] void exec_rank(int r, int local, const LaunchOptions& opts,
                            const std::string& master_addr, int port,
                            const std::map<std::string, std::string>& node_env, bool agent_store,
                            const std::vector<std::string>& argv) {
  auto set = [](const std::string& k, const std::string& v) { ::setenv(k.c_str(), v.c_str(), 1); };
  if (agent_store)
    set("TORCHELASTIC_USE_AGENT_STORE", "True");
  else
    ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");  // an outer torchrun's agent is not this job's
  if (opts.openmpi_style) {
    for (const char* k : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}) ::unsetenv(k);
    set("OMPI_COMM_WORLD_RANK", std::to_string(r));
    set("OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r % local));
    set("OMPI_COMM_WORLD_SIZE", std::to_string(opts.nproc));
    set("OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local));
  } else {
    set("RANK", std::to_string(r));
    set("LOCAL_RANK", std::to_string(r % local));
    set("WORLD_SIZE", std::to_string(opts.nproc));
    set("LOCAL_WORLD_SIZE", std::to_string(local));
    set("GROUP_RANK", std::to_string(r / local));  // torchrun's node index
  }
  set("MASTER_ADDR", master_addr);
  for (const auto& [k, v] : node_env) set(k, v);
  set("MASTER_PORT", std::to_string(port));
  // As torchrun does: ranks sharing a machine split its cores instead of each spinning up
  // one OpenMP thread per core (which oversubscribes and can be 30x slower).
  // A single rank too: libtorch's own default counts the host's cores, not this process's
  // share (affinity, cgroup quota), and oversubscribes a shared machine.
  if (!std::getenv("OMP_NUM_THREADS"))
    set("OMP_NUM_THREADS", std::to_string(std::max(1, available_cores() / opts.nproc)));
  for (const auto& [k, v] : opts.env) set(k, v);
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  ::execvp(cargv[0], cargv.data());
  std::fprintf(stderr, "lvx launch: cannot run '%s': %s\n", cargv[0], std::strerror(errno));
  _exit(127);
}

// Without --master-port the launcher hosts the rendezvous store itself, as torchrun's agent does,
// and tells the ranks so (TORCHELASTIC_USE_AGENT_STORE=True): lvx's ranks and torch.distributed's
// all join it as clients. The store binds a port the kernel picks and keeps it, so no other
// process can take it between its choice and the ranks' start: choosing a free port, closing it
// and letting rank 0 bind it later failed with EADDRINUSE in CI (another job's connection drew
// the port in between). It also outlives a failed rank 0, so the others still name the rank that
// failed instead of losing the store.
c10::intrusive_ptr<c10d::TCPStore> host_agent_store(const std::string& master_addr) {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  try {
    return c10::make_intrusive<c10d::TCPStore>(master_addr, o);
  } catch (const std::exception& e) {
    LVX_FAIL("launch: cannot host the rendezvous store on ", master_addr, ": ", e.what());
  }
}

// A launch in progress: the ranks forked, their outputs forwarded line by line, their exits
// reaped; a failed rank, a signal or a deadline stops the others (launch_local's steps).
class Launch {
 public:
  Launch(const std::vector<std::string>& argv, const LaunchOptions& opts)
      : argv_(argv),
        opts_(opts),
        local_(opts.nproc / opts.nodes),
        exit_wait_s_(opts.exit_wait_s >= 0  ? opts.exit_wait_s
                     : opts.stop_on_failure ? default_exit_wait_s(opts.env)
                                            : 0),
        kids_(opts.nproc) {
    result_.ranks.resize(opts.nproc);
  }
  void spawn_all();
  void watch();
  void drain_rest();
  LaunchResult result() { return std::move(result_); }

 private:
  void spawn(int r, const std::string& master_addr, int port,
             const std::map<std::string, std::string>& node_env, pid_t parent);
  void drain(int owner, int s);  // what one output holds now, line by line; closed at EOF
  void poll_outputs();
  void reap();
  void check_deadlines();
  void stop_all(int sig);
  void stop_for_time(const std::string& why);

  const std::vector<std::string>& argv_;
  const LaunchOptions& opts_;
  c10::intrusive_ptr<c10d::TCPStore> store_;  // the rendezvous store, when this launch hosts it
  const int local_;
  const double exit_wait_s_;  // --exit-wait: how long the others may run after the first exit
  std::vector<Child> kids_;
  LaunchResult result_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  int running_ = 0;
  int first_exit_ = -1;  // the first rank that exited, and when
  std::chrono::steady_clock::time_point first_exit_at_{}, stop_at_{};
  bool stopping_ = false, forwarded_ = false;
};

void Launch::spawn_all() {
  std::string master_addr = opts_.master_addr;
  if (opts_.links.enabled()) {
    const std::string links = enter_emulated_cluster(opts_.nodes, local_, opts_.links);
    if (!opts_.capture) std::cerr << "lvx launch: " << links << "\n" << std::flush;
    master_addr = node_address(0, 0);
  }
  // Each rank's emulated-node variables, made before forking (a child must not throw).
  std::vector<std::map<std::string, std::string>> node_env(opts_.nproc);
  if (opts_.links.enabled()) {
    const char* preload = std::getenv("LD_PRELOAD");
    for (int r = 0; r < opts_.nproc; ++r)
      node_env[r] = emulated_rank_env(r / local_, r % local_, preload ? preload : "");
  }
  if (opts_.master_port <= 0) store_ = host_agent_store(master_addr);
  const int port = store_ ? store_->getPort() : opts_.master_port;
  const pid_t parent = ::getpid();
  for (int r = 0; r < opts_.nproc; ++r) spawn(r, master_addr, port, node_env[r], parent);
  running_ = opts_.nproc;
}

void Launch::spawn(int r, const std::string& master_addr, int port,
                   const std::map<std::string, std::string>& node_env, pid_t parent) {
  const bool direct = r == 0 && opts_.rank0_direct && !opts_.capture;
  int out_fds[2] = {-1, -1}, err_fds[2] = {-1, -1};
  if (!direct) {
    LVX_CHECK(::pipe(out_fds) == 0 && ::pipe(err_fds) == 0,
              "launch: pipe failed: ", std::strerror(errno));
  }
  pid_t pid = ::fork();
  LVX_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (::getppid() != parent) _exit(127);
    ::setpgid(0, 0);
    if (!direct) {
      ::dup2(out_fds[1], STDOUT_FILENO);
      ::dup2(err_fds[1], STDERR_FILENO);
      for (int fd : {out_fds[0], out_fds[1], err_fds[0], err_fds[1]}) ::close(fd);
    }
    exec_rank(r, local_, opts_, master_addr, port, node_env, store_ != nullptr, argv_);
  }
  kids_[r].pid = pid;
  kids_[r].start = std::chrono::steady_clock::now();
  if (!direct) {
    ::close(out_fds[1]);
    ::close(err_fds[1]);
    ::fcntl(out_fds[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err_fds[0], F_SETFL, O_NONBLOCK);
    kids_[r].fd[0] = out_fds[0];
    kids_[r].fd[1] = err_fds[0];
  }
  result_.ranks[r].rank = r;
}

void Launch::stop_all(int sig) {
  for (auto& k : kids_)
    if (k.running) ::kill(-k.pid, sig), ::kill(k.pid, sig);
}

// Stops every running rank, marking them 124 (they count as failed, the first one named).
void Launch::stop_for_time(const std::string& why) {
  std::string names;
  int n = 0;
  for (int r = 0; r < opts_.nproc; ++r) {
    if (!kids_[r].running) continue;
    result_.ranks[r].exit_code = 124;
    names += str(names.empty() ? "" : ",", r);
    ++n;
    if (result_.first_failed < 0) {
      result_.first_failed = r;
      result_.exit_code = 124;
    }
  }
  const std::string msg =
      str("lvx launch: ", why, "; stopping rank", n > 1 ? "s " : " ", names, " (exit 124)\n");
  if (opts_.capture) {
    for (int r = 0; r < opts_.nproc; ++r)
      if (kids_[r].running) result_.ranks[r].output += msg;
  } else {
    std::cerr << msg << std::flush;
  }
  stopping_ = true;
  stop_at_ = std::chrono::steady_clock::now();
  stop_all(SIGTERM);
}

void Launch::drain(int owner, int s) {
  Child& k = kids_[owner];
  std::string& partial = k.partial[s];
  char buf[65536];
  ssize_t n;
  while ((n = ::read(k.fd[s], buf, sizeof(buf))) > 0) {
    partial.append(buf, n);
    size_t nl;
    while ((nl = partial.find('\n')) != std::string::npos) {
      emit(result_.ranks[owner], partial.substr(0, nl + 1), opts_.capture, s == 1);
      partial.erase(0, nl + 1);
    }
  }
  if (n == 0) {  // EOF: the rank closed this output (normally: it exited)
    if (!partial.empty()) emit(result_.ranks[owner], partial + "\n", opts_.capture, s == 1);
    partial.clear();
    ::close(k.fd[s]);
    k.fd[s] = -1;
  }
}

void Launch::poll_outputs() {
  std::vector<pollfd> pfds;
  std::vector<std::pair<int, int>> owners;  // (rank, 0 stdout | 1 stderr)
  for (int r = 0; r < opts_.nproc; ++r)
    for (int s = 0; s < 2; ++s)
      if (kids_[r].fd[s] >= 0) {
        pfds.push_back({kids_[r].fd[s], POLLIN, 0});
        owners.emplace_back(r, s);
      }
  if (!pfds.empty())
    ::poll(pfds.data(), pfds.size(), 50);
  else
    ::usleep(20000);
  for (size_t i = 0; i < pfds.size(); ++i)
    if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(owners[i].first, owners[i].second);
}

// The ranks that exited since the last look; the first failure stops the others
// (stop_on_failure).
void Launch::reap() {
  for (int r = 0; r < opts_.nproc; ++r) {
    Child& k = kids_[r];
    if (!k.running) continue;
    int status = 0;
    if (::waitpid(k.pid, &status, WNOHANG) != k.pid) continue;
    k.running = false;
    --running_;
    RankExit& e = result_.ranks[r];
    e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - k.start).count();
    if (e.exit_code != 124)
      e.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (first_exit_ < 0) {
      first_exit_ = r;
      first_exit_at_ = std::chrono::steady_clock::now();
    }
    if (e.exit_code == 0 || result_.first_failed >= 0 || stopping_) continue;
    result_.first_failed = r;
    result_.exit_code = e.exit_code;
    if (!opts_.stop_on_failure) continue;
    if (!opts_.capture)
      std::cerr << "lvx launch: rank " << r << " " << describe_exit(e.exit_code)
                << "; stopping the other ranks" << std::endl;
    stopping_ = true;
    stop_at_ = std::chrono::steady_clock::now();
    stop_all(SIGTERM);
  }
}

// A signal to forward, --timeout, --exit-wait after the first exit, and the grace before
// SIGKILL.
void Launch::check_deadlines() {
  if (opts_.forward_signals && g_launcher_signal && !forwarded_) {
    forwarded_ = true;
    stop_all(g_launcher_signal);
  }
  const auto now = std::chrono::steady_clock::now();
  auto since = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(now - t).count();
  };
  if (opts_.timeout_s > 0 && !stopping_ && running_ > 0 && since(t0_) > opts_.timeout_s)
    stop_for_time(str("time limit of ", opts_.timeout_s, " s (--timeout) reached"));
  if (exit_wait_s_ > 0 && !stopping_ && running_ > 0 && first_exit_ >= 0 &&
      since(first_exit_at_) > exit_wait_s_)
    stop_for_time(str("still running ", exit_wait_s_, " s after rank ", first_exit_, " ",
                      describe_exit(result_.ranks[first_exit_].exit_code),
                      " (--exit-wait, default 2 × LVX_DIST_TIMEOUT_S): lvx ranks fail any ",
                      "communication wait within LVX_DIST_TIMEOUT_S, so these are stuck"));
  if (stopping_ && since(stop_at_) > opts_.grace_s) stop_all(SIGKILL);
}

void Launch::watch() {
  struct sigaction old_term = {};
  struct sigaction old_int = {};
  if (opts_.forward_signals) {
    g_launcher_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = remember_launcher_signal;
    ::sigaction(SIGTERM, &sa, &old_term);
    ::sigaction(SIGINT, &sa, &old_int);
  }
  while (running_ > 0) {
    poll_outputs();
    reap();
    check_deadlines();
  }
  if (opts_.forward_signals) {
    ::sigaction(SIGTERM, &old_term, nullptr);
    ::sigaction(SIGINT, &old_int, nullptr);
  }
}

// Every rank has exited: what they wrote last (often the error that ended them) may still sit
// in the pipes. Read it out; a pipe kept open by a rank's own child gets a short grace.
void Launch::drain_rest() {
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (bool open = true; open && std::chrono::steady_clock::now() < drain_until;) {
    open = false;
    for (int r = 0; r < opts_.nproc; ++r)
      for (int s = 0; s < 2; ++s)
        if (kids_[r].fd[s] >= 0) {
          drain(r, s);
          open = open || kids_[r].fd[s] >= 0;
        }
    if (open) ::usleep(10000);
  }
  for (int r = 0; r < opts_.nproc; ++r)
    for (int s = 0; s < 2; ++s)
      if (kids_[r].fd[s] >= 0) {
        if (!kids_[r].partial[s].empty())
          emit(result_.ranks[r], kids_[r].partial[s] + "\n", opts_.capture, s == 1);
        ::close(kids_[r].fd[s]);
      }
}

}  // namespace

LaunchResult launch_local(const std::vector<std::string>& argv, const LaunchOptions& opts) {
  LVX_CHECK(!argv.empty(), "launch: no command given (usage: lvx launch --nproc N -- cmd ...)");
  LVX_CHECK(opts.nproc >= 1, "launch: --nproc must be at least 1, got ", opts.nproc);
  LVX_CHECK(opts.nodes >= 1 && opts.nproc % opts.nodes == 0, "launch: --nodes ", opts.nodes,
            " must be at least 1 and divide --nproc ", opts.nproc);
  Launch launch(argv, opts);
  launch.spawn_all();
  launch.watch();
  launch.drain_rest();
  return launch.result();
}

}  // namespace lvx::dist
