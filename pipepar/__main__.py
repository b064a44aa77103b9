"""``python -m pipepar ...`` runs the command line (see :mod:`pipepar.cli`)."""

import sys

from pipepar.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
