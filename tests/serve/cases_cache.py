"""lvx serve cases: the visual cache and uploads.

Every rank hits on a repeat and a hit encodes nothing; a file changed in place misses; a
caller's video_id or uuid never stands in for other bytes (uuids are scoped to their API key);
uploads go to private folders that leave nothing behind.
"""
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from harness import (
    KEY, KEY2, FRAMES, TOKENS, qa_json, video_part, messages, ask, file_url, data_url,
    expect_error, descendants)


def case_cache_hits_and_changed_file(fx, srv, ranks):
    path = fx.media / "changing.mp4"
    shutil.copy(fx.clip, path)
    m0 = srv.metrics()
    a = ask(srv, video_part(file_url(path)))
    m1 = srv.metrics()
    b = ask(srv, video_part(file_url(path)))
    m2 = srv.metrics()
    assert a.choices[0].message.content == b.choices[0].message.content
    hits = lambda m: m["lvx_visual_cache_hits_total"]
    misses = lambda m: m["lvx_visual_cache_misses_total"]
    assert hits(m2) - hits(m1) == ranks and misses(m2) == misses(m1), (m1, m2)
    # A hit decodes and encodes nothing: the slowest rank's encoding time is the lookup's.
    lvx = b.model_extra["lvx"]
    vc = lvx["visual_cache"]
    assert {k: vc[k] for k in ("hits", "misses")} == {"hits": ranks, "misses": 0}, vc
    # The prompt prefix (up to the last frame token) ran once: the repeat starts from its state.
    assert vc["prefix_reused"] is True and vc["prefix_tokens"] > 0, vc
    assert m2["lvx_prefix_reuses_total"] - m1["lvx_prefix_reuses_total"] == 1, (m1, m2)
    assert lvx["timings"]["encode_s"] < 0.01, lvx
    assert m2["lvx_visual_cache_bytes"] > 0
    # The file changes in place (same name): no rank may use the old features.
    shutil.copy(fx.other, path)
    c = ask(srv, video_part(file_url(path)))
    m3 = srv.metrics()
    assert misses(m3) - misses(m2) == ranks and hits(m3) == hits(m2), (m2, m3)
    assert c.choices[0].message.content == qa_json(fx, fx.other, ranks)["response"]
    # A caller's video_id names a video but never stands in for its bytes: another client's
    # upload under the same id gets its own video's answer, not the cached one.
    third = fx.make_clip("third.mp4", "rgbtestsrc=size=64x48:rate=4", 4)  # never asked about
    ask(srv, video_part(file_url(fx.clip)), extra_body={"video_id": "clip-1"})
    m4 = srv.metrics()
    spoof = ask(srv, video_part(data_url(third, "video/mp4")), extra_body={"video_id": "clip-1"})
    m5 = srv.metrics()
    assert misses(m5) - misses(m4) == ranks, (m4, m5)
    assert spoof.choices[0].message.content == qa_json(fx, third, ranks)["response"]
    # Another question about the same video reuses it too, and still answers as `lvx qa` does.
    q2 = "What is shown in the video?"
    d = srv.client.chat.completions.create(
        model="model", messages=messages(video_part(file_url(fx.clip)), question=q2),
        temperature=0, max_tokens=TOKENS)
    assert d.model_extra["lvx"]["visual_cache"]["prefix_reused"] is True
    assert d.choices[0].message.content == qa_json(fx, fx.clip, ranks, question=q2)["response"]


def case_uploads_stay_private(fx, srv, ranks):
    # Uploads go into private folders of unpredictable names: a link planted where the server
    # used to write (/tmp/lvx-serve-<pid>-<n>) catches nothing, no upload folder stays behind,
    # uploads leave no frame index in the index cache, and a playlist cannot reach other files.
    victim = Path(tempfile.mkdtemp(dir=fx.root))
    tmp = Path(tempfile.gettempdir())
    # Every rank makes its folders in the run's own temporary folder (so the check below sees
    # this server's, never another suite's).
    for pid in descendants(srv.proc.pid) + [srv.proc.pid]:
        env = Path("/proc/%s/environ" % pid).read_bytes().split(b"\0")
        assert ("TMPDIR=%s" % tmp).encode() in env, (pid, tmp)
    planted = []
    for pid in descendants(srv.proc.pid) + [srv.proc.pid]:
        for n in range(3):
            link = tmp / ("lvx-serve-%d-%d" % (pid, n))
            if not os.path.lexists(link):
                os.symlink(victim, link)
                planted.append(link)
    index = Path(os.environ["LVX_TEST_INDEX_DIR"])
    before_index = sorted(index.rglob("*"))
    before_dirs = set(tmp.glob("lvx-serve-*"))
    try:
        r = ask(srv, video_part(data_url(fx.clip, "video/mp4")))
        assert r.choices[0].message.content == qa_json(fx, fx.clip, ranks)["response"]
        assert list(victim.iterdir()) == [], list(victim.iterdir())
        # Rank 0's folder goes with the request, just after its answer is sent.
        deadline = time.time() + 5
        while set(tmp.glob("lvx-serve-*")) - before_dirs and time.time() < deadline:
            time.sleep(0.05)
        left = set(tmp.glob("lvx-serve-*")) - before_dirs
        assert not left, left
        assert sorted(index.rglob("*")) == before_index, "an upload left a frame index"
        # An HLS playlist naming a file on the server is refused, not followed.
        playlist = fx.root / "list.m3u8"
        playlist.write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:4\n#EXTINF:4.0,\n"
                            "file://%s\n#EXT-X-ENDLIST\n" % fx.clip)
        err = expect_error(srv, 400, json.dumps({"model": "model", "messages": messages(
            video_part(data_url(playlist, "video/mp4")))}))
        # Error texts name the client's media, never our source files or temporary paths.
        assert ".cpp" not in err["message"] and "lvx-serve-" not in err["message"], err
        assert "the uploaded video" in err["message"], err
    finally:
        for link in planted:
            link.unlink()


def uuid_part(uuid, url=None):
    """vLLM's video part with a uuid; without a URL the video is left out (named by the uuid)."""
    return {"type": "video_url", "video_url": {"url": url} if url else None, "uuid": uuid}


def case_uuid_scoped_to_key(fx, srv, ranks):
    # vLLM's per-part uuid: sent once with its video, it names that video's content under the API
    # key that sent it, so a later request may leave the video out.
    hits = lambda m: m["lvx_visual_cache_hits_total"]
    want = qa_json(fx, fx.clip, ranks)["response"]
    first = ask(srv, uuid_part("clip-7", data_url(fx.clip, "video/mp4")))
    assert first.choices[0].message.content == want
    m1 = srv.metrics()
    named = ask(srv, uuid_part("clip-7"))
    m2 = srv.metrics()
    assert named.choices[0].message.content == want
    assert hits(m2) - hits(m1) == ranks, (m1, m2)
    body = lambda part, **kw: json.dumps(
        {"model": "model", "messages": messages(part), "max_tokens": TOKENS, **kw})
    # Another key (another tenant) does not know the name; nor does anyone a name never sent.
    err = expect_error(srv, 400, body(uuid_part("clip-7")), key=KEY2)
    assert err["code"] == "uuid_not_found" and "clip-7" in err["message"], err
    err = expect_error(srv, 400, body(uuid_part("never-sent")))
    assert err["code"] == "uuid_not_found", err
    # The name sent again with other bytes names them from then on (content, never a slot).
    other = qa_json(fx, fx.other, ranks)["response"]
    assert ask(srv, uuid_part("clip-7", data_url(fx.other, "video/mp4"))).choices[0].message.content == other
    assert ask(srv, uuid_part("clip-7")).choices[0].message.content == other
    # Named, but not cached with these frame settings: refused, saying to send the video again.
    err = expect_error(srv, 400, body(uuid_part("clip-7"), num_frames=FRAMES + 2))
    assert "send the video again" in err["message"], err
    # The second key names its own videos; uuids on image_url parts and malformed ones are refused.
    srv.client.api_key = KEY2
    try:
        assert ask(srv, uuid_part("clip-7", file_url(fx.clip))).choices[0].message.content == want
        assert ask(srv, uuid_part("clip-7")).choices[0].message.content == want
    finally:
        srv.client.api_key = KEY
    assert ask(srv, uuid_part("clip-7")).choices[0].message.content == other  # the first key's
    image = {"type": "image_url", "image_url": {"url": data_url(fx.clip, "image/png")}, "uuid": "x"}
    assert "video_url part only" in expect_error(srv, 400, body(image))["message"]
    assert "printable" in expect_error(srv, 400, body(uuid_part("", file_url(fx.clip)) | {"uuid": 7}))["message"]
