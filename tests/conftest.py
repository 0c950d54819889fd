import importlib.metadata
import sys


def pytest_report_header() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("a2a-sdk", "a2a-cancelfix", "wrapt", "protobuf")
    )
    return f"python {sys.version.split()[0]}; {versions}"

pytest_plugins = ["pytester"]
