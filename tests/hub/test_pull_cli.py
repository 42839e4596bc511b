"""`pull` as the README shows it, through the command line against the local Hub: a file named
with REPO:FILE, and the pulled model running at once."""

from __future__ import annotations

import json

from .repos import QUANT_REPO
from .server import HubServer


def test_pull_a_named_file_then_run_it(hub: HubServer, cli) -> None:  # noqa: ANN001
    res = cli("pull", f"{QUANT_REPO}:stories-260k-Q8_0.gguf", env=hub.env())
    assert res.returncode == 0, res.stderr
    assert "installed stories-260k:q8_0" in res.stderr
    listed = {m["name"]: m for m in json.loads(cli("list", "--json", env=hub.env()).stdout)}
    assert listed["stories-260k:q8_0"]["quantization"] == "Q8_0"
    assert "stories-260k:q4_k_m" not in listed  # only the file asked for
    run = cli("run", "stories-260k:q8_0", "Once upon a time", "--raw", "--json", "--temperature", "0",
              "--max-tokens", "8", env=hub.env())
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["completion_tokens"] > 0

    missing = cli("pull", f"{QUANT_REPO}:no-such-file.gguf", env=hub.env())
    assert missing.returncode != 0 and "no-such-file.gguf" in missing.stderr and "Traceback" not in missing.stderr


def test_pull_revision_pins_the_commit(hub: HubServer, cli) -> None:  # noqa: ANN001
    sha = hub.state.repos[QUANT_REPO].sha
    res = cli("pull", f"{QUANT_REPO}:Q4_K_M", "--revision", sha, env=hub.env())
    assert res.returncode == 0, res.stderr
    path = json.loads(cli("show", "stories-260k:q4_k_m", "--json", env=hub.env()).stdout)["path"]
    assert f"/snapshots/{sha}/" in path  # the file of that commit
    assert any(f"/resolve/{sha}/" in r.path for r in hub.requests(f"/{QUANT_REPO}/resolve/"))
    unknown = cli("pull", f"{QUANT_REPO}:Q4_K_M", "--revision", "no-such-branch", env=hub.env())
    assert unknown.returncode != 0 and "no-such-branch" in unknown.stderr and "Traceback" not in unknown.stderr
