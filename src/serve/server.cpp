// lvx serve's HTTP side on rank 0 (routes, the API key, binding) and its life from listening to
// stopping; the pieces are listed in server_impl.h.
#include "src/serve/server.h"

#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <thread>

#include "src/common/error.h"
#include "src/serve/connection.h"
#include "src/serve/http_framing.h"
#include "src/serve/kv_budget.h"
#include "src/serve/server_impl.h"

namespace lvx::serve {

std::atomic<bool> g_stop_signal{false};

namespace {

// The reservation of the request this HTTP thread handles (cpp-httplib runs a request's
// pre-routing handler, its handler and its logger on one thread, one request after another).
thread_local InflightBudget::Reservation t_body;

extern "C" void on_stop_signal(int) { g_stop_signal = true; }

// Whether a client's text equals a secret, in time that depends on the secret's length only (no
// early exit at the first differing byte, which would let a client find the key byte by byte).
bool same_secret(const std::string& given, const std::string& secret) {
  volatile unsigned char diff = given.size() == secret.size() ? 0 : 1;
  for (size_t i = 0; i < secret.size(); ++i)
    diff = diff | static_cast<unsigned char>(secret[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

}  // namespace

InflightBudget::Reservation take_body_reservation() { return std::move(t_body); }

std::variant<InflightBudget::Reservation, ApiError> Server::reserve_body(
    const httplib::Request& req) {
  const int64_t bytes = declared_body_bytes(req, o_.max_body_bytes);
  std::optional<InflightBudget::Reservation> r = budget_.reserve(bytes);
  if (r) return std::move(*r);
  if (bytes > budget_.limit())
    return ApiError(413, "invalid_request_error",
                    "the request body (" + std::to_string(bytes) +
                        " bytes) is larger than all the server holds of requests at once (" +
                        std::to_string(budget_.limit()) + " bytes, --max-inflight-bytes)");
  return ApiError(429, "rate_limit_error",
                  "the server holds " + std::to_string(budget_.held()) + " of its " +
                      std::to_string(budget_.limit()) +
                      " bytes of requests in flight (--max-inflight-bytes): try again later",
                  "", "inflight_full");
}

std::optional<std::string> Server::key_scope(const httplib::Request& req) const {
  if (o_.api_keys.empty()) return std::string();
  // Every key is compared, whichever matches: the time says nothing about which one did.
  const std::string given = req.get_header_value("Authorization");
  size_t match = o_.api_keys.size();
  for (size_t i = 0; i < o_.api_keys.size(); ++i)
    if (same_secret(given, "Bearer " + o_.api_keys[i])) match = i;
  if (match == o_.api_keys.size()) return std::nullopt;
  return "key" + std::to_string(match);
}

ApiError Server::unauthorized(const httplib::Request& req) const {
  return ApiError(401, "invalid_request_error",
                  req.has_header("Authorization")
                      ? "Incorrect API key provided"
                      : "Missing API key: send 'Authorization: Bearer <key>'",
                  "", "invalid_api_key");
}

Verdict Server::verdict_of(const ApiError& e) {
  metrics_.count(e.status);
  Verdict v;
  v.status = e.status;
  v.body = e.body_text();
  if (e.status == 429) v.headers.emplace_back("Retry-After", "1");
  return v;
}

Verdict Server::judge(const httplib::Request& head) {
  Verdict v;
  if (head.method == "GET" && head.path == "/health") {
    v.status = !failed_ && !stopping() ? 200 : 503;
    v.body = json{{"status", failed_      ? "failed"
                             : stopping() ? "shutting down"
                                          : "ok"},
                  {"ranks", pg_.world_size()}}
                 .dump();
    return v;
  }
  const bool has_key = key_scope(head).has_value();
  if (head.method == "GET" && head.path == "/metrics" && (o_.metrics_public || has_key)) {
    v.status = 200;
    v.body = metrics_text();
    v.content_type = "text/plain; version=0.0.4";
    return v;
  }
  if (!has_key) return verdict_of(unauthorized(head));
  if (std::optional<ApiError> bad = framing_error(head, o_.max_body_bytes)) return verdict_of(*bad);
  auto r = reserve_body(head);
  if (auto* e = std::get_if<ApiError>(&r)) return verdict_of(*e);
  v.reserved = std::move(std::get<InflightBudget::Reservation>(r));
  return v;
}

bool Server::handle(ConnectionStream& s, InflightBudget::Reservation reserved) {
  t_body = std::move(reserved);
  set_connection_fd(s.socket());
  const bool again = http_.serve(s);
  t_body = InflightBudget::Reservation();
  set_connection_fd(-1);
  return again;
}

void Server::send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(e.body_text(), "application/json");
  metrics_.count(e.status);
}

std::string Server::metrics_text() {
  const runtime::VisualCacheStats own = session_.cache_stats();
  Gauges g;
  g.cache_entries = own.entries;
  g.cache_capacity = own.capacity;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    g.queue_depth = static_cast<int64_t>(queue_.size());
    g.kv_bytes = kv_in_use_;
  }
  g.kv_limit = o_.max_kv_bytes;
  g.running = running_.load();
  g.inflight_bytes = budget_.held();
  g.inflight_limit = budget_.limit();
  g.ranks = pg_.world_size();
  g.connections = gate_ ? gate_->open_connections() : 0;
  g.max_connections = o_.max_connections;
  return prometheus_text(metrics_, g);
}

void Server::routes(httplib::Server& http) {
  // Framing, the key and the body's reservation were judged by the gate from the headers
  // (judge); /health and /metrics are answered there.
  // After each response: what no job took is given back.
  http.set_logger([](const httplib::Request&, const httplib::Response&) {
    t_body = InflightBudget::Reservation();
  });
  http.Post("/v1/chat/completions",
            [this](const httplib::Request& req, httplib::Response& res) { chat(req, res); });
  http.Post("/v1/completions",  // the same path through the scheduler; parsed and shaped apart
            [this](const httplib::Request& req, httplib::Response& res) { chat(req, res); });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    const json models{
        {"object", "list"},
        {"data",
         {{{"id", o_.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "lvx"}}}}};
    res.set_content(models.dump(), "application/json");
  });
  // Errors httplib answers itself (413 for an oversized body, 404 for an unknown path) in
  // OpenAI's shape; those our handlers answered keep their bodies.
  http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const ApiError e =
        res.status == 413
            ? ApiError(413, "invalid_request_error",
                       "the request body is larger than the server's limit of " +
                           std::to_string(o_.max_body_bytes) + " bytes (--max-body-bytes)")
        : res.status == 404 ? ApiError(404, "invalid_request_error",
                                       "no such endpoint: " + req.method + " " + req.path)
                            : ApiError(res.status, "invalid_request_error",
                                       "HTTP error " + std::to_string(res.status));
    res.set_content(e.body_text(), "application/json");
    metrics_.count(e.status);
  });
  http.set_exception_handler(
      [this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, ApiError(500, "server_error", client_error_text(what)));
      });
}

std::string Server::bind() {
  http_.set_payload_max_length(static_cast<size_t>(o_.max_body_bytes));
  routes(http_);
  GateOptions g;
  g.host = o_.host;
  g.port = o_.port;
  g.max_connections = o_.max_connections;
  g.workers = std::min<int64_t>(o_.max_queue + 8, 512);
  g.header_timeout_s = o_.header_timeout_s;
  g.body_min_rate = o_.body_min_rate;
  g.linger_bytes = o_.max_body_bytes;
  gate_ = std::make_unique<Gate>(
      g, [this](const httplib::Request& head) { return judge(head); },
      [this](ConnectionStream& s, InflightBudget::Reservation r) {
        return handle(s, std::move(r));
      },
      [this](int status) { metrics_.count(status); });
  const std::string error = gate_->bind();
  port_ = gate_->port();
  http_.set_listening(gate_->listening_fd());
  return error;
}

void Server::print_kv_budget() const {
  // The planner's figure for one request of --max-frames frames (or 16, the default sampling)
  // and the default max_tokens, beside the budget: how many such requests run at once.
  const runtime::QaJob& qa = session_.job();
  const int64_t frames = qa.max_frames > 0 ? qa.max_frames : qa.num_frames.value_or(16);
  const int64_t one = question_kv_bytes(session_.model().planner_model(), frames, frames + 64,
                                        o_.default_max_tokens, pg_.world_size(),
                                        dtype_bytes(qa.plan.dtype, "--dtype"));
  std::cerr << "lvx serve: --max-kv-bytes " << format_bytes(o_.max_kv_bytes)
            << " per rank; the planner's KV for one question of " << frames << " frames and "
            << o_.default_max_tokens << " new tokens: " << format_bytes(one) << " per rank ("
            << o_.max_kv_bytes / std::max<int64_t>(1, one) << " at once)" << std::endl;
}

int Server::run_rank0() {
  std::thread listener([this] { gate_->run(); });
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  std::cerr << "lvx serve: " << o_.model_name << " on " << pg_.world_size()
            << " rank(s), listening on http://" << gate_->address() << ":" << port_ << std::endl;
  if (o_.max_kv_bytes > 0) print_kv_budget();
  int code = 0;
  try {
    serve_loop();
  } catch (const std::exception& e) {
    fail_everything(e);
    code = 1;
  }
  // Let the responses in flight reach their clients (bounded), then stop listening.
  const auto until = clock::now() + std::chrono::seconds(10);
  while (handlers_ > 0 && clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  gate_->stop();
  listener.join();
  http_.set_listening(-1);
  return code;
}

namespace {

// Whether every rank runs on rank 0's machine (the same host name and boot): then they read
// rank 0's upload files instead of receiving the bytes (upload.h). Collective.
bool ranks_share_host(dist::ProcessGroup& pg) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  const auto id = static_cast<int64_t>(std::hash<std::string>{}(std::string(host) + "/" + boot));
  const at::Tensor all = pg.all_gather(at::full({1, 1}, id, at::kLong));
  return all.eq(all[0][0]).all().item<bool>();
}

}  // namespace

int run_serve_rank(const ServeOptions& options) {
  auto pg = dist::ProcessGroup::from_env();
  runtime::QaSession session(options.job, pg, options.cache_bytes);
  // The questions admitted between two steps run their tokens in one pass (one at a time: as
  // lvx qa runs them).
  session.batch_prompts(options.max_batch > 1);
  Server server(options, session, ranks_share_host(*pg));
  const std::vector<std::string> errors =
      dist::gather_errors(*pg, pg->rank() == 0 ? server.bind() : std::string());
  LVX_CHECK(errors[0].empty(), errors[0]);
  return pg->rank() == 0 ? server.run_rank0() : server.run_other_rank();
}

}  // namespace lvx::serve
