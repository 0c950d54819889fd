"""Real frameworks' executors, with fake models, swept: every row holds (issue 26).

Run by `nox -s frameworks`, which installs google-adk, a2a-adapter and LangGraph at pinned
versions; skipped where they are not installed (the default matrix).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from a2a_cancelfix.testing import sweep

EXAMPLES = Path(__file__).parent.parent / "examples"
GRACE = 0.2

# ADK marks its A2A support experimental, with a warning at each use.
pytestmark = pytest.mark.filterwarnings("ignore:.*EXPERIMENTAL.*:UserWarning")


@pytest.fixture(autouse=True)
def examples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.asyncio
@pytest.mark.parametrize("factory", ["executor", "wrapped"])
async def test_an_adk_agent_sweeps_clean(factory: str) -> None:
    """ADK's A2aAgentExecutor as it is, and as to_a2a's agent_executor_factory wraps it."""
    pytest.importorskip("google.adk")
    import adk_agent

    report = await sweep(getattr(adk_agent, factory), grace_period=GRACE)
    assert report.ok, str(report)
    kinds = {row.point.kind for row in report.rows[1:] if row.point}
    assert {"publish", "published", "ended"} <= kinds


@pytest.mark.asyncio
async def test_a_langgraph_agent_behind_a2a_adapter_sweeps_clean() -> None:
    pytest.importorskip("a2a_adapter")
    pytest.importorskip("langgraph")
    import langgraph_agent

    report = await sweep(langgraph_agent.executor, grace_period=GRACE)
    assert report.ok, str(report)
    assert len(report.rows) > 1


def teardown_module() -> None:
    for name in ("adk_agent", "langgraph_agent"):
        sys.modules.pop(name, None)


def test_the_readme_shows_what_a_correct_agent_prints() -> None:
    """`a2a-cancelfix sweep langgraph_agent:executor` prints the README's table, exit 0."""
    pytest.importorskip("a2a_adapter")
    readme = (EXAMPLES.parent / "README.md").read_text().split("## Testing your executor", 1)[1]
    shown = readme.split("```text\n", 1)[1].split("```", 1)[0]
    command = [sys.executable, "-W", "ignore", "-m", "a2a_cancelfix", "sweep", "langgraph_agent:executor"]
    result = subprocess.run(command, cwd=EXAMPLES, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == shown
