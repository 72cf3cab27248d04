"""CPU seconds per test, the measure behind the `slow` marker (pyproject.toml, markers).

    pytest -p cpu_time --cpu-time-report 30 -m "not slow" tests/python

Wall times on a shared 2-core machine are several times the CPU a test uses and decide nothing;
this plugin adds, around each test's setup, call and teardown, the worker's own CPU
(`time.process_time()`) and that of the child processes it waited for (`resource.getrusage`,
RUSAGE_CHILDREN: the subprocess tests' fresh JAX processes). With `--cpu-time-report N` the N
largest are printed at the end (under pytest-xdist each worker's records come back with its
reports). A test's CPU includes the first compilations of whatever it is the first to use: read a
test that is slow only as its file's first by running it after another one.
"""

from __future__ import annotations

import resource
import time

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-time-report",
        type=int,
        default=0,
        metavar="N",
        help="print the N tests that used the most CPU (user + sys, waited-for children included)",
    )


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _START in item.stash:
        # user_properties travel with the report from an xdist worker to the controller.
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_START]))


_START = pytest.StashKey[float]()
_RECORDS: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "cpu_seconds":
                _RECORDS.append((value, report.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = config.getoption("--cpu-time-report")
    if not count or not _RECORDS:
        return
    terminalreporter.section(f"CPU seconds per test (user + sys, children included), the {count} largest")
    for seconds, nodeid in sorted(_RECORDS, reverse=True)[:count]:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")
    total = sum(seconds for seconds, _ in _RECORDS)
    terminalreporter.write_line(f"{total:8.1f}  all {len(_RECORDS)} tests")
