"""``python -m a2a_cancelfix``: the ``a2a-cancelfix`` command (a2a_cancelfix.tools.cli)."""

import sys

from a2a_cancelfix.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
