"""Pull against the local Hub: resume, kill -9, corruption, gated, split, offline, disk space."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localrun import api
from localrun.errors import CancelledError, HubError
from localrun.hub import repo_cache_dir
from localrun.store import hf_cache_dir

from .. import reliability
from .repos import GATED_REPO, HUGE_REPO, MLX_REPO, QUANT_REPO, SPLIT_REPO, ST_REPO
from .server import GOOD_TOKEN, HubServer

Q4 = "stories-260k-Q4_K_M.gguf"


def names() -> set[str]:
    return {m.name for m in api.list_models()}


def blob_dir(repo: str) -> Path:
    return repo_cache_dir(repo) / "blobs"


def lfs_gets(hub: HubServer, sha: str) -> list:
    """GETs of a file's content, without the fit estimate's bounded read of its header."""
    return [r for r in hub.requests(f"/lfs/{sha}", "GET") if not (r.range or "").startswith("bytes=0-")]


def wait_for(condition, timeout: float = 30) -> None:
    """Poll a condition (not a fixed sleep): the test goes on as soon as it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_pull_registers_in_hf_cache_layout_and_again_is_instant(hub: HubServer, stories: Path) -> None:
    events = []
    result = api.pull(QUANT_REPO, progress=events.append)
    sha = hub.sha256(QUANT_REPO, Q4)
    m = result.model
    assert m.name == "stories-260k:q4_k_m" and m.source == "hub" and m.quantization == "Q4_K_M"
    snapshot = repo_cache_dir(QUANT_REPO) / "snapshots" / result.plan.commit
    assert m.path == str(snapshot / Q4)
    assert os.path.realpath(m.path) == str(blob_dir(QUANT_REPO) / sha)
    assert (repo_cache_dir(QUANT_REPO) / "refs" / "main").read_text() == result.plan.commit
    assert hashlib.sha256(Path(m.path).read_bytes()).hexdigest() == sha
    assert events[-1].phase == "done" and events[-1].done == events[-1].total == Path(m.path).stat().st_size
    assert "stories-260k:q4_k_m" in names()

    before = len(hub.requests())
    again = api.pull(QUANT_REPO)
    assert again.already_installed and again.downloaded_bytes == 0
    assert [r.path for r in hub.requests()[before:]] == [f"/api/models/{QUANT_REPO}"]

    # Any Hugging Face tool now finds the file without downloading it.
    from huggingface_hub import hf_hub_download

    before = len(hub.requests())
    path = hf_hub_download(QUANT_REPO, Q4, endpoint=hub.url, cache_dir=hf_cache_dir())
    assert os.path.realpath(path) == os.path.realpath(m.path)
    assert not [r for r in hub.requests()[before:] if r.method == "GET"]


def test_dropped_connection_resumes_with_only_missing_bytes(hub: HubServer) -> None:
    sha = hub.sha256(QUANT_REPO, Q4)
    hub.fault(f"/lfs/{sha}", "drop", after=400_000)
    result = api.pull(QUANT_REPO)
    size = Path(result.model.path).stat().st_size
    gets = lfs_gets(hub, sha)
    assert [(g.range, g.sent) for g in gets] == [(None, 400_000), ("bytes=400000-", size - 400_000)]
    assert sum(g.sent for g in gets) == size
    assert result.downloaded_bytes == size
    assert hashlib.sha256(Path(result.model.path).read_bytes()).hexdigest() == sha


def test_retries_server_errors_during_download(hub: HubServer) -> None:
    sha = hub.sha256(QUANT_REPO, Q4)
    hub.fault(f"/lfs/{sha}", "status", status=503, times=2)
    result = api.pull(QUANT_REPO)
    statuses = [g.status for g in hub.requests(f"/lfs/{sha}", "GET")]
    assert statuses.count(503) == 2 and statuses[-1] == 200
    assert result.model.name in names()


def test_kill_9_then_pull_again_completes(hub: HubServer, cli) -> None:
    sha = hub.sha256(QUANT_REPO, Q4)
    paused = hub.fault(f"/lfs/{sha}", "pause", after=300_000)
    part = blob_dir(QUANT_REPO) / f"{sha}.incomplete"
    proc = subprocess.Popen([sys.executable, "-m", "localrun", "pull", QUANT_REPO], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **hub.env()})
    try:
        assert paused.reached.wait(60), proc.stderr.read().decode() if proc.poll() is not None else ""
        wait_for(lambda: part.exists() and part.stat().st_size == 300_000)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        paused.release.set()
        if proc.poll() is None:
            proc.kill()
    assert part.stat().st_size == 300_000
    assert "stories-260k:q4_k_m" not in names()  # never a half-downloaded model in the list

    res = cli("pull", QUANT_REPO, env=hub.env())
    assert res.returncode == 0, res.stderr
    assert "installed stories-260k:q4_k_m" in res.stderr
    last = lfs_gets(hub, sha)[-1]
    size = (blob_dir(QUANT_REPO) / sha).stat().st_size
    assert (last.range, last.sent) == ("bytes=300000-", size - 300_000)
    assert not part.exists()
    assert "stories-260k:q4_k_m" in names()
    reliability.fault("SIGKILL", "pull")


def test_corrupted_download_is_deleted_and_not_registered(hub: HubServer) -> None:
    sha = hub.sha256(QUANT_REPO, Q4)
    hub.fault(f"/lfs/{sha}", "corrupt")
    with pytest.raises(HubError, match=r"stories-260k-Q4_K_M.gguf' is corrupted: its sha256 .*deleted and not installed"):
        api.pull(QUANT_REPO)
    assert list(blob_dir(QUANT_REPO).iterdir()) == []  # neither the blob nor a partial file
    assert not (repo_cache_dir(QUANT_REPO) / "snapshots").exists()
    assert not any(n.startswith("stories-260k") for n in names())
    # The next pull downloads it whole and installs it.
    assert api.pull(QUANT_REPO).model.name == "stories-260k:q4_k_m"


def test_corrupted_blob_from_another_tool_is_replaced(hub: HubServer) -> None:
    from huggingface_hub import hf_hub_download

    sha = hub.sha256(QUANT_REPO, Q4)
    path = Path(hf_hub_download(QUANT_REPO, Q4, endpoint=hub.url, cache_dir=hf_cache_dir()))
    blob = blob_dir(QUANT_REPO) / sha
    data = bytearray(blob.read_bytes())
    data[-10:] = b"0123456789"  # same size: huggingface_hub would keep using it
    blob.write_bytes(bytes(data))
    result = api.pull(QUANT_REPO)
    assert hashlib.sha256(Path(result.model.path).read_bytes()).hexdigest() == sha
    assert os.path.realpath(result.model.path) == os.path.realpath(path)
    assert len(lfs_gets(hub, sha)) == 2


def test_cancel_keeps_partial_and_next_pull_resumes(hub: HubServer) -> None:
    sha = hub.sha256(QUANT_REPO, Q4)
    hub.fault(f"/lfs/{sha}", "throttle", after=64 << 10, delay=0.05)  # about one second in all
    cancel = threading.Event()
    part = blob_dir(QUANT_REPO) / f"{sha}.incomplete"

    def progress(event) -> None:
        if event.done > 0:
            cancel.set()

    with pytest.raises(CancelledError, match="run the same pull again to resume"):
        api.pull(QUANT_REPO, progress=progress, cancel=cancel)
    kept = part.stat().st_size
    assert 0 < kept < hub.state.repos[QUANT_REPO].files[Q4].size
    result = api.pull(QUANT_REPO)
    assert lfs_gets(hub, sha)[-1].range == f"bytes={kept}-"
    assert result.model.name in names()


def test_split_gguf_is_one_model(hub: HubServer) -> None:
    result = api.pull(f"{SPLIT_REPO}:Q8_0")
    snapshot = repo_cache_dir(SPLIT_REPO) / "snapshots" / result.plan.commit
    parts = [snapshot / "Q8_0" / f"stories-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)]
    assert all(p.exists() for p in parts)
    assert result.model.path == str(parts[0])  # llama.cpp finds part 2 beside it by name
    listed = [m for m in api.list_models() if "stories-split" in m.name]
    assert [m.name for m in listed] == ["stories-split:q8_0"]


def test_split_gguf_not_listed_until_every_part_is_verified(hub: HubServer) -> None:
    second = "Q8_0/stories-Q8_0-00002-of-00002.gguf"
    hub.fault(f"/lfs/{hub.sha256(SPLIT_REPO, second)}", "corrupt")
    with pytest.raises(HubError, match="corrupted"):
        api.pull(f"{SPLIT_REPO}:Q8_0")
    assert not (repo_cache_dir(SPLIT_REPO) / "snapshots").exists()
    assert not any("stories-split" in n for n in names())


def test_safetensors_and_mlx_fetch_only_what_running_needs(hub: HubServer) -> None:
    result = api.pull(ST_REPO)
    assert result.model.format == "safetensors" and result.model.name == "stories-260k:latest"
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests("/resolve/", "GET")}
    fetched |= {r.path for r in hub.requests("/lfs/", "GET")}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= fetched
    assert not {"pytorch_model.bin", "onnx.onnx", "README.md"} & fetched
    assert sorted(p.name for p in Path(result.model.path).iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    mlx = api.pull(MLX_REPO)
    assert mlx.model.format == "mlx" and mlx.model.name == "stories-260k-4bit:latest"


def test_gated_repository_messages(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HubError) as err:
        api.pull(GATED_REPO)
    text = str(err.value)
    assert f"'{GATED_REPO}' is a gated repository and no Hugging Face token was sent" in text
    assert f"request access at {hub.url}/{GATED_REPO}" in text and "HF_TOKEN" in text
    monkeypatch.setenv("HF_TOKEN", "hf_not_approved")
    with pytest.raises(HubError, match="your Hugging Face token has no access to it"):
        api.pull(GATED_REPO)
    assert "stories-gated:q4_k_m" not in names()
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    assert api.pull(GATED_REPO).model.name == "stories-gated:q4_k_m"
    cdn = hub.requests("/lfs/")
    assert cdn and not any(r.auth for r in cdn)  # the token never leaves the Hub for the CDN


def test_not_found_and_server_errors(hub: HubServer, cli) -> None:
    res = cli("pull", "test/does-not-exist", env=hub.env())
    assert res.returncode == 1
    assert res.stderr.strip() == ("localrun: repository 'test/does-not-exist' was not found on the Hub; check the"
                                  " name with 'localrun search'; if it is private, set HF_TOKEN or run 'hf auth login'")
    hub.fault(f"/api/models/{QUANT_REPO}", "status", status=500)
    with pytest.raises(HubError, match=f"the Hub answered 500 for '{QUANT_REPO}'"):
        api.pull(QUANT_REPO)


def test_hub_down_uses_cache_with_a_notice_not_silently(hub: HubServer) -> None:
    first = api.pull(QUANT_REPO)
    hub.fault(f"/api/models/{QUANT_REPO}", "status", status=500)
    notices: list[str] = []
    again = api.pull(QUANT_REPO, name="again:q4", notice=notices.append)
    assert again.model.path == first.model.path
    assert len(notices) == 1 and "the Hub answered 500" in notices[0] and "using the copy cached" in notices[0]


def test_offline_mode_works_from_the_cache(hub: HubServer, monkeypatch: pytest.MonkeyPatch, cli) -> None:
    import huggingface_hub.constants as constants

    api.pull(QUANT_REPO)
    before = len(hub.requests())
    env = {**hub.env(), "HF_HUB_OFFLINE": "1"}
    res = cli("pull", QUANT_REPO, "--name", "offline:q4", env=env)
    assert res.returncode == 0, res.stderr
    assert "offline:q4" in names()
    res = cli("pull", f"{QUANT_REPO}:Q8_0", env=env)
    assert res.returncode == 1 and "cached copy" in res.stderr and "Q4_K_M" in res.stderr
    res = cli("pull", ST_REPO, env=env)
    assert res.returncode == 1
    assert f"'{ST_REPO}' is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in res.stderr
    assert len(hub.requests()) == before  # not one request
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert api.list_repo_files(QUANT_REPO).default == (Q4,)


def test_disk_space_checked_before_downloading(hub: HubServer) -> None:
    notices: list[str] = []
    with pytest.raises(HubError, match=r"not enough disk space to pull 'test/Huge-GGUF': it needs 1152\.9 PB"):
        api.pull(HUGE_REPO, notice=notices.append)
    assert any("does not fit" in n for n in notices)  # the fit warning came first
    assert all(r.range and r.range.startswith("bytes=0-") for r in hub.requests("/lfs/", "GET"))
    assert not list(blob_dir(HUGE_REPO).glob("*")) if blob_dir(HUGE_REPO).exists() else True


def test_rm_of_a_pulled_model_deletes_its_cached_files(hub: HubServer) -> None:
    result = api.pull(f"{SPLIT_REPO}:Q8_0")
    parts = [Path(result.model.path).with_name(f"stories-Q8_0-0000{i}-of-00002.gguf") for i in (1, 2)]
    blobs = [p.resolve() for p in parts]
    assert result.model.size == sum(b.stat().st_size for b in blobs)
    api.remove_model(result.model.name)
    assert not any(p.exists() or p.is_symlink() for p in parts + blobs)
    assert not any("stories-split" in n for n in names())
