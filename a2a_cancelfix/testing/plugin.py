"""The pytest plugin: every ``cancel_*.toml`` scenario file is a test that replays its moment.

Registered through the ``pytest11`` entry point, so installing a2a-cancelfix is enough.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix == ".toml" and file_path.name.startswith("cancel_"):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    """A scenario file: one test, its moment."""

    def collect(self) -> Any:
        from a2a_cancelfix.testing.scenario_file import ScenarioError, read

        try:  # Checked before anything runs: a typo is an error, never a test that tests nothing.
            read(self.path)
        except ScenarioError as error:
            raise self.CollectError(str(error)) from None
        yield ScenarioItem.from_parent(self, name=self.path.stem)


class ScenarioItem(pytest.Item):
    """Replays the file's cancel moment; fails with the sweep's row when a promise breaks."""

    def runtest(self) -> None:
        from a2a_cancelfix.testing.scenario_file import play

        report = play(self.path)
        if not report.ok:
            raise ScenarioFailed(str(report))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (ScenarioFailed, ValueError)):  # Said in full: no traceback.
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"cancel scenario {self.name}"


class ScenarioFailed(AssertionError):
    """A replayed moment broke a promise; the message is the row."""
