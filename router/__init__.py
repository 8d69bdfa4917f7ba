"""The router (its hot modules may be compiled: see :mod:`kvgate.native`)."""

import kvgate  # noqa: F401  (runs the compiled-build guard before any router module loads)
