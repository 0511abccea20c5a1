"""lvx_videoqa for lmms-eval: rows of a local JSONL file (id, video, question, options, answer),
each a video and a multiple-choice question. The question text and the answer parsing
are lvx's own (src/runtime/video_qa.cpp question_text and parse_answer, ported line for line), so
an answer lmms-eval gets from `lvx serve` is scored as `lvx qa` scores its own."""


def _letters(n):
    out = ""
    for i in range(n):
        if i:
            out += ", or " if i + 1 == n else ", "
        out += chr(ord("A") + i)
    return out


def _has_letter_prefix(option, i):
    return len(option) >= 2 and option[0] == chr(ord("A") + i) and option[1] in ".):"


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    options = doc.get("options") or []
    if not options:
        return doc["question"]
    s = ("Select the best answer to the following multiple-choice question based on the video. "
         "Respond with only the letter (%s) of the correct option.\n%s\n"
         % (_letters(len(options)), doc["question"]))
    for i, o in enumerate(options):
        s += (o if _has_letter_prefix(o, i) else "%s. %s" % (chr(ord("A") + i), o)) + "\n"
    return s + "The best answer is:"


def doc_to_visual(doc):
    return [doc["video"]]


def doc_to_messages(doc, lmms_eval_specific_kwargs=None):
    return [{"role": "user", "content": [{"type": "video", "url": doc["video"]},
                                         {"type": "text", "text": doc_to_text(doc)}]}]


def parse_answer(options, response):
    s = response.strip(" \t\r\n")
    for prefix in ("The best answer is", "The correct answer is", "The answer is", "The answer",
                   "Best option:", "Answer:", "Option", "("):
        if s.startswith(prefix):
            s = s[len(prefix):].strip(" \t\r\n")
    for c in s:
        i = ord(c) - ord("A")
        if 0 <= i < len(options):
            return c
    return ""


def process_results(doc, results):
    return {"accuracy": float(parse_answer(doc["options"], results[0]) == doc["answer"])}
