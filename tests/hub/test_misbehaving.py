"""Pull from a Hub that misbehaves as real servers do: ignored Range, drops, 429, redirects, bad lengths."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from localrun import api, download
from localrun.errors import HubError
from localrun.hub import repo_cache_dir

from .. import reliability
from .conftest import UnrulyHub
from .repos import QUANT_REPO
from .server import GOOD_TOKEN

Q4 = "stories-260k-Q4_K_M.gguf"
DROP_AT = 300_000  # the first GET of a file ends here, so what follows is a resume


def blobs() -> Path:
    return repo_cache_dir(QUANT_REPO) / "blobs"


def body_gets(hub: UnrulyHub, sha: str) -> list[tuple[str | None, int, int]]:
    """(Range, status, body bytes) of each GET of a file's content, without bounded header reads."""
    return [
        (r.range, r.status, r.sent)
        for r in hub.requests(f"/lfs/{sha}", "GET")
        if not (r.range or "").startswith("bytes=0-")
    ]


def installed(sha: str) -> bool:
    """The blob is in the cache, verified, and the model is listed."""
    blob = blobs() / sha
    names = {m.name for m in api.list_models()}
    return (
        blob.exists()
        and hashlib.sha256(blob.read_bytes()).hexdigest() == sha
        and "stories-260k:q4_k_m" in names
    )


def nothing_installed(sha: str) -> bool:
    """No blob, no snapshot, no listed model: a failed pull left the cache as it found it."""
    return (
        not (blobs() / sha).exists()
        and not (repo_cache_dir(QUANT_REPO) / "snapshots").exists()
        and not any(m.name.startswith("stories-260k") for m in api.list_models())
    )


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backoff between retries is the client's politeness, not what these tests are about."""
    monkeypatch.setattr(download, "BACKOFF_BASE", 0.001)
    monkeypatch.setattr(download, "BACKOFF_MAX", 0.001)


# -- 1. Range ignored -----------------------------------------------------------------------------
def test_resume_answered_200_with_whole_body_is_not_appended(unruly_hub: UnrulyHub, cli) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    unruly_hub.fault(f"/lfs/{sha}", "drop", after=DROP_AT)
    unruly_hub.misbehave(f"/lfs/{sha}", "ignore_range", times=-1)
    res = cli("pull", QUANT_REPO, env=unruly_hub.env())
    assert res.returncode == 0, res.stderr
    assert body_gets(unruly_hub, sha) == [(None, 200, DROP_AT), (f"bytes={DROP_AT}-", 200, size)]
    assert (blobs() / sha).stat().st_size == size  # not DROP_AT + size
    assert installed(sha)
    assert not (blobs() / f"{sha}.incomplete").exists()
    reliability.fault("misbehaving Hub", "Range ignored")


# -- 2. drops during a resume ---------------------------------------------------------------------
def test_connection_dropped_during_resume_is_resumed_again(
    unruly_hub: UnrulyHub, fast_backoff: None
) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    unruly_hub.fault(f"/lfs/{sha}", "drop", after=DROP_AT)
    unruly_hub.misbehave(f"/lfs/{sha}", "drop", after=200_000, times=2, resumes_only=True)
    result = api.pull(QUANT_REPO)
    assert body_gets(unruly_hub, sha) == [
        (None, 200, DROP_AT),
        ("bytes=300000-", 206, 200_000),
        ("bytes=500000-", 206, 200_000),
        ("bytes=700000-", 206, size - 700_000),
    ]
    assert result.downloaded_bytes == size
    assert installed(sha)
    reliability.fault("misbehaving Hub", "dropped transfers")


def test_connection_that_keeps_dropping_fails_clearly_and_keeps_the_partial(
    unruly_hub: UnrulyHub, fast_backoff: None
) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    unruly_hub.fault(f"/lfs/{sha}", "drop", after=DROP_AT)
    drops = unruly_hub.misbehave(f"/lfs/{sha}", "drop", after=0, times=-1, resumes_only=True)
    with pytest.raises(HubError) as err:
        api.pull(QUANT_REPO)
    assert f"downloading '{Q4}' failed after {download.MAX_RETRIES} retries" in err.value.message
    assert f"{DROP_AT} of {size} bytes are kept" in err.value.message
    assert "it resumes where it stopped" in (err.value.hint or "")
    assert len(drops.hits) == download.MAX_RETRIES  # every retry after the last byte received
    assert (blobs() / f"{sha}.incomplete").stat().st_size == DROP_AT
    assert nothing_installed(sha)

    drops.times = 0  # the link is back: the next pull fetches only the rest
    result = api.pull(QUANT_REPO)
    assert body_gets(unruly_hub, sha)[-1] == (f"bytes={DROP_AT}-", 206, size - DROP_AT)
    assert result.downloaded_bytes == size - DROP_AT
    assert installed(sha)
    reliability.fault("misbehaving Hub", "dropped transfers")


# -- 3. 429 with Retry-After ----------------------------------------------------------------------
def test_429_waits_for_retry_after_then_succeeds(unruly_hub: UnrulyHub) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    limited = unruly_hub.misbehave(f"/lfs/{sha}", "retry_after", retry_after="1")
    api.pull(QUANT_REPO)
    assert [s for _, s, _ in body_gets(unruly_hub, sha)] == [429, 200]
    # The wait is the behaviour under test: the retry came no sooner than the server asked.
    retry = [t for t, path, _ in unruly_hub.unruly.arrivals if sha in path and t > limited.hits[0]]
    assert retry and retry[0] - limited.hits[0] >= 1.0
    assert installed(sha)
    reliability.fault("misbehaving Hub", "429 Retry-After")


def test_429_with_a_huge_retry_after_is_reported_not_waited(unruly_hub: UnrulyHub, cli) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    limited = unruly_hub.misbehave(f"/lfs/{sha}", "retry_after", retry_after="3600", times=-1)
    # The child's timeout guards against the hang this test is about; it is not a speed limit.
    res = cli("pull", QUANT_REPO, env=unruly_hub.env(), timeout=120)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"localrun: downloading '{Q4}': the server answered HTTP 429 and asked to wait 3600 s before"
        f" retrying, longer than the 60 s localrun waits; 0 of {unruly_hub.state.repos[QUANT_REPO].files[Q4].size}"
        " bytes are kept; run the same pull again later: it resumes where it stopped"
    )
    assert len(limited.hits) == 1  # told once, not hammered
    assert nothing_installed(sha)
    assert not (blobs() / f"{sha}.incomplete").exists()  # nothing held, no empty partial left
    reliability.fault("misbehaving Hub", "429 Retry-After")


def test_retry_after_http_date_and_garbage() -> None:
    from datetime import datetime, timedelta, timezone
    from email.utils import format_datetime

    later = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=120), usegmt=True)
    assert 100 < (download.retry_after(later) or 0) <= 120
    assert download.retry_after("7") == 7.0
    assert download.retry_after("soon") is None and download.retry_after(None) is None


# -- 4. redirect to another host ------------------------------------------------------------------
def test_redirect_to_storage_host_follows_without_the_token(
    unruly_hub: UnrulyHub, monkeypatch: pytest.MonkeyPatch, fast_backoff: None
) -> None:
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    assert unruly_hub.state.cdn_url != unruly_hub.url  # the bytes live on another origin
    unruly_hub.fault(f"/lfs/{sha}", "drop", after=DROP_AT)  # so a resumed request is redirected too
    api.pull(QUANT_REPO)
    resolves = [r for r in unruly_hub.requests("/resolve/", "GET") if r.path.endswith(Q4)]
    storage = unruly_hub.requests(f"/lfs/{sha}", "GET")
    assert resolves and all(r.port == "hub" and r.status == 302 and r.auth for r in resolves)
    assert storage and all(r.port == "cdn" and not r.auth for r in storage)  # the token stayed home
    assert body_gets(unruly_hub, sha) == [
        (None, 200, DROP_AT),
        (f"bytes={DROP_AT}-", 206, size - DROP_AT),
    ]
    assert installed(sha)
    reliability.fault("misbehaving Hub", "redirects to a storage host")


# -- 5. body shorter or longer than announced -----------------------------------------------------
def test_body_shorter_than_content_length_is_resumed(
    unruly_hub: UnrulyHub, fast_backoff: None
) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    unruly_hub.misbehave(f"/lfs/{sha}", "short", after=1000)
    api.pull(QUANT_REPO)
    assert body_gets(unruly_hub, sha) == [
        (None, 200, size - 1000),
        (f"bytes={size - 1000}-", 206, 1000),
    ]
    assert installed(sha)
    reliability.fault("misbehaving Hub", "wrong body lengths")


def test_junk_after_content_length_is_not_written(unruly_hub: UnrulyHub) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    unruly_hub.misbehave(f"/lfs/{sha}", "long", after=4096)
    api.pull(QUANT_REPO)
    assert (blobs() / sha).stat().st_size == size
    assert installed(sha)
    # The connection the junk arrived on is not reused as if it were clean.
    assert api.pull(f"{QUANT_REPO}:Q8_0").model.name == "stories-260k:q8_0"
    reliability.fault("misbehaving Hub", "wrong body lengths")


def test_body_longer_than_the_file_is_refused_before_writing(unruly_hub: UnrulyHub) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    size = unruly_hub.state.repos[QUANT_REPO].files[Q4].size
    unruly_hub.misbehave(f"/lfs/{sha}", "overlong", after=4096)
    with pytest.raises(HubError) as err:
        api.pull(QUANT_REPO)
    assert err.value.message == (
        f"the server announced {size + 4096} bytes from byte 0 for '{Q4}', but the Hub"
        f" lists {size} bytes; nothing was written"
    )
    assert nothing_installed(sha)
    assert not list(blobs().iterdir())  # no partial file either
    api.pull(QUANT_REPO)
    assert installed(sha)
    reliability.fault("misbehaving Hub", "wrong body lengths")


def test_unannounced_body_past_the_file_size_deletes_the_partial(unruly_hub: UnrulyHub) -> None:
    sha = unruly_hub.sha256(QUANT_REPO, Q4)
    unruly_hub.misbehave(f"/lfs/{sha}", "unannounced", after=4096)
    with pytest.raises(
        HubError,
        match=rf"the server sent more than the \d+ bytes of '{Q4}'; the partial file was"
        " deleted and nothing was installed",
    ):
        api.pull(QUANT_REPO)
    assert nothing_installed(sha)
    assert not list(blobs().iterdir())
    api.pull(QUANT_REPO)
    assert installed(sha)
    reliability.fault("misbehaving Hub", "wrong body lengths")
