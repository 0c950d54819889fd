"""Each cancel scenario, on the installed a2a-sdk: what stock does, what the wrapper alone does, what we do."""

import logging

import pytest

from a2a_cancelfix.testing import IN_PROCESS, ScriptedExecutor, make_server, sweep
from a2a_cancelfix.testing.servers import HANDLERS
from a2a_cancelfix.tools.scenarios import SCENARIOS, Scenario, run_scenario

from .expected import COLUMNS, STOCK, STOCK_IN_PROCESS, WRAPPED, column
from .sweep_executors import Agent

ids = [scenario.name for scenario in SCENARIOS]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=ids)
def test_ours_holds_the_contract(scenario: Scenario) -> None:
    """Our handler ends every scenario the way the contract says."""
    assert run_scenario(scenario, "ours") == scenario.expected


@pytest.mark.parametrize("scenario", SCENARIOS, ids=ids)
def test_stock_behaves_as_documented(scenario: Scenario) -> None:
    """The SDK's own handler does what the README's table says for this release."""
    assert run_scenario(scenario, "stock") == STOCK[scenario.name][column()]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=ids)
def test_wrapper_alone_behaves_as_documented(scenario: Scenario) -> None:
    """The SDK's handler around a CancellableExecutor fixes what the README says it fixes."""
    differs = WRAPPED.get(scenario.name, (None,) * len(COLUMNS))[column()]
    assert run_scenario(scenario, "wrapped") == (differs or scenario.expected)


@pytest.mark.parametrize("name", sorted(STOCK_IN_PROCESS))
def test_calls_made_in_process_are_not_what_clients_see(name: str) -> None:
    """The same scenario, called straight on the stock handler, shows what the README says it
    does in process; where that differs from the table, the table is what clients see."""
    scenario = next(scenario for scenario in SCENARIOS if scenario.name == name)
    assert run_scenario(scenario, "stock", IN_PROCESS) == STOCK_IN_PROCESS[name][column()]


def test_every_scenario_is_documented() -> None:
    """The expectation tables name exactly the scenarios that exist."""
    assert set(STOCK) == set(ids)
    assert set(WRAPPED) <= set(ids) and set(STOCK_IN_PROCESS) <= set(ids)


@pytest.mark.asyncio
@pytest.mark.filterwarnings("error::DeprecationWarning")
async def test_the_kits_servers_use_no_deprecated_sdk_call(caplog: pytest.LogCaptureFixture) -> None:
    """The kit builds the SDK's push sender as the installed release wants it: 1.0.2+ log that
    the context it no longer uses is deprecated (a log line, not a DeprecationWarning)."""
    with caplog.at_level(logging.WARNING, logger="a2a"):
        for kind in HANDLERS:
            make_server(kind, ScriptedExecutor())
        report = await sweep(Agent, origins=("local",), grace_period=0.2)
    assert report.ok, str(report)
    deprecated = [r.getMessage() for r in caplog.records if "backward compatibility" in r.getMessage()]
    assert not deprecated, deprecated
