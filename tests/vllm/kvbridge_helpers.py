"""Helpers shared by the vLLM bridge tests."""

from __future__ import annotations

from engine_reporter.builder import ReportBuilder


def mirror_of(builder: ReportBuilder) -> dict[int, tuple[int | None, bytes]]:
    """A reporter's cache mirror, ``hash -> (parent, bytes)``, read through its snapshot."""
    out: dict[int, tuple[int | None, bytes]] = {}
    for chain in builder.snapshot("0-0").blocks:
        parent = chain.parent_hash
        for h, block in zip(chain.hashes, chain.blocks, strict=True):
            out[h] = (parent, block)
            parent = h
    return out
