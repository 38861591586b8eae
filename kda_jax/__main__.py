import sys

from kda_jax.cli import main

sys.exit(main())
