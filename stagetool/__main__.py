"""``python -m stagetool`` runs the command line."""

import sys

if __name__ == "__main__":  # not when a worker process (multiprocessing's spawn) imports it as __mp_main__
    from stagetool.cli import main

    sys.exit(main())
