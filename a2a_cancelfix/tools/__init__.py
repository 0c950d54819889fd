"""The ``a2a-cancelfix`` command and what it runs: ``check`` (the scenario catalogue, stock vs
ours, and ``--repro`` scripts), ``demo``, ``sweep`` and ``play`` (through the testing kit).

Tools, not runtime: a server imports none of this package, and the runtime modules import
nothing from it.
"""
