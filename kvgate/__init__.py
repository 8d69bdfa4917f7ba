"""kvgate. Importing it first checks the optional compiled build of the router's hot path
(:mod:`kvgate.native`): a stale or disabled build falls back to the pure-Python source."""

from kvgate.native import guard as _guard

_guard()
