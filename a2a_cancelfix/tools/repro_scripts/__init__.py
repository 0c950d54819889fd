"""The scripts of ``a2a-cancelfix check --repro``, as modules that ruff and mypy check.

``prelude.py`` starts every script; each other file is one scenario's part (the scenario names it
by its ``script``), an ``async def scenario() -> str`` that returns what the run showed.
``repro`` joins the prelude and a scenario's part, less its imports, into one standalone file.
"""
