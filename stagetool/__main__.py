"""``python -m stagetool`` runs the command line."""

import sys

from stagetool.cli import main

sys.exit(main())
