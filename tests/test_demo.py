"""The `a2a-cancelfix demo` server: its commands work, its log tells what each cancel did."""

import builtins
import json
import logging

import httpx
import pytest

from a2a_cancelfix._sdk import SDK_VERSION
from a2a_cancelfix.tools import demo


def demo_sdk_maps_to_conflict() -> bool:
    """a2a-sdk 1.0.0 answers TaskNotCancelable over REST with 409; later releases with 400."""
    return SDK_VERSION == "1.0.0"


def test_says_what_to_install_when_the_server_extras_are_missing(monkeypatch, capsys) -> None:
    """Without uvicorn, the command names the extra to install and exits 2."""
    real_import = builtins.__import__

    def no_uvicorn(name, *args, **kwargs):
        if name == "uvicorn":
            raise ImportError("No module named 'uvicorn'", name="uvicorn")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    assert demo.run("127.0.0.1", 8000) == 2
    assert "pip install 'a2a-cancelfix[demo]'" in capsys.readouterr().out


def test_instructions_name_every_command() -> None:
    """The banner has ready-to-paste commands to send, stream, subscribe, cancel and get."""
    text = demo.instructions("http://127.0.0.1:9999")
    for needle in ("SendMessage", "SendStreamingMessage", ":subscribe", ":cancel", "/rest/tasks/TASK_ID "):
        assert needle in text


@pytest.mark.asyncio
async def test_a_cancel_through_the_demo_ends_canceled_and_is_logged(monkeypatch, caplog) -> None:
    """A task started with the banner's JSON-RPC call and cancelled over REST ends CANCELED."""
    monkeypatch.setattr(demo, "STEP_SECONDS", 3600.0)  # Still working when the cancel lands.
    app = demo.build_app("127.0.0.1", 9999)
    headers = {"A2A-Version": "1.0"}
    send = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {
            "message": {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "write a report"}]},
            "configuration": {"returnImmediately": True},
        },
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://demo", timeout=10) as client:
        answer = (await client.post("/", json=send, headers=headers)).json()
        task_id = answer["result"]["task"]["id"]
        with caplog.at_level(logging.INFO, logger="a2a_cancelfix"):
            cancelled = await client.post(f"/rest/tasks/{task_id}:cancel", headers=headers)
        assert json.loads(cancelled.text)["status"]["state"] == "TASK_STATE_CANCELED"
        again = await client.post(f"/rest/tasks/{task_id}:cancel", headers=headers)
        assert again.status_code == (409 if demo_sdk_maps_to_conflict() else 400)
    assert any(
        f"cancel task={task_id}" in r.getMessage() and "outcome=CANCELED" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_that_cannot_be_served_is_one_error_line_and_exit_2(port, monkeypatch, capsys) -> None:
    """``demo --port 99999`` is refused as argparse refuses its arguments: one error line
    naming the option, exit 2, and no server started (it printed the banner, then the
    server's 80-line traceback)."""
    from a2a_cancelfix.tools import cli

    started = []
    monkeypatch.setattr(demo, "run", lambda host, port: started.append(port) or 0)
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--port", port])
    assert exited.value.code == 2 and started == []
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "--port" in errors[0] and "65535" in errors[0]


def test_a_port_in_range_is_served(monkeypatch) -> None:
    from a2a_cancelfix.tools import cli

    monkeypatch.setattr(demo, "run", lambda host, port: port)
    assert cli.main(["demo", "--port", "65535"]) == 65535
