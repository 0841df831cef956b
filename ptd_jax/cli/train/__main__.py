"""`python -m ptd_jax.cli.train`: the same as the `ptd-train` console script."""

import sys

from ptd_jax.cli.train.command import main

sys.exit(main())
