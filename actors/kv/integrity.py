"""The KV manager's invariants over its block tables, checked in one place (mini-sglang's
`check_integrity()`; asked for with the `CheckIntegrity` query, and by the tests after every
scenario). Pure: no torch, no asyncio.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenloom.actors.kv.block_pool import BlockPool
from tokenloom.actors.kv.prefix_cache import PrefixCache


def check_tables(pool: BlockPool, tables: Mapping[str, list[int]], cache: PrefixCache | None,
                 committed: Mapping[str, int], reserved: int = 0,
                 logical: Mapping[str, int] | None = None) -> None:
    """Raise ``AssertionError`` describing the first broken invariant, if any.

    Pool invariants, plus: every block in a table is used; no table holds a block twice;
    each table block's ref_cnt equals the number of tables holding it (blocks are shared
    only through prefix hits and forks); the distinct table blocks are exactly the used
    blocks; and, with caching, the prefix cache's own invariants and no request committed
    beyond the table it holds. `reserved`: blocks the pool holds outside every table
    (a hybrid layout's NULL_BLOCK); `logical`: each table's length in blocks where it is
    not the number of blocks it holds (a sliding group's dropped entries).
    """
    pool.check_integrity()
    holders: dict[int, list[str]] = {}
    for rid, table in tables.items():
        if len(set(table)) != len(table):
            raise AssertionError(f"request {rid!r} holds a block twice: {table}")
        for block_id in table:
            if pool.is_free(block_id):
                raise AssertionError(f"request {rid!r} holds free block {block_id}")
            holders.setdefault(block_id, []).append(rid)
    for block_id, rids in holders.items():
        ref_cnt = pool.ref_count(block_id)
        if ref_cnt < len(rids):
            raise AssertionError(
                f"block {block_id} is held by both {rids[0]!r} and {rids[1]!r}"
                f"{f' (and {len(rids) - 2} more)' if len(rids) > 2 else ''} but has "
                f"ref_cnt {ref_cnt}"
            )
        if ref_cnt > len(rids):
            raise AssertionError(
                f"block {block_id} has ref_cnt {ref_cnt} but {len(rids)} table(s) hold it"
            )
    if len(holders) + reserved != pool.num_used_blocks:
        raise AssertionError(
            f"tables hold {len(holders)} blocks{f' (+ {reserved} reserved)' if reserved else ''}"
            f" but the pool has {pool.num_used_blocks} used"
        )
    if cache is not None:
        cache.check_integrity()
        for rid, done in committed.items():
            length = (logical or {}).get(rid, len(tables.get(rid, ())))
            if rid not in tables or done > length:
                raise AssertionError(f"request {rid!r} committed {done} blocks but holds "
                                     f"{length}")
