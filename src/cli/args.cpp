#include "src/cli/args.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/dist/rendezvous.h"

namespace lvx::cli {
namespace {

std::string env_name(const std::string& name) {
  std::string e = "LVX_";
  for (char c : name) e += c == '-' ? '_' : static_cast<char>(std::toupper(c));
  return e;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

ArgParser::ArgParser(std::string usage, std::string description)
    : usage_(std::move(usage)), description_(std::move(description)) {}

void ArgParser::add_option(const std::string& name, char short_name,
                           const std::string& default_value, const std::string& help,
                           bool required) {
  specs_.push_back({name, short_name, default_value, help, required, false});
}

void ArgParser::add_flag(const std::string& name, char short_name, const std::string& help) {
  specs_.push_back({name, short_name, "", help, false, true});
}

const ArgParser::Spec* ArgParser::find(const std::string& name) const {
  for (const auto& s : specs_)
    if (s.name == name) return &s;
  return nullptr;
}

bool ArgParser::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      for (int j = i + 1; j < argc; ++j) rest_.push_back(argv[j]);
      break;
    }
    if (a == "-h" || a == "--help") {
      std::cout << help();
      return false;
    }
    const Spec* spec = nullptr;
    std::string value;
    bool has_value = false;
    if (a.rfind("--", 0) == 0) {
      std::string name = a.substr(2);
      auto eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      spec = find(name);
      LVX_CHECK(spec != nullptr, "unknown option --", name, " (see --help)");
    } else if (a.size() == 2 && a[0] == '-') {
      for (const auto& s : specs_)
        if (s.short_name == a[1]) spec = &s;
      LVX_CHECK(spec != nullptr, "unknown option ", a, " (see --help)");
    } else {
      LVX_FAIL("unexpected argument '", a, "' (see --help)");
    }
    if (spec->is_flag) {
      LVX_CHECK(!has_value, "--", spec->name, " takes no value");
      values_[spec->name] = "1";
      continue;
    }
    if (!has_value) {
      LVX_CHECK(i + 1 < argc, "--", spec->name, " needs a value");
      value = argv[++i];
    }
    values_[spec->name] = value;
  }
  for (const auto& s : specs_) {
    if (values_.count(s.name)) continue;
    if (const char* e = std::getenv(env_name(s.name).c_str())) {
      values_[s.name] = s.is_flag ? (std::string(e) == "0" ? "" : "1") : e;
      continue;
    }
    LVX_CHECK(!s.required, "missing required option --", s.name, " (see --help)");
  }
  return true;
}

bool ArgParser::has(const std::string& name) const {
  LVX_CHECK(find(name) != nullptr, "internal: option --", name, " was never declared");
  return values_.count(name) || !find(name)->default_value.empty();
}

std::string ArgParser::get(const std::string& name) const {
  const Spec* s = find(name);
  LVX_CHECK(s != nullptr, "internal: option --", name, " was never declared");
  auto it = values_.find(name);
  return it != values_.end() ? it->second : s->default_value;
}

namespace {

// Strict integer: the whole text, within int64 (std::stoll's out_of_range named as such).
int64_t parse_int(const std::string& name, const std::string& v) {
  size_t pos = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &pos);
  } catch (const std::out_of_range&) {
    LVX_FAIL("--", name, " is out of range: '", v, "' does not fit a 64-bit integer");
  } catch (...) {
    LVX_FAIL("--", name, " expects an integer, got '", v, "'");
  }
  LVX_CHECK(pos == v.size(), "--", name, " expects an integer, got '", v, "'");
  return x;
}

}  // namespace

int64_t ArgParser::get_int(const std::string& name) const { return parse_int(name, get(name)); }

int64_t ArgParser::get_int(const std::string& name, int64_t lo, int64_t hi) const {
  const int64_t x = get_int(name);
  LVX_CHECK(x >= lo && x <= hi, "--", name, " must be in [", lo, ", ", hi, "], got ", x);
  return x;
}

double ArgParser::get_double(const std::string& name) const {
  const std::string v = get(name);
  size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(v, &pos);
  } catch (const std::out_of_range&) {
    LVX_FAIL("--", name, " is out of range: '", v, "' does not fit a double");
  } catch (...) {
    LVX_FAIL("--", name, " expects a number, got '", v, "'");
  }
  LVX_CHECK(pos == v.size(), "--", name, " expects a number, got '", v, "'");
  LVX_CHECK(std::isfinite(x), "--", name, " expects a finite number, got '", v, "'");
  return x;
}

bool ArgParser::flag(const std::string& name) const { return !get(name).empty(); }

std::vector<std::string> ArgParser::get_list(const std::string& name) const {
  return split(get(name), ',');
}

std::vector<int64_t> ArgParser::get_int_list(const std::string& name) const {
  std::vector<int64_t> out;
  for (const auto& s : get_list(name)) {
    try {
      out.push_back(parse_int(name, s));
    } catch (const Error&) {
      LVX_FAIL("--", name, " expects a comma list of 64-bit integers, got '", get(name), "'");
    }
  }
  return out;
}

std::string ArgParser::help() const {
  std::ostringstream os;
  os << "usage: " << usage_ << "\n\n" << description_ << "\n\noptions:\n";
  for (const auto& s : specs_) {
    std::string lhs = "  ";
    lhs += s.short_name ? std::string("-") + s.short_name + ", " : "    ";
    lhs += "--" + s.name + (s.is_flag ? "" : " <v>");
    os << lhs << std::string(lhs.size() < 30 ? 30 - lhs.size() : 1, ' ') << s.help;
    if (!s.default_value.empty()) os << " (default: " << s.default_value << ")";
    if (s.required) os << " (required)";
    os << " [env " << env_name(s.name) << "]\n";
  }
  os << "  -h, --help                  show this help\n";
  return os.str();
}

int available_cores() { return dist::available_cores(); }

void add_nproc_options(ArgParser& p, const std::string& default_value, const std::string& help) {
  p.add_option("nproc", 'n', default_value, help);
  p.add_flag(
      "force-nproc", 0,
      str("start --nproc ranks even beyond ", kMaxRanksPerCore, " per core of this machine"));
}

int check_nproc(int64_t n, bool force, const std::string& what) {
  LVX_CHECK(n >= 1, what, " must be >= 1, got ", n);
  const int cores = available_cores();
  const int64_t most = int64_t{kMaxRanksPerCore} * cores;
  LVX_CHECK(n <= most || (force && n <= 65536), what, " ", n, " is more than ", kMaxRanksPerCore,
            " ranks per core of this machine (", cores, " cores: at most ", most,
            "); pass --force-nproc to start them anyway");
  return static_cast<int>(n);
}

int checked_nproc(const ArgParser& p) {
  return check_nproc(p.get_int("nproc"), p.flag("force-nproc"));
}

void add_device_option(ArgParser& p) {
  p.add_option("device", 0, "auto",
               "auto | cuda | cpu: where each rank's tensors live (auto: cuda:LOCAL_RANK when\n"
               "CUDA devices are visible, else cpu; one GPU per local rank, never shared)");
}

void add_threads_option(ArgParser& p) {
  p.add_option("threads", 0, "auto",
               "intra-op threads per rank (auto: OMP_NUM_THREADS when set, else cores / local "
               "ranks)");
}

void add_chunk_keys_option(ArgParser& p) {
  p.add_option("max-batch-visual-keys", 0, "0",
               "with --max-batch-tokens: a chunk also ends before its tokens' visual key reads\n"
               "pass this many (each token counts the keys of the images it sees, all ranks;\n"
               "one token at least): shorter chunks late in a long video, at the cost of more\n"
               "passes over its keys (docs/serve.md); 0: no bound");
}

int64_t chunk_keys(const ArgParser& p) { return p.get_int("max-batch-visual-keys", 0, INT64_MAX); }

int local_rank_count(int local_ranks) {
  if (const char* l = std::getenv("LOCAL_WORLD_SIZE"); l && std::atoi(l) > 0) return std::atoi(l);
  if (const char* o = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); o && std::atoi(o) > 0)
    return std::atoi(o);
  if (dist::launched_as_rank()) return dist::rendezvous_from_env().local_world_size;  // Slurm
  return local_ranks;
}

void add_decode_ranks_option(ArgParser& p) {
  p.add_option("decode-ranks", 0, "one",
               "one: rank 0 decodes each new token on every local rank's cores, the other ranks\n"
               "answering only at the cross-attention layers (their visual keys never move);\n"
               "all: every rank runs every decode step, one pass-Q message per layer");
}

bool decode_on_lead(const ArgParser& p) {
  const std::string ranks = p.get("decode-ranks");
  LVX_CHECK(ranks == "one" || ranks == "all", "--decode-ranks must be one or all, got '", ranks,
            "'");
  return ranks == "one";
}

int host_threads(int threads) {
  return std::max(threads, std::min(available_cores(), threads * local_rank_count(1)));
}

int apply_threads(const ArgParser& p, int local_ranks) {
  const int cores = available_cores();
  int threads = 0;
  if (p.get("threads") != "auto") {
    threads = static_cast<int>(p.get_int("threads", 1, 4096));
  } else if (const char* env = std::getenv("OMP_NUM_THREADS"); env && std::atoi(env) > 0) {
    threads = std::min(4096, std::atoi(env));
  } else {
    threads = std::max(1, cores / std::max(1, local_rank_count(local_ranks)));
  }
  at::set_num_threads(threads);
  return threads;
}

}  // namespace lvx::cli

namespace lvx::cli {

void pin_option_for_ranks(std::vector<std::string>& cmd, const std::string& name, char short_name,
                          const std::string& value) {
  const std::string long_form = "--" + name, short_form = std::string("-") + short_name;
  std::vector<std::string> out;
  for (size_t i = 0; i < cmd.size(); ++i) {
    const std::string& a = cmd[i];
    if (i > 0 && (a == long_form || (short_name != 0 && a == short_form))) {
      ++i;  // and its value
      continue;
    }
    if (i > 0 && a.rfind(long_form + "=", 0) == 0) continue;
    out.push_back(a);
  }
  cmd = std::move(out);
  if (value.empty())
    ::unsetenv(env_name(name).c_str());
  else
    ::setenv(env_name(name).c_str(), value.c_str(), 1);
}

bool inside_rank() { return dist::launched_as_rank(); }

int launch_model_job(int argc, char** argv, int nproc, const std::string& model,
                     const std::string& adapter, bool rank0_direct) {
  std::vector<std::string> cmd{dist::self_executable()};
  for (int i = 0; i < argc; ++i) cmd.push_back(argv[i]);
  pin_option_for_ranks(cmd, "model", 'm', model);
  pin_option_for_ranks(cmd, "adapter", 0, adapter);
  dist::LaunchOptions o;
  o.nproc = nproc;
  o.rank0_direct = rank0_direct;
  return dist::launch_local(cmd, o).exit_code;
}

}  // namespace lvx::cli
