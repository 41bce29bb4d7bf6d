"""`python -m hetrain` is the `hetrain` command."""

import sys

from hetrain.cli import main

sys.exit(main())
