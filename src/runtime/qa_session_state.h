// What a QaSession holds (qa_job.h): shared by the session's files (qa_job.cpp: the session and
// lvx qa's batch; qa_answer.cpp: one question's answer in parts).
#pragma once

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "models/model.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/runtime/qa_job.h"
#include "src/runtime/video_qa.h"
#include "src/runtime/visual_cache.h"
#include "video/pipeline.h"

namespace lvx::runtime {

struct QaSession::State {
  QaJob job;  // its plan.dtype resolved (fp32 | bf16)
  std::shared_ptr<dist::ProcessGroup> pg;
  at::Device device{at::kCPU};           // the model's: frames go there once, after preprocessing
  std::unique_ptr<models::Model> owned;  // the model the session loaded, if it did
  models::Model* model = nullptr;        // owned, or one lent by the caller (lvx finetune)
  std::unique_ptr<models::Tokenizer> tok;
  video::PreprocessConfig preprocess;
  std::vector<int64_t> stop;
  int64_t context = 0;  // the model's context length (0: unknown)
  std::unique_ptr<VisualCache> cache;
  int64_t cache_bytes_all = 0;  // every rank's visual cache, as of the last prompt or row done
  bool batch_prompts = false;   // QaSession::batch_prompts
  // The answers' workers (qa_answer.cpp) take turns: one decodes and encodes at a time on this
  // rank, as the scheduler's thread did, so many misses at once hold one video's frames, not all.
  std::mutex worker_mu;
  std::condition_variable worker_cv;
  bool worker_busy = false;
};

// The prompt of `request` about `frames` frames (QaSession::prompt; the answers' take_prompt):
// the family's chat template over the system message, earlier turns and the question.
// A raw prompt (QaRequest::raw_prompt) is its tokens alone.
inline models::PromptTokens chat_prompt(const QaSession::State& s, const QaRequest& request,
                                        int64_t frames) {
  if (request.raw_prompt) {
    const bool media = request.raw_after_media.has_value();
    // A text as written; the model's media token in it is refused (the frames go where a media
    // part stands).
    auto text = [&](const std::string& t, bool first) {
      std::vector<int64_t> ids = s.tok->encode(t, /*add_special_tokens=*/first);
      LVX_CHECK(std::find(ids.begin(), ids.end(), s.model->media_token_id()) == ids.end(),
                "the prompt holds the model's media token: ",
                media ? "the media go where its media part is"
                      : "send the media as a video_url or image_url part of the prompt");
      return ids;
    };
    models::PromptTokens p;
    p.ids = text(*request.raw_prompt, true);
    if (media) {
      const std::vector<int64_t> frames_ids = s.model->family().media_ids(*s.tok, frames);
      const std::vector<int64_t> after = text(*request.raw_after_media, false);
      p.ids.insert(p.ids.end(), frames_ids.begin(), frames_ids.end());
      p.ids.insert(p.ids.end(), after.begin(), after.end());
    }
    LVX_CHECK(!p.ids.empty(), "the prompt is empty");
    p.labels.assign(p.ids.size(), -100);
    return p;
  }
  return s.model->family().prompt_chat(*s.tok, request.item.system, request.earlier,
                                       question_text(request.item), frames);
}

}  // namespace lvx::runtime
