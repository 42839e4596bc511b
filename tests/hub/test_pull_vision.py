"""Pulling a vision model from the local Hub: the projector (mmproj) comes with it, F16 chosen among
several, recorded with the entry, counted by `pull --check`, removed by `rm` (only when pulled)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from localrun import api
from localrun.hub import repo_cache_dir
from localrun.repofiles import RepoFile, choose_projector, detect_quant
from localrun.store import Store

from .repos import QUANT_REPO
from .server import HubServer

VISION_REPO = "test/Stories-Vision-GGUF"
NOT_CLIP_REPO = "test/Stories-Badproj-GGUF"
MODEL = "stories-260k-Q4_K_M.gguf"
NAME = "stories-vision:q4_k_m"
# Each projector a different size, so a test can tell which one was fetched and counted.
PROJECTORS = {"mmproj-BF16.gguf": (np.float16, 96), "mmproj-F16.gguf": (np.float16, 64),
              "mmproj-F32.gguf": (np.float32, 64)}


def write_projector(path: Path, dtype: type, width: int) -> Path:
    """A tiny valid projector GGUF: architecture clip, a vision encoder, one tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen2vl_merger")
    writer.add_tensor("v.patch_embd.weight", np.ones((width, 48), dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vision_files(hub_files: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision-files")
    files = {name: write_projector(root / name, dtype, width) for name, (dtype, width) in PROJECTORS.items()}
    quant = hub_files["quant"]
    return {MODEL: quant[MODEL], "stories-260k-Q8_0.gguf": quant["stories-260k-Q8_0.gguf"],
            "README.md": quant["README.md"], **files}


@pytest.fixture
def vision_hub(hub: HubServer, vision_files: dict[str, Path]) -> HubServer:
    hub.add_repo(VISION_REPO, vision_files, tags=["gguf", "image-text-to-text"])
    # A file named like a projector that is a text model: not recorded as the projector.
    hub.add_repo(NOT_CLIP_REPO, {MODEL: vision_files[MODEL], "mmproj-F16.gguf": vision_files["stories-260k-Q8_0.gguf"]},
                 tags=["gguf"])
    return hub


def registry() -> dict[str, dict]:
    return Store().registered()


def projector_gets(hub: HubServer, name: str) -> list:
    """Whole-file GETs of one projector of the vision repository."""
    sha = hub.sha256(VISION_REPO, name)
    return [r for r in hub.requests(f"/lfs/{sha}", "GET") if not (r.range or "").startswith("bytes=0-")]


@pytest.mark.parametrize(("names", "chosen"), [
    (["mmproj-BF16.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf"], "mmproj-F16.gguf"),
    (["mmproj-model-bf16.gguf", "mmproj-model-f32.gguf"], "mmproj-model-bf16.gguf"),
    (["mmproj-Q8_0.gguf", "mmproj-f32.gguf"], "mmproj-f32.gguf"),
    (["mmproj-b-Q8_0.gguf", "mmproj-a-Q4_0.gguf"], "mmproj-b-Q8_0.gguf"),  # the first of the list, by name
    ([], None),
])
def test_projector_preference(names: list[str], chosen: str | None) -> None:
    files = [RepoFile(n, 1, quant=detect_quant(n)) for n in names]
    got = choose_projector(files)
    assert (got.path if got else None) == chosen


def test_pull_fetches_the_f16_projector_and_rm_removes_both(vision_hub: HubServer, cli) -> None:  # noqa: ANN001
    env = vision_hub.env()
    res = cli("pull", VISION_REPO, env=env)
    assert res.returncode == 0, res.stderr
    assert "projector: mmproj-F16.gguf (" in res.stderr and "chosen from 3)" in res.stderr, res.stderr
    assert f"installed {NAME} (" in res.stderr and ", vision)" in res.stderr, res.stderr
    commit = vision_hub.state.repos[VISION_REPO].sha
    snapshot = repo_cache_dir(VISION_REPO) / "snapshots" / commit
    projector = snapshot / "mmproj-F16.gguf"
    entry = registry()[NAME]
    assert entry["mmproj"] == str(projector) and entry["source"] == "hub"
    sha = vision_hub.sha256(VISION_REPO, "mmproj-F16.gguf")
    assert os.path.realpath(projector) == str(repo_cache_dir(VISION_REPO) / "blobs" / sha)
    assert hashlib.sha256(projector.read_bytes()).hexdigest() == sha  # verified like the model
    assert len(projector_gets(vision_hub, "mmproj-F16.gguf")) == 1
    assert not projector_gets(vision_hub, "mmproj-BF16.gguf") and not projector_gets(vision_hub, "mmproj-F32.gguf")

    listed = cli("list", env=env).stdout
    row = next(line for line in listed.splitlines() if line.startswith(NAME))
    assert row.rstrip().endswith("vision"), listed
    assert "stories-vision:f16" not in listed  # the projector in the cache is no model of its own
    shown = cli("show", NAME, env=env).stdout
    assert f"projector       {projector} (" in shown, shown
    assert "vision" in json.loads(cli("show", NAME, "--json", env=env).stdout)["capabilities"]

    again = cli("pull", VISION_REPO, env=env)
    assert again.returncode == 0 and "is already installed" in again.stderr, again.stderr
    assert len(projector_gets(vision_hub, "mmproj-F16.gguf")) == 1  # nothing fetched again

    removed = cli("rm", NAME, env=env)
    assert removed.returncode == 0, removed.stderr
    assert f"removed {NAME} and its projector mmproj-F16.gguf" in removed.stderr, removed.stderr
    assert not (snapshot / MODEL).exists() and not os.path.lexists(projector)
    assert not (repo_cache_dir(VISION_REPO) / "blobs" / sha).exists()


def test_pull_json_and_check_count_the_projector(vision_hub: HubServer, cli) -> None:  # noqa: ANN001
    env = vision_hub.env()
    sizes = {name: vision_hub.state.repos[VISION_REPO].files[name].size for name in (MODEL, "mmproj-F16.gguf")}
    est = api.estimate_fit(VISION_REPO)
    plain = api.estimate_fit(QUANT_REPO)  # the same model file, without a projector
    assert est.projector == "mmproj-F16.gguf" and est.projector_bytes == sizes["mmproj-F16.gguf"]
    assert est.download_bytes == sizes[MODEL] + sizes["mmproj-F16.gguf"]
    assert est.total_bytes == plain.total_bytes + sizes["mmproj-F16.gguf"]
    assert est.to_dict()["projector_bytes"] == sizes["mmproj-F16.gguf"]

    check = cli("pull", VISION_REPO, "--check", env=env)
    assert check.returncode == 0, check.stderr
    rows = dict(line.split(None, 1) for line in check.stdout.splitlines())
    assert "mmproj-F16.gguf, loaded with the model" in rows["projector"], check.stdout
    assert "the projector included" in rows["download"], check.stdout
    assert not [r for r in vision_hub.requests("/lfs/", "GET") if not (r.range or "").startswith("bytes=0-")]

    res = cli("pull", VISION_REPO, "--json", env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["files"] == [MODEL]
    assert out["projector"] == {
        "file": "mmproj-F16.gguf", "size": sizes["mmproj-F16.gguf"],
        "chosen_from": ["mmproj-BF16.gguf", "mmproj-F16.gguf", "mmproj-F32.gguf"],
        "path": str(repo_cache_dir(VISION_REPO) / "snapshots" / out["commit"] / "mmproj-F16.gguf"),
    }
    assert out["downloaded_bytes"] == sizes[MODEL] + sizes["mmproj-F16.gguf"]
    assert "mmproj-F16.gguf" in api.list_repo_files(VISION_REPO).default  # `search --files` marks it


def test_a_shared_projector_stays_until_its_last_model_goes(vision_hub: HubServer) -> None:
    q4 = api.pull(f"{VISION_REPO}:Q4_K_M").model
    q8 = api.pull(f"{VISION_REPO}:Q8_0").model
    projector = q4.details["mmproj"]
    assert q8.details["mmproj"] == projector
    api.remove_model(q4.name)
    assert os.path.isfile(projector) and not os.path.exists(q4.path)
    api.remove_model(q8.name)
    assert not os.path.lexists(projector) and not os.path.exists(q8.path)


def test_rm_keeps_a_projector_added_in_place(vision_files: dict[str, Path], tmp_path: Path, cli) -> None:  # noqa: ANN001
    folder = tmp_path / "mine"
    folder.mkdir()
    model = Path(shutil.copy(vision_files[MODEL], folder / "mine.gguf"))
    projector = Path(shutil.copy(vision_files["mmproj-F32.gguf"], folder / "mmproj-mine.gguf"))
    added = cli("add", str(model), "--mmproj", str(projector), "--name", "mine:v")
    assert added.returncode == 0, added.stderr
    removed = cli("rm", "mine:v")
    assert removed.returncode == 0, removed.stderr
    assert f"projector kept at {projector}" in removed.stderr, removed.stderr
    assert model.is_file() and projector.is_file()


def test_entry_pulled_without_its_projector_gets_it_on_the_next_pull(vision_hub: HubServer) -> None:
    first = api.pull(VISION_REPO)
    with Store().transaction() as data:  # as pulled before projectors came with the model
        del data["models"][NAME]["mmproj"]
    again = api.pull(VISION_REPO)
    assert not again.already_installed and again.downloaded_bytes == 0  # all of it in the cache already
    assert again.model.details["mmproj"] == first.model.details["mmproj"]


def test_a_projector_that_is_no_projector_is_not_recorded(vision_hub: HubServer) -> None:
    notices: list[str] = []
    result = api.pull(NOT_CLIP_REPO, notice=notices.append)
    assert "mmproj" not in result.model.details
    assert any("'mmproj-F16.gguf'" in n and "is not a vision projector (architecture llama)" in n
               for n in notices), notices


def test_a_repository_without_projector_is_unchanged(hub: HubServer, cli) -> None:  # noqa: ANN001
    result = api.pull(QUANT_REPO)
    assert result.plan.projector is None and result.plan.downloads == result.plan.files
    assert "mmproj" not in registry()["stories-260k:q4_k_m"]
    est = api.estimate_fit(QUANT_REPO)
    assert est.projector is None and est.projector_bytes == 0 and est.download_bytes == result.plan.size
    res = cli("pull", QUANT_REPO, "--json", env=hub.env())
    assert res.returncode == 0 and json.loads(res.stdout)["projector"] is None, res.stderr
    check = cli("pull", QUANT_REPO, "--check", env=hub.env()).stdout
    assert "projector" not in check and "the projector included" not in check, check


def test_a_missing_projector_runs_as_text_with_one_warning(vision_hub: HubServer, cli) -> None:  # noqa: ANN001
    model = api.pull(VISION_REPO).model
    os.unlink(model.details["mmproj"])  # deleted by hand
    run = cli("run", NAME, "Once upon a time", "--raw", "--temperature", "0", "--max-tokens", "4",
              env=vision_hub.env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    warnings = [line for line in run.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "vision projector" in warnings[0] and "is missing" in warnings[0], run.stderr
