"""A relayed video job whose gateway is killed mid-job is taken over by another gateway replica: it completes,
the stages finished before the kill are not run again, and the MP4 downloads through the surviving gateway."""

from __future__ import annotations

import io
import re

import httpx
import pytest

from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow
pytest.importorskip("diffusers")
av = pytest.importorskip("av")

STEPS = 16  # two denoise stages of 8 steps: long enough that the kill lands mid-job
BODY = {"model": "t2v", "prompt": "a cat on a red sofa", "size": "64x64", "num_frames": 8, "fps": 4}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from coderai.tiny_models.diffusion import ensure_tiny_t2v

    root = tmp_path_factory.mktemp("takeover")
    models = write_models_file(
        root / "models.toml",
        [
            {
                "name": "t2v",
                "engine": "video",
                "path": str(ensure_tiny_t2v()),
                "params": {"threads": 1, "steps": STEPS, "stages": 2},
            },
            {
                "name": "t2v-whole",
                "engine": "video",
                "path": str(ensure_tiny_t2v()),  # one engine runs the whole job
                "params": {"threads": 1, "steps": STEPS},
            },
        ],
    )
    nats = NatsServer(root / "nats").start()
    # a short takeover threshold, so the test waits seconds, not the default 20 s
    s = Stack(root, nats.url, extra_env={"CODERAI_WORKER_FAMILIES": "video", "CODERAI_GATEWAY_VIDEO_TAKEOVER_S": "3"})
    try:
        s.start_core(models)
        s.start_worker("w1")
        s.start_gateway("--no-auth")
        s.wait_engines_ready(["t2v", "t2v-whole"], timeout_s=180)
        yield s
    finally:
        s.stop()
        nats.stop()


@pytest.fixture(scope="module")
def gateway_b(stack) -> str:
    """A second gateway replica on the same bus: the one that takes jobs over."""
    from coderai.runtime.embedded import free_port

    port = free_port()
    stack.start("gateway-b", "coderai.gateway", ["--port", str(port), "--no-auth"], ready=None)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, 60, "gateway B /healthz")
    return url + "/v1"


def test_a_job_whose_gateway_dies_completes_through_another(stack, gateway_b):
    b_url = gateway_b
    a_url, gateway_a = stack.base_url, stack.procs["gateway"]
    made = httpx.post(f"{a_url}/videos", json=BODY, timeout=30)
    assert made.status_code == 200, made.text
    vid = made.json()["id"]

    def video(url: str) -> dict:
        return httpx.get(f"{url}/videos/{vid}", timeout=10).json()

    # wait until encode and the first denoise half are done, then pull gateway A's plug
    before = wait_until(
        lambda: (v := video(b_url)) and (len(v["stages"]) >= 2 or v["status"] != "in_progress") and v,
        120,
        "the first two stages of the job",
    )
    gateway_a.kill()
    assert before["status"] == "in_progress" and len(before["stages"]) < 4, (
        f"the job ended before gateway A was killed ({before['status']}, stages {before['stages']}): "
        f"make it longer (STEPS, num_frames) so the kill lands mid-job"
    )

    done = wait_until(
        lambda: (v := video(b_url))["status"] in ("completed", "failed") and v,
        120,
        "the job to finish through gateway B",
    )
    assert done["status"] == "completed", done
    assert done["takeovers"] == 1
    # the stages finished before the kill are kept as they were, and the rest ran after them
    assert done["stages"][: len(before["stages"])] == before["stages"]
    kinds = [(s["kind"], s["start"], s["end"]) for s in done["stages"]]
    half = STEPS // 2
    assert kinds == [("encode", 0, 0), ("denoise", 0, half), ("denoise", half, STEPS), ("decode", STEPS, STEPS)]
    # ... and the worker ran each of them once (the stage in flight at the kill may have run twice)
    log = stack.procs["worker-w1"].log_text()
    rid = vid.removeprefix("video_")
    for s in before["stages"]:
        what = s["kind"] if s["kind"] != "denoise" else f"denoise {s['start']}..{s['end']}"
        assert len(re.findall(rf"stage {re.escape(what)} of {rid} started", log)) == 1, what

    mp4 = httpx.get(f"{b_url}/videos/{vid}/content", timeout=30)
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == BODY["num_frames"] and (frames[0].width, frames[0].height) == (64, 64)


def test_a_whole_model_job_whose_gateway_dies_runs_again_through_another(stack, gateway_b):
    """Without stages there is no handoff to go on from: the replica that takes the job over runs it again."""
    if not stack.procs["gateway"].alive():  # the test above killed the first gateway A
        stack.start_gateway("--no-auth")
    made = httpx.post(f"{stack.base_url}/videos", json={**BODY, "model": "t2v-whole"}, timeout=30)
    assert made.status_code == 200, made.text
    vid = made.json()["id"]

    def video() -> dict:
        return httpx.get(f"{gateway_b}/videos/{vid}", timeout=10).json()

    def started() -> dict | None:
        v = video()
        return v if v["progress"] > 0 or v["status"] not in ("queued", "in_progress") else None

    before = wait_until(started, 120, "the job to make progress")
    stack.procs["gateway"].kill()
    assert before["status"] == "in_progress", f"the job ended before gateway A was killed: {before}"
    done = wait_until(
        lambda: (v := video())["status"] in ("completed", "failed") and v, 180, "the job to finish through gateway B"
    )
    assert done["status"] == "completed" and done["takeovers"] == 1, done
    mp4 = httpx.get(f"{gateway_b}/videos/{vid}/content", timeout=30)
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
