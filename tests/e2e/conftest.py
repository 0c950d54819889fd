"""The ``wire`` fixture: real servers and SDK clients for one test, on each transport."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from .harness import Wire
from .servers import TRANSPORTS


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest_asyncio.fixture
async def wire(transport: str) -> AsyncIterator[Wire]:
    harness = Wire(transport)
    try:
        yield harness
    finally:
        await harness.aclose()
