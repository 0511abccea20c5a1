// The OpenAI chat-completions API as lvx serve speaks it: a request body read into one question
// about one video (ChatRequest), errors in OpenAI's shape, and the response objects (a
// chat.completion, or chat.completion.chunk events for streaming). Pure functions: no model, no
// sockets (src/serve/server.h runs them).
//
// Request (POST /v1/chat/completions; /v1/completions below), what lvx reads:
//   model (required, must name the served model: else 404), messages (required; the last is the
//   user's question), max_tokens | max_completion_tokens, temperature (default 0: greedy, lvx
//   qa's default, so that an answer equals lvx qa's), top_p, seed, stop (a string or up to 4),
//   stream, stream_options.include_usage, n (1 to 16 choices: n rows of the batch, the first
//   prefilling the prompt's prefix and the others reusing it from the visual cache; with a seed
//   s, choice i samples with seed s + i, so choice 0 is the n = 1 answer), user (accepted,
//   unused), logprobs and
//   top_logprobs (0 to 20; the model's log-probabilities before temperature and top-p, as vLLM's
//   default); vLLM's per-request frame settings media_io_kwargs: {video: {num_frames | fps}}
//   and mm_processor_kwargs: {num_frames | fps}; lvx extensions: num_frames | fps, start, end
//   (seconds), video_id (a name for the video in the logs; the visual cache keys by content),
//   return_prompt_ids (the prompt's token ids in the response's lvx object). Any other field is
//   refused with a 400 naming it (tools, response_format, ...), never silently ignored. The body is
//   parsed with nesting bounded (64 levels) before it is built, and error messages quote at most 64
//   characters of a value.
// Media, in the content parts of user messages: one video_url ({"url": "file:///abs/path"} under
// --allowed-local-media-path, or "data:video/<type>;base64,<bytes>"; with vLLM's per-part
// "uuid", the video_url may be null to name a video sent before), or image_url parts, each
// one frame ("data:image/<type>;base64,..." or a file:// URL): a list of frames as lmms-eval's
// openai_compatible_chat sends a video, all used in order (no sampling).
// A chat without media is answered as text alone (the template's text-only form: no frame, the
// cross layers see nothing, the visual cache is not used).
// Conversations go through the family's chat template (models/family.h, Family::prompt_chat):
// system (or developer) messages first (their texts joined by "\n"; a template without a system
// message refuses one), then user and assistant turns alternating from a user turn and ending
// with the user's question; consecutive messages of one role are one turn (texts joined by
// "\n"). The frames go with the first question, wherever the media parts were.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lvx::serve {

// An error answered with HTTP `status` and OpenAI's body {"error": {message, type, param,
// code}}.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, const std::string& message, std::string param = "",
           std::string code = "")
      : std::runtime_error(message),
        status(status),
        type(std::move(type)),
        param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
  nlohmann::json body() const;
  std::string body_text() const;  // body() as text, invalid UTF-8 replaced
};
// The usual ones.
ApiError bad_request(const std::string& message, const std::string& param = "");
// At most 64 characters of a client's text, for error messages (never a value whole).
std::string preview(const std::string& s);

// One piece of media: a file on this machine, or bytes sent in the request as a data URL: its
// base64 text, moved out of the parsed body (never copied, never held decoded), which the server
// decodes straight into a file at once (src/serve/upload.h; then path, hash and upload say where).
struct MediaRef {
  std::string path;
  std::string base64;
  std::string field;  // the part's field ("video_url", "image_url"): what its errors name
  std::string ext;    // ".mp4", ".png", ... (from the data URL's media type)
  std::string hash;   // an upload's content hash (keyed XXH3-128 of its bytes), once written
  bool upload = false;
};

struct ChatRequest {
  std::string system;        // the system messages' text ("": none)
  std::string system_param;  // the first system message ("messages[0]"), for errors
  std::vector<std::pair<std::string, std::string>> earlier;  // answered (question, answer) turns
  std::string question;  // the last user turn, open for the answer
  std::optional<MediaRef> video;
  // The video_url part's `uuid` (vLLM's convention): with the video, a name the server remembers
  // for its content under the caller's API key; without it (video_url null), the video named
  // (the server resolves it to video_hash before the request is queued).
  std::string video_uuid, video_hash;
  std::vector<MediaRef> frames;  // image_url parts, in order
  // No video_url (nor uuid) and no image_url part: a text-only chat (or a completion).
  bool text_only() const { return !video && video_uuid.empty() && frames.empty(); }
  bool completion = false;  // POST /v1/completions: `prompt` as written, no template
  std::string prompt;       // its text (before the media, when it has media parts)
  std::string prompt_after_media;
  std::optional<double> fps;
  std::optional<int64_t> num_frames;
  std::optional<double> start, end;
  std::string video_id;
  bool return_prompt_ids = false;  // lvx extension: the response's lvx.prompt_ids
  int64_t max_tokens = 0;
  double temperature = 0, top_p = 1;
  uint64_t seed = 0;
  bool seeded = false;  // the request gave its seed (else a sampled one drew a fresh one)
  int64_t n = 1;        // choices asked for
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
  bool logprobs = false;     // each completion token's log-probability...
  int64_t top_logprobs = 0;  // ...and this many most likely tokens' (0 to 20)
};

// Choices one request may ask for (`n`).
constexpr int64_t kMaxChoices = 16;

// A seed drawn from the system's entropy: a sampled request without one (OpenAI's and vLLM's: each
// request, and each of its choices, its own sample).
uint64_t fresh_seed();

struct ApiOptions {
  std::string model_name;          // what GET /v1/models lists and requests must name
  std::string allowed_media_path;  // file:// URLs must be under it (canonical); empty: refused
  int64_t default_max_tokens = 256;
  int64_t max_frames = 4096;  // frames a request may ask for or send
};

// Reads a request body. Throws ApiError: 400 (malformed JSON, a missing or ill-typed field, no
// media), 404 (another model), 403 (a file:// URL outside the allowed path, or none allowed).
// The body is taken by value and given back once parsed (a caller that moves it in holds one
// copy of a large upload's text, not two).
ChatRequest parse_chat_request(std::string body, const ApiOptions& options);
// POST /v1/completions: `prompt` (a string, or an array of one) continued as written: tokenized as
// the tokenizer's own pipeline does (its special tokens parsed, its beginning-of-text token added
// as vLLM's completions add it), no chat template. Media: `prompt` as an array of the chat API's
// content parts (text, one video_url or the image_url frames of one video, standing together),
// the frames placed where their parts stand as the family's template writes frames
// (Family::media_ids); the media token written in the text is refused by the session. Reads
// model, max_tokens, temperature, top_p, seed, stop, stream, stream_options, n, user,
// return_prompt_ids and the frame settings as the chat API does; `echo` (true), `suffix` and the
// legacy `logprobs` (> 0) are refused naming them. Returns a ChatRequest with `completion` set.
ChatRequest parse_completion_request(std::string body, const ApiOptions& options);

// An internal error's text as a client may see it: source locations ("(../video/x.cpp:27)",
// "[/pytorch/.../pair.cc:547]") removed, and a path in the server's upload folders named as what
// it holds ("the uploaded video", "the uploaded frame 3"), never our files or temporary paths.
std::string client_error_text(const std::string& internal);

// Decodes standard base64 (or base64url; padding optional, no whitespace inside) into `sink`,
// piece by piece (at most 1 MiB decoded at a time); false when malformed (the pieces before the
// fault were given).
bool base64_decode(std::string_view text, const std::function<void(std::string_view)>& sink);

// The objects sent back. `id` names the completion ("chatcmpl-..."), `created` Unix seconds.
// `logprobs`: null, or the tokens' entries (src/runtime/logprobs_json.h), sent as the choice's
// {"logprobs": {"content": [...]}}.
nlohmann::json completion_json(const std::string& id, int64_t created, const std::string& model,
                               const std::string& content, const std::string& finish_reason,
                               int64_t prompt_tokens, int64_t completion_tokens,
                               const nlohmann::json& logprobs = nullptr);
// A chunk with a delta ({"role": "assistant"}, {"content": ...} or {}), finish_reason (null
// while generating) and the entries of the tokens it carries (null: none asked).
// `index`: the choice's (n > 1).
nlohmann::json chunk_json(const std::string& id, int64_t created, const std::string& model,
                          const nlohmann::json& delta, const nlohmann::json& finish_reason,
                          const nlohmann::json& logprobs = nullptr, int64_t index = 0);
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens);
// A chat.completion or chat.completion.chunk (above) as /v1/completions answers it: object
// "text_completion", each choice's text where the message or delta was, logprobs null.
nlohmann::json as_text_completion(nlohmann::json chat_object);

}  // namespace lvx::serve
