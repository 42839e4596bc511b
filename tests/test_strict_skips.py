"""Strict mode (LOCALRUN_TEST_STRICT=1, as `make test` runs): a skip the test does not declare fails
the run, and so do an empty parameter list (cases taken from a folder that holds none) and an
expected failure that could as well pass (a non-strict xfail); declared skips and strict expected
failures stay as they are. Run on a small test file with this suite's own hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .conftest import REPO, STRICT

CASES = '''
import pytest

CASES = sorted(__import__("pathlib").Path(__file__).parent.glob("no-such-cases/*.txt"))


@pytest.mark.parametrize("path", CASES)
def test_empty_parameters(path):
    pass


@pytest.mark.skip(reason="later")
def test_bare_skip_marker():
    pass


def test_skip_at_run_time():
    pytest.skip("an input is missing")


@pytest.mark.expected_skip("another platform")
def test_declared_skip():
    pytest.skip("another platform")


@pytest.mark.skipif(True, reason="another platform")
def test_skipif_that_holds():
    pass


@pytest.mark.xfail(reason="a known defect", strict=True)
def test_expected_failure():
    assert False


@pytest.mark.xfail(reason="maybe")
def test_loose_xfail():
    assert False


@pytest.mark.xfail(reason="maybe")
def test_loose_xfail_that_passes():
    pass


def test_xfail_at_run_time():
    pytest.xfail("not today")


def test_plain():
    pass
'''
# The suite's own hooks, as its conftest defines them.
CONFTEST = "from tests.conftest import pytest_configure, pytest_make_collect_report, pytest_runtest_makereport\n"


def _outcomes(tmp_path: Path, strict: bool, cases: str = CASES, *options: str) -> dict[str, tuple[str, str]]:
    """Each test's outcome (passed, failed, skipped) and message, from a pytest run in a child process."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(cases)
    report = tmp_path / "report.xml"
    # Only pytest and these hooks: the installed plugins (hypothesis, snapshots, timeout) play no part.
    env = {**os.environ, "PYTHONPATH": str(REPO), STRICT: "1" if strict else "0", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path),
         f"--junitxml={report}", *options, "test_cases.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert report.exists(), res.stdout + res.stderr
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        children = {c.tag: c.get("message", "") for c in case}
        tag = next((o for o in ("failure", "error", "skipped") if o in children), "passed")
        outcome = "failed" if tag in ("failure", "error") else tag  # a skip at setup fails as an error
        out[case.get("name", "")] = (outcome, children.get(tag, ""))
    expected_rc = 1 if any(o == "failed" for o, _ in out.values()) else 0
    assert res.returncode == expected_rc, res.stdout + res.stderr
    return out


def test_strict_fails_undeclared_skips_and_empty_parameter_lists(tmp_path: Path) -> None:
    got = _outcomes(tmp_path, strict=True)
    assert set(got) == {"test_empty_parameters[NOTSET]", "test_bare_skip_marker", "test_skip_at_run_time",
                        "test_declared_skip", "test_skipif_that_holds", "test_expected_failure", "test_plain",
                        "test_loose_xfail", "test_loose_xfail_that_passes", "test_xfail_at_run_time"}
    for name in ("test_loose_xfail", "test_loose_xfail_that_passes", "test_xfail_at_run_time"):
        assert got[name][0] == "failed" and "non-strict xfail" in got[name][1], (name, got[name])
    outcome, message = got["test_empty_parameters[NOTSET]"]
    assert outcome == "failed" and "empty parameter list" in message and STRICT in message, message
    for name in ("test_bare_skip_marker", "test_skip_at_run_time"):
        assert got[name][0] == "failed" and "unexpected skip" in got[name][1], (name, got[name])
    for name in ("test_declared_skip", "test_skipif_that_holds", "test_expected_failure"):
        assert got[name][0] == "skipped", (name, got[name])
    assert got["test_plain"] == ("passed", "")


def test_without_strict_the_same_skips_are_skips(tmp_path: Path) -> None:
    got = _outcomes(tmp_path, strict=False)
    assert {name for name, (outcome, _) in got.items() if outcome != "skipped"} == \
        {"test_plain", "test_loose_xfail_that_passes"}, got  # an unexpected pass of a loose xfail passes


@pytest.mark.parametrize("empty_mark", ["skip", "xfail"])
def test_an_empty_parameter_list_fails_whatever_pytest_marks_it(tmp_path: Path, empty_mark: str) -> None:
    cases = "import pytest\n\n@pytest.mark.parametrize('x', [])\ndef test_empty(x):\n    pass\n"
    got = _outcomes(tmp_path, True, cases, "-o", f"empty_parameter_set_mark={empty_mark}")
    [(outcome, message)] = got.values()
    assert outcome == "failed" and "empty parameter list" in message, got
