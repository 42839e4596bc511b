"""A pull whose disk fills up in the middle of a transfer: one clear error naming the disk,
nothing installed or listed, the library unchanged, the bytes already downloaded kept, and the
next pull (once there is space) resumes from them.

The Hub stand-in pauses the transfer after a known number of bytes, so the disk is filled when
the client's partial file holds exactly those bytes: a state on disk, not a moment in time.
(SIGKILL during a pull is test_pull.py's test_kill_9_then_pull_again_completes.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from localrun import api

from .. import disks, reliability
from .repos import QUANT_REPO
from .server import HubServer
from .test_pull import lfs_gets, wait_for

Q4 = "stories-260k-Q4_K_M.gguf"
PAUSED_AT = 300_000


def test_full_disk_during_pull_is_one_clear_error_and_the_next_pull_resumes(
    hub: HubServer, cli, tmp_path: Path  # noqa: ANN001
) -> None:
    sha = hub.sha256(QUANT_REPO, Q4)
    size = hub.state.repos[QUANT_REPO].files[Q4].size
    with disks.small_disk(tmp_path / "hub-cache", "80m") as disk:  # the pull's own check wants 64 MiB spare
        env = {**hub.env(), "HF_HUB_CACHE": str(disk)}
        repo_dir = disk / f"models--{QUANT_REPO.replace('/', '--')}"
        part = repo_dir / "blobs" / f"{sha}.incomplete"
        paused = hub.fault(f"/lfs/{sha}", "pause", after=PAUSED_AT)
        before = [m.to_dict() for m in api.list_models()]
        proc = subprocess.Popen([sys.executable, "-m", "localrun", "pull", QUANT_REPO], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        try:
            assert paused.reached.wait(120), proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
            wait_for(lambda: part.exists() and part.stat().st_size == PAUSED_AT, timeout=120)
            filler = disks.fill(disk)  # another program takes the rest of the disk
        finally:
            paused.release.set()  # the transfer drops; the pull resumes it onto the full disk
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if line.startswith("localrun: ")]
        assert len(errors) == 1, err
        assert f"cannot download '{Q4}' of '{QUANT_REPO}': the disk at {disk} is full" in errors[0]
        assert "nothing was installed" in errors[0] and "run the same pull again" in err
        assert [m.to_dict() for m in api.list_models()] == before
        assert not (repo_dir / "blobs" / sha).exists() and not (repo_dir / "snapshots").exists()
        kept = part.stat().st_size
        assert PAUSED_AT <= kept < size

        filler.unlink()
        res = cli("pull", QUANT_REPO, env=env)
        assert res.returncode == 0, res.stderr
        last = lfs_gets(hub, sha)[-1]
        assert (last.range, last.sent) == (f"bytes={kept}-", size - kept)
        assert (repo_dir / "blobs" / sha).stat().st_size == size and not part.exists()
        assert "stories-260k:q4_k_m" in {m.name for m in api.list_models()}
    reliability.fault("full disk", "pull")
