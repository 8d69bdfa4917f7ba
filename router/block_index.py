"""The radix tree's block index: block hash -> (node id, end depth, block length), in a compact
open-addressing table of 16 bytes a slot (block removals name hashes; see :mod:`router.tree`)."""

from __future__ import annotations

from array import array

_SLACK = 64  # probe area past the hashed range, so probing never wraps
_MAX_LOAD = 0.8
_NID_BITS, _END_BITS, _LEN_BITS = 28, 24, 12
_END_MASK = (1 << _END_BITS) - 1
_LEN_MASK = (1 << _LEN_BITS) - 1


class _BlockIndex:
    """hash -> packed (node id, end depth, block length): linear probing over two ``array('Q')``.

    Slot 0 of ``keys`` means empty; the few entries that do not fit the packing (hash 0, keys
    over 16 MiB, blocks over 4 KiB, huge node ids) live in the ``wide`` dict instead.
    """

    __slots__ = ("_cap", "_count", "_keys", "_mask", "_vals", "wide")

    def __init__(self, bits: int = 12) -> None:
        self._alloc(bits)
        self._count = 0
        self.wide: dict[int, tuple[int, int, int]] = {}

    def _alloc(self, bits: int) -> None:
        self._cap = 1 << bits
        self._mask = self._cap - 1
        size = self._cap + _SLACK
        self._keys = array("Q", bytes(8 * size))
        self._vals = array("Q", bytes(8 * size))

    def __len__(self) -> int:
        return self._count + len(self.wide)

    def nbytes(self) -> int:
        return 16 * len(self._keys)

    def get(self, h: int) -> tuple[int, int, int] | None:
        """(node id, end depth, length) of block ``h``, or None."""
        if h == 0:
            return self.wide.get(h)
        i = self._probe(h)
        if self._keys[i] == h:
            return _unpacked(self._vals[i])
        return self.wide.get(h) if self.wide else None

    def put(self, h: int, nid: int, end: int, length: int) -> None:
        """Insert or overwrite block ``h``."""
        if h == 0 or end > _END_MASK or length > _LEN_MASK or nid >> _NID_BITS:
            if h:
                self._delete_slot(h)
            self.wide[h] = (nid, end, length)
            return
        if self.wide:
            self.wide.pop(h, None)
        i = self._probe(h)
        if self._keys[i] == h:
            self._vals[i] = _packed(nid, end, length)
        else:
            self._insert(i, h, _packed(nid, end, length))

    def claim(self, h: int, nid: int, end: int, length: int) -> tuple[int, int, int] | None:
        """Insert block ``h`` unless the index holds it at another place: then that entry,
        unchanged (the caller decides whether to :meth:`put` over it). One probe, as ``put``."""
        if h == 0 or end > _END_MASK or length > _LEN_MASK or nid >> _NID_BITS or h in self.wide:
            old = self.get(h)
            if old is not None and old != (nid, end, length):
                return old
            self.put(h, nid, end, length)
            return None
        v = _packed(nid, end, length)
        i = self._probe(h)
        if self._keys[i] != h:
            self._insert(i, h, v)
            return None
        old_v = self._vals[i]
        return None if old_v == v else _unpacked(old_v)

    def _probe(self, h: int) -> int:
        """The slot holding ``h``, else the empty slot where it goes (linear probing)."""
        keys = self._keys
        i = h & self._mask
        while True:
            k = keys[i]
            if k == h or k == 0:
                return i
            i += 1

    def _insert(self, i: int, h: int, v: int) -> None:
        """``h`` into empty slot ``i`` (from :meth:`_probe`), growing the table when full."""
        self._keys[i] = h
        self._vals[i] = v
        self._count += 1
        if self._count > self._cap * _MAX_LOAD or i >= len(self._keys) - 2:
            self._rebuild(self._cap.bit_length())

    def delete(self, h: int) -> None:
        """Remove ``h``."""
        if self.wide:
            self.wide.pop(h, None)
        if h:
            self._delete_slot(h)

    def _delete_slot(self, h: int) -> None:
        """Backward-shift deletion from the table: no tombstones."""
        keys, vals, mask = self._keys, self._vals, self._mask
        i = h & mask
        while True:
            k = keys[i]
            if k == h:
                break
            if k == 0:
                return
            i += 1
        j = i
        while True:
            j += 1
            k = keys[j]
            if k == 0:
                break
            if k & mask <= i:  # its home is at or before the hole: move it up
                keys[i] = k
                vals[i] = vals[j]
                i = j
        keys[i] = 0
        vals[i] = 0
        self._count -= 1

    def items(self) -> list[tuple[int, int, int, int]]:
        """Every (hash, node id, end, length); a copy, safe to mutate the index meanwhile."""
        out = []
        keys, vals = self._keys, self._vals
        for i, k in enumerate(keys):
            if k:
                out.append((k, *_unpacked(vals[i])))
        out.extend((h, *t) for h, t in self.wide.items())
        return out

    def _rebuild(self, bits: int) -> None:
        """Re-hash into ``2**bits`` slots, growing further if a probe run would hit the end."""
        old_keys, old_vals = self._keys, self._vals
        while True:
            self._alloc(bits)
            if self._fill(old_keys, old_vals):
                return
            bits += 1

    def _fill(self, old_keys: array, old_vals: array) -> bool:
        keys, vals, mask = self._keys, self._vals, self._mask
        last = len(keys) - 2
        count = 0
        for idx, k in enumerate(old_keys):
            if k:
                i = k & mask
                while keys[i]:
                    i += 1
                if i >= last:
                    return False
                keys[i] = k
                vals[i] = old_vals[idx]
                count += 1
        self._count = count
        return True


def _packed(nid: int, end: int, length: int) -> int:
    return (nid << (_END_BITS + _LEN_BITS)) | (end << _LEN_BITS) | length


def _unpacked(v: int) -> tuple[int, int, int]:
    return v >> (_END_BITS + _LEN_BITS), (v >> _LEN_BITS) & _END_MASK, v & _LEN_MASK
